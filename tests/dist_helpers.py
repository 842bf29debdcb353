"""Helpers for the multi-process tests: start gloo workers as subprocesses, and worker scripts.

Used two ways:
- imported by the multi-process tests (test_distributed.py, test_distributed_bad_input.py, ...):
  `free_port`, `spawn` (RANK/WORLD_SIZE/MASTER_* env, one subprocess per rank), `torchrun` (the
  real launcher), `wait_all` (always with a time-out).
- run as a script by those workers: `python tests/dist_helpers.py WORKER ARGS...` where WORKER is
  `comm` (count gradient all-reduces with a DDP communication hook, compare parameters across
  ranks after every step) or `train_probe` (the real `train()` with probes on the model).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import forked

REPO = Path(__file__).resolve().parents[1]
DEBUG = str(REPO / "configs" / "debug.toml")
TIMEOUT = 120  # seconds for one short 2-rank run of the debug model, start to exit
# tiny budgets: distributed tests spend their time on start-up and communication, not on eval
FAST = [
    "--optim.warmup_steps=1",
    "--eval.every=0",
    "--eval.sample_every=0",
    "--eval.tokens=512",
    "--eval.sample_tokens=1",
    "--log.progress=false",
    "--log.plot=false",
    "--log.every=1",
    "--checkpoint.every=0",
    "--train.dtype=float32",
]


# Ports for rendezvous come from a block of this pytest worker's own, below Linux's ephemeral
# range (32768-60999): a port the kernel handed out (bind to 0, a client connection) can be
# handed to another test before its rank 0 listens there, and two jobs on one port hang.
_PORT_BLOCK = 1000
_ports = itertools.count()


def free_port() -> int:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    base = 20000 + (_PORT_BLOCK * (int(worker) if worker.isdigit() else 0)) % 12000
    for _ in range(_PORT_BLOCK):
        port = base + next(_ports) % _PORT_BLOCK
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use, or lingering from an earlier test
            return port
    raise RuntimeError(f"no free port in {base}..{base + _PORT_BLOCK - 1}")


def env(**extra) -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    # faulthandler: a process that wait_all gives up on prints every thread's stack (SIGABRT)
    e.update(
        OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", PYTHONFAULTHANDLER="1"
    )
    e.update({k: str(v) for k, v in extra.items()})
    return e


def spawn(argv, world: int = 2, cwds=None, port: int | None = None, ranks=None, **extra):
    """One subprocess per rank running `python ARGV` with torchrun's variables set by hand.
    argv: one list for every rank, or a function rank -> list; ranks: a subset to start."""
    port = port or free_port()
    procs = []
    for rank in range(world) if ranks is None else ranks:
        variables = dict(
            RANK=rank,
            WORLD_SIZE=world,
            LOCAL_RANK=rank,
            LOCAL_WORLD_SIZE=world,
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        variables.update(extra)
        args = argv(rank) if callable(argv) else argv
        procs.append(
            forked.Popen(
                [sys.executable, *args],
                env=env(**variables),
                cwd=cwds[rank] if cwds else REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def torchrun(launcher_args: list[str], argv: list[str], cwd=REPO) -> subprocess.Popen:
    return forked.Popen(
        [sys.executable, "-m", "torch.distributed.run", *launcher_args, *argv],
        env=env(),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_all(procs, timeout: float = 120) -> list[tuple[int, str, str]]:
    """(returncode, stdout, stderr) per process; on time-out, what each printed, with the stack
    of every thread of those still running (SIGABRT: env()'s faulthandler), then kills them."""
    out = []
    try:
        for p in procs:
            o, e = p.communicate(timeout=timeout)
            out.append((p.returncode, o, e))
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(OSError):  # gone already
                    resource.prlimit(p.pid, resource.RLIMIT_CORE, (0, 0))  # no core file
                    os.kill(p.pid, signal.SIGABRT)
        told = []
        for rank, p in enumerate(procs):
            try:
                o, e = p.communicate(timeout=10)
            except subprocess.TimeoutExpired:  # a child of it still holds the pipes
                p.kill()
                o, e = "(still open)", "(still open)"
            told.append(
                f"--- process {rank} stdout\n{(o or '')[-2000:]}\n--- stderr\n{(e or '')[-8000:]}"
            )
        raise AssertionError(
            f"still running after {timeout} s, killed:\n" + "\n".join(told)
        ) from None
    return out


def wait_for_step(run_dir: Path, procs, step: int, timeout: float = 240) -> None:
    """Until the run's metrics.jsonl has a row for `step` (or a process ended, or time ran out)."""
    metrics, deadline = Path(run_dir) / "metrics.jsonl", time.time() + timeout
    while time.time() < deadline and all(p.poll() is None for p in procs):
        if metrics.is_file() and f'"step": {step},' in metrics.read_text():
            return
        time.sleep(0.01)


def check_ok(results) -> None:
    for rank, (rc, o, e) in enumerate(results):
        assert rc == 0, (
            f"process {rank} exited {rc}\n--- stdout\n{o[-3000:]}\n--- stderr\n{e[-3000:]}"
        )


# --- workers (run in the subprocesses) -------------------------------------------------------


def _setup(overrides: list[str]):
    """The pieces train() builds, from gptrain's own functions, on this rank."""
    import torch

    from gptrain.config.load import load_config
    from gptrain.data.loader import Dataset, TrainLoader
    from gptrain.distributed import parallelize
    from gptrain.distributed import runtime as dist
    from gptrain.training.batch import accumulation_steps
    from gptrain.training.build import build_model
    from gptrain.training.optim import build_optimizer

    cfg = load_config(DEBUG, [o.removeprefix("--") for o in overrides])
    info = dist.DistInfo.from_env("cpu")
    dist.init(info, cfg.dist.backend, cfg.dist.timeout_s)
    t = cfg.train
    dataset = Dataset(cfg.data.dir)
    loader = TrainLoader(dataset, t.seq_len, t.micro_batch_size, info.rank, info.world_size, t.seed)
    torch.manual_seed(t.seed)
    model = build_model(cfg, dataset.vocab_size)
    wrapped = parallelize.wrap_model(
        model, cfg.dist, info=info, compile=False, param_dtype=torch.float32
    )
    optimizer = build_optimizer(model, cfg.optim, device_type="cpu")
    accum = accumulation_steps(t.total_batch_size, t.micro_batch_size, t.seq_len, info.world_size)
    return cfg, info, model, wrapped, optimizer, loader, accum


def _checksums(model):
    """Per-rank fingerprint of all parameters, gathered: a list with one entry per rank."""
    import torch

    vec = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    mine = torch.stack([vec.sum(), (vec * torch.arange(len(vec), dtype=torch.float64)).sum()])
    out = [torch.zeros_like(mine) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(out, mine)
    return [o.tolist() for o in out]


_KEPT: list = []  # see worker_comm


def worker_comm(overrides: list[str], steps: int, sync_every_micro_step: bool) -> dict:
    """Train `steps` steps with train_step; per step record the gradient elements all-reduced
    (DDP communication hook) and the parameter checksums of every rank."""
    import contextlib

    import torch

    from gptrain.distributed import parallelize
    from gptrain.distributed import runtime as dist
    from gptrain.training.step import train_step

    cfg, info, model, wrapped, optimizer, loader, accum = _setup(overrides)
    calls = {"buckets": 0, "elements": 0}

    def counting_hook(state, bucket):
        """Counts, then averages the bucket as DDP does (divide, all-reduce), here and at once:
        the future handed back is already done, so no Python callback runs on gloo's threads."""
        calls["buckets"] += 1
        calls["elements"] += bucket.buffer().numel()
        buffer = bucket.buffer().div_(info.world_size)
        torch.distributed.all_reduce(buffer)
        done = torch.futures.Future()
        done.set_result(buffer)
        return done

    wrapped.register_comm_hook(None, counting_hook)
    if sync_every_micro_step:  # the control: what the counter sees when no_sync is not used
        parallelize.grad_sync = lambda wrapped, sync: contextlib.nullcontext()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    record = {
        "accum": accum,
        "params": sum(p.numel() for p in model.parameters()),
        "steps": [],
        "initial": _checksums(model),
    }
    for _ in range(steps):
        before = dict(calls)
        train_step(
            wrapped,
            model,
            optimizer,
            scaler,
            loader.next_batch,
            accum,
            contextlib.nullcontext(),
            cfg.optim.grad_clip,
        )
        record["steps"].append(
            {
                "buckets": calls["buckets"] - before["buckets"],
                "elements": calls["elements"] - before["elements"],
                "checksums": _checksums(model),
            }
        )
    dist.teardown()
    # The wrapper lives until the process ends (os._exit below): destroyed, its reducer's last
    # reference can drop on a gloo thread, whose release of the Python hook waits for the GIL
    # while this thread, holding it, joins that thread in the process group's destructor (on
    # torch 2.11 about one run in five hung there, after its last step)
    _KEPT.append(wrapped)
    return record


def worker_train_probe(overrides: list[str]) -> dict:
    """The real train(), with probes: parameter checksums of every rank before the first forward,
    and the dropout masks of the first forward on every rank."""
    import torch

    import gptrain.commands.train as gtrain
    import gptrain.training.build as gbuild
    from gptrain.config.load import load_config
    from gptrain.distributed import runtime as dist

    probe: dict = {}
    original = gbuild.build_model

    def build_with_probes(*args, **kwargs):
        model = original(*args, **kwargs)
        dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]

        def pre(module, args):
            if "initial" not in probe:
                probe["initial"] = _checksums(module)

        def mask(module, args, out):
            if module.training and "mask" not in probe:
                probe["mask"] = (out == 0).flatten()[:4096].clone()

        model.register_forward_pre_hook(pre)
        dropouts[0].register_forward_hook(mask)
        return model

    gbuild.build_model = build_with_probes
    cfg = load_config(DEBUG, [o.removeprefix("--") for o in overrides])
    info = dist.DistInfo.from_env("cpu")
    dist.init(info, cfg.dist.backend, cfg.dist.timeout_s)
    gtrain.train(cfg, info)
    masks = [torch.zeros_like(probe["mask"]) for _ in range(info.world_size)]
    torch.distributed.all_gather(masks, probe["mask"])
    dist.teardown()
    return {
        "initial": probe["initial"],
        "mask_fraction": probe["mask"].float().mean().item(),
        "masks_equal": [torch.equal(masks[0], m) for m in masks],
    }


if __name__ == "__main__":
    name, out_file, *rest = sys.argv[1:]
    if name == "comm":
        steps, every = int(rest[0]), rest[1] == "every"
        result = worker_comm(rest[2:], steps, every)
    elif name == "train_probe":
        result = worker_train_probe(rest)
    else:
        raise SystemExit(f"unknown worker {name}")
    rank = os.environ.get("RANK", "0")
    Path(f"{out_file}.{rank}").write_text(json.dumps(result))
    if _KEPT:  # nothing worker_comm kept is destroyed (see there)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    from gptrain.__main__ import exit_quickly

    exit_quickly(0)


def checkpoint_tensors(run_dir) -> dict:
    """The newest checkpoint's weights; under FSDP2 its optimizer tensors too, else the data
    cursor (as a tensor): what two runs that should end alike are compared by."""
    import torch

    from gptrain.checkpoint import dcp as sharded
    from gptrain.checkpoint import manager as checkpoint

    path = checkpoint.find(run_dir)
    meta = checkpoint.load_meta(path)
    out = checkpoint.load_model_state(path)[0]
    if meta.get("layout") == sharded.LAYOUT:
        out.update({f"optim.{k}": v for k, v in sharded.load_full(path, meta, "optim.").items()})
    else:
        out["data"] = torch.tensor(checkpoint.load_state(path)["data"]["windows_consumed"])
    return out

"""A chaos drill: a 2-rank run (`gptrain train --dist.nproc_per_node=2`, gloo, the debug model)
restarted like a requeueing scheduler would, while random ranks get faults and signals at random
moments; its last leg resumes on ONE process. At the checkpoint where that leg starts, the
weights, the optimizer state (AdamW moments, Muon momentum) and the data cursor must equal an
uninterrupted 2-rank run's bit for bit; at the end, within the tolerance of the other
cross-world-size tests (rtol 1e-5, atol 1e-6), the data cursor exactly.

    .venv/bin/python benchmarks/drills/chaos.py --events 5 --seed 3 --data DIR     # DIR: prepared data
    .venv/bin/python benchmarks/drills/chaos.py --mode fsdp --optim adamw --data DIR
    .venv/bin/python benchmarks/drills/chaos.py --arch nanochat --data DIR          # the nanochat block

Every drill has, in an order drawn from the seed, one attempt with each of:
- kill_save: GPTRAIN_FAULT=kill_save@STEP/RANK on a checkpoint step: that rank SIGKILLs itself
  while that checkpoint is being saved (rank 0 with every file in its temporary folder, not yet
  published; under FSDP2 a random rank, another one once its shards are written; the launcher
  then stops the other rank; exit 1),
- kill_eval: GPTRAIN_FAULT=kill_eval@STEP/RANK on an evaluation step: that rank SIGKILLs itself
  inside the evaluation (exit 1),
- publish_error: GPTRAIN_FAULT=publish_error@STEP/0 on a checkpoint step (a full disk while
  `latest` is written);
then `--events` more drawn from:
- sigkill: SIGKILL to one worker at a random step (the launcher then stops the other; exit 1),
- sigterm: SIGTERM to the launcher at a random step (every worker saves at its next step; exit 0),
- hang: GPTRAIN_FAULT=hang@STEP/RANK (the hang watchdog ends the run; exit 3),
- stall_save: GPTRAIN_FAULT=stall_save@STEP/RANK on a checkpoint step (a stuck save; exit 3).
Then a 2-rank attempt is SIGKILLed once a checkpoint at or after the last event step is
published (the hand-off), and the same command on one process finishes the run. Every restart is
the same command (run.max_failed_attempts = 0: this drill wants the restarts). Prints one line
per attempt (noting a fault whose announcement is missing from the attempt's stderr: it never
fired) and OK, or the entries that differ; exits 0 on OK.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
EVERY, EVAL_EVERY = 4, 6  # checkpoint and evaluation intervals (steps)
ARGS = [f"--checkpoint.every={EVERY}", f"--eval.every={EVAL_EVERY}", "--train.micro_batch_size=4"]
ARGS += ["--eval.sample_every=0", "--eval.tokens=512", "--eval.sample_tokens=1"]
ARGS += ["--optim.warmup_steps=1", "--log.every=1", "--log.progress=false", "--log.plot=false", "--model.dropout=0.0"]  # fmt: skip
ARGS += ["--train.dtype=float32", "--dist.hang_timeout_s=5", "--run.max_failed_attempts=0"]
ARGS += ["--checkpoint.keep_last=2"]
MODES = {"ddp": ["--dist.mode=ddp"], "fsdp": ["--dist.mode=fsdp"]}
OPTIMS = {"adamw": [], "muon": ["--optim.name=muon", "--optim.muon_dtype=float32"]}
HARD = ("kill_save", "kill_eval", "publish_error")  # once in every drill
KINDS = ("sigkill", "sigterm", "hang", "stall_save")  # drawn at random
ON_SAVE = ("kill_save", "stall_save", "publish_error", "handoff")  # aimed at a checkpoint step
FAULTS = ("kill_save", "kill_eval", "publish_error", "hang", "stall_save")  # GPTRAIN_FAULT kinds
RANK_0 = ("publish_error", "handoff")  # rank 0 publishes every checkpoint
SIGNALS = ("sigkill", "sigterm", "handoff")  # sent by the drill (the rest: GPTRAIN_FAULT)
RTOL, ATOL = 1e-5, 1e-6  # tests/test_distributed.py's tolerance across world sizes
QUIET = {"stdout": subprocess.DEVNULL, "start_new_session": True}
launch = subprocess.Popen  # tests/test_chaos.py swaps in tests/forked.py's Popen (no import time)


@dataclass(frozen=True)
class Run:
    """The drilled run: its data, length, parallelism (full checkpoints under ddp, sharded DCP
    ones under fsdp), optimizer (muon: Muon for the block matrices, AdamW for the rest) and
    block (model.arch: gpt2 or nanochat)."""

    data: Path
    steps: int = 60
    mode: str = "ddp"
    optim: str = "muon"
    arch: str = "gpt2"

    @property
    def last_event(self) -> int:
        """The last step an event may hit: the steps after it are the one-process leg's."""
        return self.steps - 2 * EVERY

    def command(self, run_dir: Path, nproc: int = 2, extra: tuple = ()) -> list[str]:
        cmd = [sys.executable, "-m", "gptrain", "train", "--config"]
        cmd += [str(REPO / "configs" / "debug.toml"), f"--data.dir={self.data}"]
        cmd += [f"--run.dir={run_dir}", f"--train.max_steps={self.steps}", *ARGS]
        cmd += [*MODES[self.mode if nproc > 1 else "ddp"], *OPTIMS[self.optim]]
        cmd += [f"--model.arch={self.arch}"]
        return [*cmd, f"--dist.nproc_per_node={nproc}", *extra]


def env(fault: str = "") -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    e.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), GPTRAIN_FAULT=fault)
    return e


def logged_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    steps = (int(x.split('"step": ')[1].split(",")[0]) for x in lines if '"step": ' in x)
    return max(steps, default=0)


def resume_step(run_dir: Path) -> int:
    pointer = run_dir / "checkpoints" / "latest"
    name = pointer.read_text().strip() if pointer.is_file() else ""
    return int(name.removeprefix("step_")) if name.startswith("step_") else 0


def starts(run_dir: Path) -> int:
    """First lines of attempts in train.log (written after resume rewound metrics.jsonl)."""
    path = run_dir / "train.log"
    lines = path.read_text().splitlines() if path.is_file() else []
    return sum(x.startswith(("starting:", "resumed from")) for x in lines)


def workers(pid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(p.name))
            except (OSError, IndexError, ValueError):
                pass
    return sorted(out)  # started in rank order


def worker(proc, rank: int) -> int | None:
    """The pid of the launcher's worker `rank` once both run; None if the launcher ended first."""
    while proc.poll() is None:
        pids = workers(proc.pid)
        if len(pids) == 2:
            return pids[rank]
        time.sleep(0.01)
    return None


def target(run: Run, event: str, start: int, rng: random.Random) -> int | None:
    """The step `event` hits in an attempt resumed from `start`; None: no room before the
    one-process leg (the event is skipped)."""
    at = start + rng.randint(2, 8)
    if event in ON_SAVE:
        at = -(-at // EVERY) * EVERY
    elif event == "kill_eval":
        at = -(-at // EVAL_EVERY) * EVAL_EVERY
    if event == "handoff":
        return max(at, -(-run.last_event // EVERY) * EVERY)
    return at if at <= run.last_event else None


def disturb(proc, run_dir: Path, event: str, at: int, rank: int, before: int) -> str:
    """Deliver the signal `event` (one of SIGNALS) to the running attempt `proc`; returns a note
    on how it landed."""
    # this attempt's rows only (stale ones are rewound)
    while proc.poll() is None and (starts(run_dir) == before or logged_step(run_dir) < at):
        time.sleep(0.01)
    while event == "handoff" and proc.poll() is None and resume_step(run_dir) < at:
        time.sleep(0.001)
    if proc.poll() is not None:
        return "the run ended first"
    if event == "sigterm":
        proc.send_signal(signal.SIGTERM)
    elif (pid := worker(proc, rank)) is not None:
        os.kill(pid, signal.SIGKILL)
    return ""


def attempt(run: Run, run_dir: Path, event: str | None, rng: random.Random, nproc=2) -> str:
    """One start of the run with `event` (None: undisturbed); returns a line describing it."""
    start = resume_step(run_dir)
    at = target(run, event, start, rng) if event else None
    full_save = event == "kill_save" and run.mode != "fsdp"  # rank 0 writes it alone
    rank = 0 if event in RANK_0 or full_save else rng.randint(0, 1)
    if event and at is None:
        return f"from step {start}: {event}: skipped (no step left for it before the last leg)"
    fault = f"{event}@{at}/{rank}" if event in FAULTS else ""
    before, stderr = starts(run_dir), run_dir.parent / f"{run_dir.name}.stderr"
    with open(stderr, "a") as log:
        log.write(f"--- from step {start}: {event} at {at}, GPTRAIN_FAULT={fault!r}\n")
        log.flush()
        offset = log.tell()
        proc = launch(run.command(run_dir, nproc), env=env(fault), stderr=log, **QUIET)
    try:
        note = disturb(proc, run_dir, event, at, rank, before) if event in SIGNALS else ""
        code = proc.wait(timeout=600)
    finally:
        stop(proc)
    said = stderr.read_bytes()[offset:].decode(errors="replace")
    if fault and f"(GPTRAIN_FAULT): {event} at step {at}" not in said:
        note = "the fault never fired"  # its announcement (faults._announce) is not in stderr
    who = f"rank {rank} " if event not in (None, "sigterm") else ""
    what = f"{event} {who}at step {at}" if event else f"undisturbed on {nproc} process(es)"
    note = f" ({note})" if note else ""
    return f"from step {start}: {what}{note}: exit {code}, checkpoint {resume_step(run_dir)}"


def stop(proc) -> None:
    """Never leave a run behind: SIGKILL its workers and the launcher if it still runs."""
    if proc.poll() is None:
        for pid in workers(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()


def state(path: Path) -> dict:
    """A checkpoint's weights ("model.KEY"), optimizer state ("optim.FQN.NAME") and data cursor
    ("data.KEY"), from a full or a sharded (DCP) checkpoint alike."""
    from gptrain.checkpoint import dcp
    from gptrain.checkpoint import manager as checkpoint

    model, meta = checkpoint.load_model_state(path)
    out = {f"model.{k}": v for k, v in model.items()}
    saved = checkpoint.load_state(path)
    if meta.get("layout") == dcp.LAYOUT:
        optim = dcp.load_full(path, meta, "optim.")
    else:
        optim = {
            f"{p}.{n}": t for p, v in saved["optimizer"]["state"].items() for n, t in v.items()
        }
    out.update({f"optim.{k}": v for k, v in optim.items()})
    out.update({f"data.{k}": v for k, v in saved["data"].items()})
    return out


def comparable(key: str, t):
    """`t` without the key part of an attention input bias (the middle third of c_attn.bias, and
    of its moments): its true gradient is exactly zero (a constant added to every score of a
    query leaves the softmax unchanged), so AdamW turns its ~1e-11 rounding noise into steps of
    up to lr whose sign follows the summation order, which differs between world sizes."""
    if not key.startswith(("model.", "optim.")) or ".attn.c_attn.bias" not in key or t.dim() != 1:
        return t
    n = t.shape[0] // 3
    return t[[*range(n), *range(2 * n, 3 * n)]]


def differences(want: dict, got: dict, exact: bool) -> list[str]:
    """Entries missing on one side or different: bit for bit when exact, else tensors within
    RTOL/ATOL, but for the key part of the attention input biases (the data cursor is always
    compared exactly)."""
    import torch

    out = sorted(want.keys() ^ got.keys())
    for k in sorted(want.keys() & got.keys()):
        a, b = want[k], got[k]
        if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
            same = a == b
        elif exact:
            same = a.dtype == b.dtype and torch.equal(a, b)
        else:
            a, b = comparable(k, a), comparable(k, b)
            same = a.shape == b.shape and torch.allclose(b.double(), a.double(), RTOL, ATOL)
        if not same:
            out.append(k)
    return out


def counts(s: dict) -> str:
    names = ("exp_avg", "exp_avg_sq", "momentum_buffer")
    return ", ".join(f"{sum(k.endswith('.' + n) for k in s)} {n}" for n in names)


def legs(run: Run, events: int, rng: random.Random, run_dir: Path, echo) -> tuple[int, dict]:
    """The drilled attempts: the events, the hand-off, the one-process leg. Returns the
    hand-off step and the state of the drill's checkpoint there (2 ranks, before the leg)."""
    from gptrain.checkpoint import manager as checkpoint

    plan = [*HARD, *(rng.choice(KINDS) for _ in range(events))]
    rng.shuffle(plan)
    for event in plan:
        echo(attempt(run, run_dir, event, rng))
    echo(attempt(run, run_dir, "handoff", rng))
    handoff = resume_step(run_dir)
    at_handoff = state(checkpoint.find(run_dir))
    while resume_step(run_dir) < run.steps:
        echo(attempt(run, run_dir, None, rng, nproc=1))
    return handoff, at_handoff


def drill(run: Run, events: int, seed: int, workdir: Path, echo=print) -> bool:
    """True when the drilled run equals the uninterrupted one: bit for bit at the hand-off,
    within RTOL/ATOL at the end (data cursor exactly)."""
    from gptrain.checkpoint import manager as checkpoint

    rng = random.Random(seed)
    ref, run_dir = workdir / "ref", workdir / "drill"
    # the uninterrupted run trains alongside the first attempts (on their hang budgets' idle
    # time), keeping every checkpoint so that the hand-off's can be compared
    keep = (f"--checkpoint.keep_every={EVERY}",)
    uninterrupted = launch(
        run.command(ref, extra=keep), env=env(), stderr=subprocess.DEVNULL, **QUIET
    )
    try:
        handoff, at_handoff = legs(run, events, rng, run_dir, echo)
        code = uninterrupted.wait(timeout=900)
    finally:
        stop(uninterrupted)
    assert code == 0, f"the uninterrupted run failed (exit {code})"
    if not 0 < handoff < run.steps:
        echo(f"DIFFERENT: no leg on one process (hand-off at step {handoff})")
        return False
    want = state(checkpoint.find(ref, handoff))
    exact = differences(want, at_handoff, exact=True)
    close = differences(state(checkpoint.find(ref)), state(checkpoint.find(run_dir)), exact=False)
    for where, keys in ((f"step {handoff} (2 ranks)", exact), (f"step {run.steps}", close)):
        if keys:
            echo(f"DIFFERENT at {where}: {', '.join(keys[:8])}")
    if exact or close:
        return False
    echo(
        f"OK: {run.mode}, {run.optim}, {run.arch}: weights, optimizer state ({counts(want)}) and data cursor "
        f"equal to the uninterrupted run's bit for bit at step {handoff}, within rtol {RTOL} / "
        f"atol {ATOL} at step {run.steps} after the leg on one process (data cursor exactly)"
    )
    return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=5, help="random events besides the fixed three")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--mode", choices=sorted(MODES), default="ddp")
    p.add_argument("--optim", choices=sorted(OPTIMS), default="muon")
    p.add_argument("--arch", choices=["gpt2", "nanochat"], default="gpt2", help="model.arch")
    p.add_argument("--data", required=True, help="a folder written by gptrain prepare")
    a = p.parse_args()
    run = Run(Path(a.data), a.steps, a.mode, a.optim, a.arch)
    with tempfile.TemporaryDirectory() as tmp:
        return 0 if drill(run, a.events, a.seed, Path(tmp)) else 1


if __name__ == "__main__":
    sys.exit(main())

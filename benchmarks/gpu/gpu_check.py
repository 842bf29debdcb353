"""The GPU proof run: one table that says whether gptrain works on this CUDA node.

    benchmarks/gpu/gpu_check.sh              # on a CUDA machine: every GPU of the node
    benchmarks/gpu/gpu_check.sh --dry-run    # CPU, tiny models, 2 gloo ranks, no compile row:
                                             # checks the script itself (tests/test_gpu_check.py)
    benchmarks/gpu/gpu_check.sh --rows 0,4   # only these rows (and the runs they compare with)
    benchmarks/gpu/gpu_check.sh --float8     # only the float8 row (with --rows: those rows too)

Each row is printed as soon as it is done ("gpu_check: done: ...", with its seconds), the whole
table at the end: a run stopped by a time limit still shows the rows it finished.

Rows (each a real `gptrain` command, started the way a user starts it):
  0. GPT-2 124M as the throughput target means it (GPT-2's 50257-token vocabulary,
     `gptrain bench` on synthetic tokens, bf16, compile on, micro-batch auto, one GPU):
     tokens/s and MFU against the target of 400k tokens/s on an H100
  1. GPT-2 124M (12 x 768; byte-level vocabulary, see below) on one GPU, compile off and on:
     tokens/s, MFU against the measured peak, peak memory (torch.cuda.max_memory_allocated), and
     the speed choices the run made for `train.dtype = auto` and `train.attention = auto` (how:
     measured, rule or cached; training/choices.py)
  2. DDP and FSDP2 on all GPUs of the node: the final loss equals the 1-GPU run's within bf16
     tolerance (the same global batches, see docs/distributed.md)
  3. kill and resume, with `train.deterministic = true`: an FSDP2 run killed (SIGKILL to the
     launcher and every worker, as a node failure) after its first checkpoint and started again
     resumes from that checkpoint and ends with the weights of the same run uninterrupted, bit
     for bit. Where it does not, the uninterrupted run is trained once more and the resume must
     be no further from it than that second run is (at most 2x: kernels that add in a varying
     order, such as atomics, make two identical runs differ: 5.4e-3 on an H100
     without the flag)
  4. GPT-2 XL (48 x 1600) under FSDP2 with activation checkpointing: peak memory per GPU and the
     wall time of one sharded checkpoint save (2 steps, a save each, keep_last 1: ~19 GB of
     weights and AdamW state at most twice on the node's disk) with checkpoint.io_threads's
     thread count (auto: the node's cores shared by its ranks, at most 8)
  5. GPT-2 XL under FSDP2 with Muon (optim.name = muon) and activation checkpointing: peak memory
     per GPU, the time of a step and Muon's share of it (its optimizer step, timed between device
     synchronisations, over the whole step; 3 steps, the fastest Muon step counted)
  float8 (--float8). Row 0's `gptrain bench` with train.float8 = off, on and auto: tokens/s of
     each (on and auto against off), and the Linear shapes auto converted with the timings it
     chose by (read back from the speed-choice cache its run filled). OK unless auto is over 3%
     slower than off (its choice lost end to end); the dry run benches off and auto, the same
     code on a CPU (no FP8: on is refused there), and judges nothing
A row whose command fails is printed FAILED with the command's last line (its whole log to
stderr), the next row runs, and the script exits 1.
Rows 1-4 train on this machine's own Python sources (torch's), byte-tokenised by `gptrain prepare`:
the node needs no network. Their vocabulary is therefore 257 (GPT-2's 50257 adds 38M embedding
parameters); the architecture is GPT-2's. Row 0 needs no data.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

# how commands start: tests/test_fsdp.py swaps in tests/forked.py's (forks, no import time)
run_command, launch = subprocess.run, subprocess.Popen

REPO = Path(__file__).resolve().parents[2]
LLMC = "configs/gpt2_124m_llmc.toml"
MB = 2**20


def worker(out: str, overrides: list[str]) -> None:
    """One rank of a training run: train(), then record peak memory, checkpoint save times and
    Muon's optimizer step times."""
    import resource

    import torch

    from gptrain.checkpoint import manager
    from gptrain.commands.train import train
    from gptrain.config.load import load_config
    from gptrain.distributed import runtime as dist
    from gptrain.training import muon

    save_s: list[float] = []
    muon_s: list[float] = []
    original, muon_step = manager.save, muon.Muon.step

    def timed_muon_step(self, *args, **kwargs):
        sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        sync()
        t0 = time.perf_counter()
        result = muon_step(self, *args, **kwargs)
        sync()
        muon_s.append(time.perf_counter() - t0)
        return result

    def timed_save(*args, **kwargs):
        t0 = time.perf_counter()
        path = original(*args, **kwargs)
        save_s.append(time.perf_counter() - t0)
        return path

    manager.save, muon.Muon.step = timed_save, timed_muon_step
    cfg = load_config(None, overrides)
    info = dist.DistInfo.from_env(cfg.train.device)
    dist.init(info, cfg.dist.backend, cfg.dist.timeout_s)
    try:
        summary = train(cfg, info)
        if info.device_type == "cuda":
            peak = torch.cuda.max_memory_allocated(info.device) / MB
        else:
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        peaks = [peak]
        if dist.active():
            peaks = [None] * info.world_size
            torch.distributed.all_gather_object(peaks, peak)
        if info.is_main:
            record = {**summary, "peak_mib": max(peaks), "save_s": save_s, "muon_s": muon_s}
            Path(out).write_text(json.dumps(record))
    finally:
        dist.teardown()


class Check:
    def __init__(self, dry: bool, work: Path):
        import torch

        self.dry, self.work = dry, work
        self.gpus = 2 if dry else torch.cuda.device_count()
        self.device = "cpu" if dry else "cuda"
        self.rows: list[tuple[str, str, str, str]] = []  # check, result, verdict, seconds
        self.data = self.prepare_data()

    def prepare_data(self) -> Path:
        import torch

        src = Path(torch.__file__).parent
        files = sorted(src.rglob("*.py"))[: 20 if self.dry else 4000]
        text = self.work / "corpus.txt"
        with open(text, "w", encoding="utf-8") as f:
            for p in files:
                f.write(p.read_text(encoding="utf-8", errors="replace"))
        out = self.work / "data"
        self.cli(["prepare", "--input", str(text), "--out", str(out), "--tokenizer", "byte"])
        return out

    def cli(self, args: list[str], timeout: float = 3600) -> None:
        cmd = [sys.executable, "-m", "gptrain", *args]  # prepare, bench
        done = run_command(cmd, cwd=REPO, env=self.env(), capture_output=True, text=True, timeout=timeout)  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"failed: {' '.join(cmd)}\n{done.stderr[-3000:]}")

    def env(self) -> dict:
        return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}

    def overrides(self, run: str, model: str, steps: int, *extra: str) -> list[str]:
        if self.dry:  # tiny: the script's own logic, in seconds on a CPU
            size = ["model.preset=tiny", "train.seq_len=64", "train.micro_batch_size=4", "train.total_batch_size=1024", "train.dtype=float32"]  # fmt: skip
            # the final evaluation and sample short: under FSDP2 on gloo each forward gathers
            # the weights, so a whole val split and a 200-token sample take seconds a run
            size += ["eval.tokens=1024", "eval.sample_tokens=4"]
        else:
            size = [f"model.preset={model}", "train.seq_len=1024", "train.micro_batch_size=16", f"train.total_batch_size={16 * 1024 * self.gpus * 2}", "train.dtype=auto"]  # fmt: skip
        return [
            f"data.dir={self.data}",
            f"run.dir={self.work / run}",
            f"train.max_steps={steps}",
            f"train.device={self.device}",
            "eval.every=0",
            "eval.sample_every=0",
            "log.progress=false",
            "log.plot=false",
            "log.every=1",
            "optim.warmup_steps=1",
            "checkpoint.every=0",
            *size,
            *extra,
        ]

    def train(self, name: str, nproc: int, overrides: list[str], kill_after_ckpt: bool = False) -> dict:  # fmt: skip
        out = self.work / f"{name}.json"
        args = [str(Path(__file__).resolve()), "--worker", str(out), *(f"--{o}" for o in overrides)]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]  # fmt: skip
        proc = launch(cmd, cwd=REPO, env=self.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
        if kill_after_ckpt:
            run_dir = Path(next(o for o in overrides if o.startswith("run.dir=")).split("=", 1)[1])
            while proc.poll() is None and not (run_dir / "checkpoints" / "latest").is_file():
                time.sleep(0.2)
            kill_job(proc)
            return {}
        log, _ = proc.communicate(timeout=3600)
        if proc.returncode != 0:
            raise SystemExit(f"failed: {' '.join(cmd)}\n{log[-3000:]}")
        return json.loads(out.read_text())

    def bench_args(self) -> list[str]:
        """Row 0's `gptrain bench` command line after --config, less --json."""
        if self.dry:
            return ["--steps", "2", "--warmup", "1", "--model.preset=tiny", "--train.seq_len=64", "--train.total_batch_size=256", "--train.micro_batch_size=4", "--train.dtype=float32", "--train.compile=false", "--train.device=cpu"]  # fmt: skip
        # 2^17 tokens a step: 2 micro-steps of 64 x 1024 when 64 fits
        return ["--steps", "20", "--warmup", "5", "--train.total_batch_size=131072", "--train.dtype=bfloat16", "--train.device=cuda"]  # fmt: skip

    def bench(self, name: str, *extra: str) -> dict:
        """The row `gptrain bench` of configs/gpt2_124m_llmc.toml writes with bench_args + extra."""
        rows = self.work / f"{name}.json"
        self.cli(["bench", "--config", LLMC, "--json", str(rows), *self.bench_args(), *extra])
        (r,) = json.loads(rows.read_text())
        return r

    def throughput(self) -> tuple[str, str]:
        """Row 0: `gptrain bench` of configs/gpt2_124m_llmc.toml on one device (the 400k tok/s target)."""
        r = self.bench("bench")
        target = 1 if self.dry else 400_000
        verdict = "OK" if r["tok_per_s"] >= target else f"BELOW the {target:,} target"
        return (f"1 {self.device}, micro-batch {r['micro_batch']}: {r['tok_per_s']:,.0f} tok/s, MFU {r['mfu']:.1%} of a measured {r['peak_tflops']:.3g} TFLOP/s", verdict)  # fmt: skip

    def run(self, rows: set[int], float8: bool = False) -> None:
        """The rows asked for, each printed as soon as it is done (a run cut short by a time limit
        still shows what it finished); the runs a row compares with are trained when missing. A
        row whose command fails is a FAILED row with the command's last line, and the next row
        runs (one broken row costs a time-limited GPU job nothing else)."""
        self.clock, self.failed = time.perf_counter(), False
        steps = 4 if self.dry else 30
        every = max(steps // 6, 1)  # row 3's checkpoints (dry: one a step)
        n, runs = self.gpus, {}
        exact = ["dist.mode=fsdp", f"checkpoint.every={every}", "train.deterministic=true"]
        extras = {  # the GPT-2 124M runs, each trained once (a failure, too, is kept)
            "one_False": ["train.compile=false"],
            "one_True": ["train.compile=true"],
            "ddp": ["dist.mode=ddp"],
            "fsdp": ["dist.mode=fsdp"],
            "exact": exact,  # row 3's uninterrupted run: deterministic kernels
            "exact_again": exact,  # its run-to-run noise: trained only when the resume differs
        }

        def once(name: str) -> dict:
            if name not in runs:
                try:
                    runs[name] = self.train(name, 1 if name.startswith("one_") else n, self.overrides(name, "gpt2", steps, *extras[name]))  # fmt: skip
                except SystemExit as e:
                    runs[name] = e
            if isinstance(runs[name], SystemExit):
                raise runs[name]
            return runs[name]

        def single(compile: bool) -> tuple[str, str, str]:
            r = once(f"one_{compile}")
            return (f"{r['tok_per_s']:,.0f} tok/s, MFU {r['mfu']:.1%}; {speed_choices(r)}", f"peak {r['peak_mib']:,.0f} MiB")  # fmt: skip

        def parallel(mode: str) -> tuple[str, str]:
            ref, r = once("one_False")["train_loss"], once(mode)
            ok = abs(r["train_loss"] - ref) <= (1e-4 if self.dry else 2e-2) * abs(ref)
            return f"loss {r['train_loss']:.4f} vs 1 {self.device} {ref:.4f}", "OK" if ok else "MISMATCH"  # fmt: skip

        def resume() -> tuple[str, str]:
            once("exact")
            killed_at, diff = self.kill_and_resume(n, steps, exact)
            result = f"killed after {killed_at}; max weight difference vs uninterrupted {diff:.2e}"
            if diff == 0:
                return result, "OK, bit for bit"
            once("exact_again")  # not bit for bit: is it the kernels (run to run) or the resume?
            noise = self.weight_diff("exact", "exact_again")
            ok = "OK, within the run-to-run noise" if diff <= 2 * noise else "MISMATCH"
            return f"{result}; two uninterrupted runs {noise:.2e}", ok

        def xl() -> tuple[str, str]:  # two sharded saves, the older deleted: GPT-2 XL's ~19 GB of
            # weights and AdamW state once or twice on the node's disk, not keep_last's 3
            from gptrain.checkpoint.folder import io_threads  # checkpoint.io_threads = auto

            r = self.train("xl", n, self.overrides("xl", "gpt2-xl", 2, "dist.mode=fsdp", "train.activation_checkpointing=blocks", "checkpoint.every=1", "checkpoint.keep_last=1"))  # fmt: skip
            return f"peak {r['peak_mib']:,.0f} MiB per rank, {r['tok_per_s']:,.0f} tok/s", f"sharded checkpoint save {min(r['save_s']):.1f} s, {io_threads(n)} I/O threads per rank"  # fmt: skip

        todo = [(0, "GPT-2 124M, vocab 50257, `gptrain bench`", self.throughput)]
        for compile in (False,) if self.dry else (False, True):  # CPU inductor: minutes
            todo.append((1, f"GPT-2 124M, 1 {self.device}, compile {'on' if compile else 'off'}", partial(single, compile)))  # fmt: skip
        for mode in ("ddp", "fsdp"):
            todo.append((2, f"GPT-2 124M, {mode.upper()} x {n}", partial(parallel, mode)))
        todo.append((3, f"FSDP2 x {n}, deterministic kernels: SIGKILL, resume to step {steps}", resume))  # fmt: skip
        todo.append((4, f"GPT-2 XL, FSDP2 x {n}, activation checkpointing", xl))
        todo.append((5, f"GPT-2 XL, FSDP2 x {n}, Muon, activation checkpointing", self.xl_muon))
        todo.append(("float8", f"GPT-2 124M, vocab 50257, `gptrain bench`, 1 {self.device}, train.float8 off / on / auto", self.float8))  # fmt: skip
        for number, check, measure in todo:
            if number in rows or (float8 and number == "float8"):
                try:
                    self.add(check, *measure())
                except SystemExit as e:  # a command failed: its log is printed, its row FAILED
                    print(e, file=sys.stderr, flush=True)
                    last = [line for line in str(e).splitlines() if line.strip()][-1]
                    self.failed = True
                    self.add(check, f"failed: {last.strip()[:300]}", "FAILED")

    def float8(self) -> tuple[str, str]:
        """The float8 row: row 0's bench with train.float8 = off, on (not in the dry run: no FP8
        on a CPU) and auto; auto's layers and timings from the speed-choice cache (float8_choice)."""
        modes = ("off", "auto") if self.dry else ("off", "on", "auto")
        tok = {m: self.bench(f"float8_{m}", f"--train.float8={m}")["tok_per_s"] for m in modes}
        ratios = ", ".join(f"{m} {tok[m]:,.0f} ({tok[m] / tok['off']:.2f}x)" for m in modes[1:])
        ok = self.dry or tok["auto"] >= 0.97 * tok["off"]  # a CPU runs the same code twice
        verdict = "OK" if ok else "auto SLOWER than off: its choice lost end to end"
        return f"off {tok['off']:,.0f} tok/s, {ratios}; auto: {self.float8_choice()}", verdict

    def float8_choice(self) -> str:
        """What train.float8 = auto chose for row 0's bench, from the speed-choice cache its run
        filled (nothing timed where it holds them): the layers, how, and each shape's timings."""
        from gptrain.config.load import load_config
        from gptrain.distributed.runtime import DistInfo
        from gptrain.training.build import build_model, speed_choices
        from gptrain.training.precision import set_matmul_precision

        args = [a.removeprefix("--") for a in self.bench_args() if a.startswith("--train.")]
        cfg = load_config(str(REPO / LLMC), [*args, "train.float8=auto"])
        model = build_model(cfg, 50257, meta=True)
        device = "cpu" if self.dry else "cuda:0"
        set_matmul_precision(
            device.split(":")[0], cfg.train.tf32
        )  # as the bench did (keys hold it)
        c = speed_choices(cfg, DistInfo(device=device), model, cfg.train.dtype, compile=cfg.train.compile)  # fmt: skip
        if c.float8 is None:
            return f"nothing to decide ({device} has no FP8)"
        each = ", ".join(f"{k} {v['bfloat16']:.3g} vs {v['float8']:.3g} ms" for k, v in c.float8.ms.items())  # fmt: skip
        timed = f"; one Linear fwd+bwd of {c.float8.rows} rows, bf16 vs float8: {each}" if each else ""  # fmt: skip
        return f"{c.float8.layers} ({c.how['float8']}){timed}"

    def xl_muon(self) -> tuple[str, str]:
        """Row 5: GPT-2 XL under FSDP2 with Muon and activation checkpointing, 3 steps, no saves:
        peak memory, the step time (tokens per step / tok/s) and Muon's share of it."""
        overrides = self.overrides("xl_muon", "gpt2-xl", 3, "dist.mode=fsdp", "train.activation_checkpointing=blocks", "optim.name=muon")  # fmt: skip
        r = self.train("xl_muon", self.gpus, overrides)
        tokens = int(next(o for o in overrides if o.startswith("train.total_batch_size=")).split("=")[1])  # fmt: skip
        step_s, muon = tokens / r["tok_per_s"], min(r["muon_s"])
        return f"peak {r['peak_mib']:,.0f} MiB per rank, {r['tok_per_s']:,.0f} tok/s, {step_s:.2f} s a step", f"Muon {muon:.3f} s a step ({muon / step_s:.0%})"  # fmt: skip

    def add(self, check: str, result: str, verdict: str) -> None:
        """One row of the table, with the seconds since the previous one, printed at once."""
        now = time.perf_counter()
        row = (check, result, verdict, f"{now - self.clock:.0f} s")
        self.rows.append(row)
        self.clock = now
        print("gpu_check: done: " + " | ".join(row), flush=True)

    def kill_and_resume(self, n: int, steps: int, extra: list[str]) -> tuple[str, float]:
        """Row 3's run (overrides `extra`) killed after its first checkpoint, started again: the
        checkpoint it was killed after, and its final weights' largest difference from the same
        run uninterrupted ("exact")."""
        from gptrain.checkpoint import manager as checkpoint

        cut = self.overrides("resume_cut", "gpt2", steps, *extra)
        self.train("resume_cut", n, cut, kill_after_ckpt=True)
        killed_at = checkpoint.latest(self.work / "resume_cut").name
        self.train("resume_cut", n, cut)
        attempts = (self.work / "resume_cut" / "attempts.jsonl").read_text().splitlines()
        start = [e for e in map(json.loads, attempts) if e["event"] == "start"][-1]
        if start["last_checkpoint"] != killed_at:  # the killed job went on after its kill
            raise SystemExit(f"the job killed after {killed_at} wrote {start['last_checkpoint']} after its kill; the resume started there")  # fmt: skip
        return killed_at, self.weight_diff("exact", "resume_cut")

    def weight_diff(self, a: str, b: str) -> float:
        """The largest absolute difference between two runs' final weights."""
        from gptrain.checkpoint import manager as checkpoint

        wa = checkpoint.load_model_state(checkpoint.latest(self.work / a))[0]
        wb = checkpoint.load_model_state(checkpoint.latest(self.work / b))[0]
        return max((wa[k].float() - wb[k].float()).abs().max().item() for k in wa)

    def table(self) -> str:
        if self.dry:
            name = "CPU dry run (tiny models stand in for every row)"
        else:
            import torch

            name = f"{self.gpus} x {torch.cuda.get_device_name(0)}"
        lines = [f"gpu_check: {name}", "", "| check | result | | time |", "|---|---|---|---:|"]
        lines += [f"| {' | '.join(row)} |" for row in self.rows]
        return "\n".join(lines)


def kill_job(proc) -> None:
    """SIGKILL the whole job, as a node failure would: the launcher and every process below it
    (torch's launcher starts each worker in a session of its own, so its process group alone
    would leave the workers training on, and writing checkpoints, after the "kill")."""
    tree, todo = [], [proc.pid]
    with contextlib.suppress(ProcessLookupError):  # it may have ended on its own
        os.kill(proc.pid, signal.SIGSTOP)  # no new worker while the tree is read
    while todo:
        for children in Path(f"/proc/{todo.pop()}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                kids = [int(k) for k in children.read_text().split()]
                tree, todo = tree + kids, todo + kids
    for pid in (proc.pid, *tree):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(os.getpgid(pid), signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 60
    while any(map(running, tree)) and time.monotonic() < deadline:
        time.sleep(0.05)


def running(pid: int) -> bool:
    """The process exists and is not a zombie (one killed, not reaped yet, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def speed_choices(summary: dict) -> str:
    """A run's speed choices as summary.json records them: each value and how it was made."""
    c = summary["speed_choices"]
    ms = ", ".join(f"{k} {v:.3g} ms" for k, v in (c.get("block_ms") or {}).items())
    choice = f"dtype {c['dtype']} ({c['how']['dtype']}), attention {c['attention']} ({c['how']['attention']})"  # fmt: skip
    return choice + (f"; one block fwd+bwd: {ms}" if ms else "")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny models, 2 gloo ranks")
    p.add_argument("--keep", default="", help="keep the runs in this folder")
    p.add_argument("--rows", default=None, help="which rows to run, e.g. 0,4 (the runs a row compares with come along); default: all, or none with --float8")  # fmt: skip
    p.add_argument("--float8", action="store_true", help="the float8 row: row 0's bench with train.float8 = off, on and auto")  # fmt: skip
    p.add_argument("--worker", default="", help=argparse.SUPPRESS)
    a, rest = p.parse_known_args()
    if a.worker:
        worker(a.worker, [o.removeprefix("--") for o in rest])
        return 0
    if a.rows is None:
        a.rows = "" if a.float8 else "0,1,2,3,4,5"
    parts = a.rows.split(",") if a.rows or not a.float8 else []
    rows = {int(r) for r in parts if r.isdigit()}
    if len(rows) < len(set(parts)) or not rows <= {0, 1, 2, 3, 4, 5}:
        print(f"gpu_check: --rows {a.rows!r}: give row numbers from 0 to 5, comma-separated (e.g. 0,4)")  # fmt: skip
        return 2
    import torch

    if not a.dry_run and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; use --dry-run to check the script on a CPU")
        return 2
    work = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="gpu_check-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        check = Check(a.dry_run, work)
        check.run(rows, a.float8)
        print(check.table())
        if check.failed:
            return 1
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    from gptrain.__main__ import exit_quickly

    exit_quickly(main())

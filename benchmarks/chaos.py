"""A chaos drill: a 2-rank run (`gptrain train --dist.nproc_per_node=2`, gloo, the debug model)
restarted like a requeueing scheduler would, while random ranks get random faults and signals at
random moments; at the end its weights must equal an uninterrupted run's, bit for bit.

    .venv/bin/python benchmarks/chaos.py --events 8 --seed 3 --data DIR     # DIR: prepared data

One event per attempt, drawn from:
- SIGKILL to one worker at a random step (the launcher then stops the other; exit 1),
- SIGTERM to the launcher at a random step (every worker saves at its next step; exit 0),
- GPTRAIN_FAULT=hang@STEP/RANK (the hang watchdog ends the run; exit 3),
- GPTRAIN_FAULT=stall_save@STEP/RANK on a checkpoint step (a stuck save; exit 3).
The same command is then run again (run.max_failed_attempts = 0: this drill wants the restarts);
once the events are spent, the run finishes undisturbed. Prints one line per attempt and OK or
the first tensor that differs; exits 0 on OK.
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
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
STEPS, EVERY = 60, 4
ARGS = [f"--train.max_steps={STEPS}", f"--checkpoint.every={EVERY}", "--train.micro_batch_size=4"]
ARGS += ["--eval.every=0", "--eval.sample_every=0", "--eval.tokens=512", "--eval.sample_tokens=1"]
ARGS += ["--optim.warmup_steps=1", "--log.every=1", "--log.progress=false", "--model.dropout=0.1"]
ARGS += ["--train.dtype=float32", "--dist.hang_timeout_s=5", "--run.max_failed_attempts=0"]
ARGS += ["--dist.nproc_per_node=2", "--checkpoint.keep_last=2"]
KINDS = ("sigkill", "sigterm", "hang", "stall_save")
launch = subprocess.Popen  # tests/test_chaos.py swaps in tests/forked.py's Popen (no import time)


def command(data: Path, run_dir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "gptrain", "train", "--config", str(REPO / "configs" / "debug.toml")]  # fmt: skip
    return [*cmd, f"--data.dir={data}", f"--run.dir={run_dir}", *ARGS]


def env(fault: str = "") -> dict:
    e = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    e.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), GPTRAIN_FAULT=fault)
    return e


def logged_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return max((int(x.split('"step": ')[1].split(",")[0]) for x in lines if '"step": ' in x), default=0)  # fmt: skip


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
    return out


def attempt(data: Path, run_dir: Path, event: str | None, rng: random.Random) -> str:
    """One start of the run with `event` (None: undisturbed); returns a line describing it."""
    start = resume_step(run_dir)
    at = min(start + rng.randint(2, 8), STEPS - 1)  # never the attempt's first step (1 h budget)
    rank = rng.randint(0, 1)
    fault = ""
    if event == "hang":
        fault = f"hang@{at}/{rank}"
    elif event == "stall_save":
        at = min((at // EVERY + 1) * EVERY, STEPS - EVERY)
        fault = f"stall_save@{at}/{rank}"
    before = starts(run_dir)
    proc = launch(command(data, run_dir), env=env(fault), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        if event in ("sigkill", "sigterm"):  # this attempt's rows only (stale ones are rewound)
            while proc.poll() is None and (starts(run_dir) == before or logged_step(run_dir) < at):
                time.sleep(0.01)
            if proc.poll() is None and event == "sigterm":
                proc.send_signal(signal.SIGTERM)
            elif proc.poll() is None:
                os.kill(sorted(workers(proc.pid))[rank], signal.SIGKILL)
        code = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:  # never leave a run behind
            for pid in workers(proc.pid):
                os.kill(pid, signal.SIGKILL)
            proc.kill()
    what = f"{event} {'rank ' + str(rank) + ' ' if event != 'sigterm' else ''}at step {at}" if event else "undisturbed"  # fmt: skip
    return f"from step {start}: {what}: exit {code}, checkpoint {resume_step(run_dir)}"


def drill(events: int, seed: int, data: Path, workdir: Path, echo=print) -> bool:
    """True when the drilled run ends equal, bit for bit, to the uninterrupted one."""
    import torch

    from gptrain.checkpoint import manager as checkpoint

    rng = random.Random(seed)
    ref, run_dir = workdir / "ref", workdir / "drill"
    # the uninterrupted run trains alongside the first attempts (on their hang budgets' idle time)
    uninterrupted = launch(command(data, ref), env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        plan = [rng.choice(KINDS) for _ in range(events)]
        for event in [*plan, None]:
            echo(attempt(data, run_dir, event, rng))
        while resume_step(run_dir) < STEPS:  # an event at the very end may leave steps to do
            echo(attempt(data, run_dir, None, rng))
        code = uninterrupted.wait(timeout=600)
    finally:
        if uninterrupted.poll() is None:
            for pid in workers(uninterrupted.pid):
                os.kill(pid, signal.SIGKILL)
            uninterrupted.kill()
    assert code == 0, f"the uninterrupted run failed (exit {code})"
    a = checkpoint.load_model_state(checkpoint.find(ref))[0]
    b = checkpoint.load_model_state(checkpoint.find(run_dir))[0]
    for k in a:
        if not torch.equal(a[k], b[k]):
            echo(f"DIFFERENT: {k}")
            return False
    echo(f"OK: {events} events ({', '.join(plan)}), final weights equal to the uninterrupted run's bit for bit")  # fmt: skip
    return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", required=True, help="a folder written by gptrain prepare")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        return 0 if drill(args.events, args.seed, Path(args.data), Path(tmp)) else 1


if __name__ == "__main__":
    sys.exit(main())

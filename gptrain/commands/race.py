"""`gptrain race`: configs x seeds, each run an ordinary run directory, compared with statistics.

    gptrain race --config configs/default.toml --config configs/race.toml --seeds 5 \\
        --data.dir=data/tinyshakespeare --eval.tokens=0 --out races/shakespeare
    gptrain race --config configs/small_llmc.toml --config configs/small.toml \\
        --ladder 1,1.5,2,3 --seeds 3

    --config FILE            a config to race (one flag per config); the first is the baseline
    --seeds N                runs per config, train.seed = 1..N (initialisation and data order);
                             default 5, at least 2 when there is more than one config
    --target VALUE|baseline  the val loss to reach: a number, or baseline (the baseline's mean
                             final val loss; the default)
    --ladder M1,M2,...       the first config as a ladder of complete runs at these multiples
                             of its train.max_steps (and optim.warmup_steps), DIR/<config>@<M>:
                             the compute multiplier interpolates between their final losses
    --out DIR                the race's folder (default races/<first>-vs-<second>...)
    --jobs N                 CPU runs to train at a time (default 1), each a subprocess with
                             OMP_NUM_THREADS = the cores / N: small models train more tokens
                             per core side by side than one at a time on every core
    --hellaswag              also score HellaSwag at the end of each run (eval.hellaswag)
    --section.key=value      an override applied to every run

The race is frozen at its start: DIR/plan.json holds each config as resolved (file + overrides),
and each run is `gptrain train --config DIR/<config>/config.toml --train.seed=K
--run.dir=DIR/<config>/seed_K`, that config.toml written from the plan (a config file edited
mid-race changes nothing; the next command naming it is refused). The runs are trained in this
process one after another (their output goes to stderr); on a machine with several GPUs, when
every run is one process, one run per GPU at a time; with --jobs N on a CPU, N at a time
(subprocesses, CUDA_VISIBLE_DEVICES or OMP_NUM_THREADS, each in its own session: SIGTERM or
SIGINT to the race is passed on to them, STOP_WAIT_S at most).
The race holds DIR's run-folder lock throughout (a second race into DIR stops with one line).
A race stopped part-way continues when the same command runs again: a finished run (its
summary.json written) is not started again, every other run directory resumes through gptrain
train's own resume; a run ending without its summary.json and without a signal is run once
more. At the end: DIR/race.json (every run's curve and numbers, each config's statistics, the
regime from DIR/unigram.json), DIR/race.png, and the markdown table on stdout. The statistics
are explained in docs/race.md.

Exit codes: 0 every run finished (or the race was stopped by a signal, to continue); 2 bad input
(one line, nothing written), also when a run's own gptrain train refuses its input, one at a
time or with --jobs alike (the race stops); 3 (RUN_FAILED) a run failed: it crashed, diverged,
hung twice, or ended twice without its summary.json (the race stops there), or no run of the
baseline finished; the runs that finished are still in race.json and the table where they
suffice.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from gptrain.cache import atomic_write_bytes
from gptrain.checkpoint.manager import RunLock
from gptrain.commands.race_plan import (
    PLAN,
    Args,
    Job,
    Plan,
    check_plan,
    flops_per_token,
    parse_args,
    plan,
    regime,
    remove_configs,
    trained,
    write_configs,
)
from gptrain.config.load import Config
from gptrain.distributed.watchdog import EXIT_CODE as HUNG
from gptrain.errors import UserError, first_line
from gptrain.logs.plot import read_metrics
from gptrain.logs.race import analyse, curve_from_metrics
from gptrain.logs.race_report import markdown_table, plot_race
from gptrain.training import attempts

STOP_WAIT_S = 120.0  # how long a stopped race waits for its runs in progress to save and exit
RUN_FAILED = 3  # the exit code of a race in which a run failed (bad input is 2)


class Stopped(Exception):
    """A run was stopped by a signal (preemption): the race stops too, and continues next time."""


class RunFailed(Exception):
    """A run failed in a way that stops the race (exit RUN_FAILED)."""


def _train_in_process(argv: list[str]) -> int:
    """One run through gptrain train's own entry point in this process; its output to stderr,
    so that stdout holds only the table."""
    from gptrain.commands import train

    with contextlib.redirect_stdout(sys.stderr):
        return train.main(argv)


def gpu_slots(cfgs: list[Config]) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES values to run on at the same time: one per GPU when there are
    several and every run is one CUDA process; else [None] (one run at a time, in this process)."""
    import torch

    from gptrain.distributed import launch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return [None]
    if any(
        c.train.device == "cpu"
        or launch.nproc_for(c.dist.nproc_per_node) != 1
        or str(c.dist.nnodes) != "1"
        for c in cfgs
    ):
        return [None]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [d.strip() for d in visible.split(",") if d.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


def slots(cfgs: list[Config], jobs: int) -> list[str | None]:
    """Where the runs go: one per GPU (`gpu_slots`); else with `jobs` > 1 that many CPU slots,
    "cpu:T" (T threads each, the cores shared out); else [None] (one at a time, in process)."""
    import torch

    from gptrain.distributed import launch

    gpus = gpu_slots(cfgs)
    if jobs <= 1:
        return gpus
    if gpus != [None] or (torch.cuda.is_available() and any(c.train.device != "cpu" for c in cfgs)):
        raise UserError(
            f"--jobs {jobs} shares a CPU's cores between runs, but these runs train on a GPU (one run per GPU at a time); drop --jobs, or race on the CPU with --train.device=cpu"
        )
    for c in cfgs:
        n = launch.nproc_for(c.dist.nproc_per_node)
        if n != 1 or str(c.dist.nnodes) != "1":
            raise UserError(
                f"--jobs {jobs} trains one-process runs side by side, but {c.run.dir} runs {n} process(es) on {c.dist.nnodes} node(s); race it with --jobs 1"
            )
    return [f"cpu:{max(1, (os.cpu_count() or 1) // jobs)}"] * jobs


def run_all(jobs: list[Job], slots: list[str | None], logs: Path) -> dict[Job, int]:
    """Each job's exit code. A run stopped by a signal stops the race (Stopped; Ctrl-C:
    KeyboardInterrupt), to continue next time. A run that has finished (`finished`) is not
    started again: a race continued after a stop starts only the runs it lacks."""
    codes = {job: 0 for job in jobs if finished(job)}
    jobs = [job for job in jobs if job not in codes]
    if codes:
        print(f"race: {len(codes)} run(s) already finished", file=sys.stderr)
    if slots != [None]:
        return codes | _run_parallel(jobs, slots, logs)
    for n, job in enumerate(jobs, 1):
        print(
            f"race: run {n}/{len(jobs)}: {job.label} seed {job.seed} -> {job.run_dir}",
            file=sys.stderr,
        )
        codes[job] = _run_in_process(job)
    return codes


def finished(job: Job) -> bool:
    """Whether a run has finished: its summary.json, written once at its end, exists. (Its
    config is the race's: check_plan refuses a race folder whose plan changed.)"""
    return (job.run_dir / "summary.json").is_file()


def _run_in_process(job: Job) -> int:
    """One run's exit code; a run that ends without summary.json and without a signal (killed
    after its last checkpoint, before its summary) is run once more, which finishes it."""
    again = False
    while True:
        try:
            code = _train_in_process(list(job.argv))
        except (UserError, KeyboardInterrupt):
            raise
        except Exception as e:  # a bug or a crash in one run: recorded, the race goes on
            print(f"race: {job.run_dir} failed: {first_line(e)}", file=sys.stderr)
            return 1
        if code == 130:
            raise KeyboardInterrupt
        if not unfinished(job, code, again):
            return code
        again = True


def unfinished(job: Job, code: int, again: bool) -> bool:
    """Whether a run that exited with `code` is to run once more: it hung (the watchdog's exit
    code), or exited 0 without writing summary.json, not stopped by a signal, for the first time.
    Stopped by a signal, or for the second time: Stopped (the race stops, to continue next
    time); hung twice: RunFailed. A run that finished although a signal reached it (in its last
    step, its final evaluation or its summary) stops the race too: the signal was meant for the
    race."""
    if code == HUNG:  # the watchdog's exit code: safe to restart, from the run's checkpoint
        if again:
            raise RunFailed(
                f"{job.run_dir} hung twice (its train.log has every thread's stack); run the same command to continue the race"
            )
        print(f"race: {job.run_dir} hung: running it once more from its checkpoint", file=sys.stderr)  # fmt: skip
        return True
    if code != 0:
        return False
    runs = attempts.read(job.run_dir)
    if (job.run_dir / "summary.json").is_file():
        if runs and runs[-1]["signal"] is not None:
            raise Stopped(
                f"{job.run_dir} finished, but a signal ({runs[-1]['signal'].get('signal', '?')}) reached it at its end; run the same command to continue the race"
            )
        return False
    if runs and attempts.outcome(runs[-1]) in ("preempted", "interrupted"):
        raise Stopped(
            f"{job.run_dir} was stopped by a signal (its checkpoint is saved); run the same command to continue the race"
        )
    if again:
        raise RunFailed(
            f"{job.run_dir} ended twice without writing summary.json, not stopped by a signal; see its train.log, then run the same command to continue the race"
        )
    print(
        f"race: {job.run_dir} ended without summary.json (not by a signal): running it once more to finish it",
        file=sys.stderr,
    )
    return True


def _run_parallel(jobs: list[Job], slots: list[str | None], logs: Path) -> dict[Job, int]:
    """One `python -m gptrain train` subprocess per slot at a time; output in OUT/logs/. SIGTERM
    or SIGINT to the race is passed on to the runs in progress (each saves and stops), which are
    waited for (STOP_WAIT_S at most, then killed) before the race stops."""
    logs.mkdir(parents=True, exist_ok=True)
    pending, running, codes = list(jobs), {}, {}  # running: slot index -> (job, process, log)
    again: set[Job] = set()  # runs started a second time (unfinished, see `unfinished`)
    received: list[int] = []
    with _signals_noted(received):
        try:
            while (pending or running) and not received:
                for i in range(len(slots)):  # each free slot while runs are pending
                    if i not in running and pending:
                        running[i] = _start(pending.pop(0), slots[i], logs)
                for i, (job, proc, log) in list(running.items()):
                    if proc.poll() is None:
                        continue
                    log.close()
                    del running[i]
                    if proc.returncode == UserError.exit_code:  # bad input: as one at a time
                        raise UserError(f"{job.run_dir}: {_error_line(log.name)}")
                    if unfinished(job, proc.returncode, job in again):
                        again.add(job)
                        pending.insert(0, job)
                    else:
                        codes[job] = proc.returncode
                time.sleep(0.2)
        finally:  # stopped: these runs resume next time
            _stop(running.values(), received[0] if received else signal.SIGTERM)
    if received and received[0] == signal.SIGINT:
        raise KeyboardInterrupt
    if received:
        raise Stopped(
            f"stopped by {signal.Signals(received[0]).name}: the runs in progress were passed the signal and have stopped; run the same command to continue the race"
        )
    return codes


def _error_line(path: str) -> str:
    """A run's one-line error from its log (gptrain train's "gptrain: error: ..."), or where
    to look for it."""
    with contextlib.suppress(OSError):
        lines = Path(path).read_text(errors="replace").splitlines()
        for line in reversed(lines):
            if line.startswith("gptrain: error: "):
                return line[len("gptrain: error: ") :]
    return f"its gptrain train exited 2 (bad input); see {path}"


def _start(job: Job, slot: str | None, logs: Path) -> tuple:
    """A run as its own process (its own session: a signal reaches it through the race only)."""
    cpu = slot is not None and slot.startswith("cpu:")
    env = {
        **os.environ,
        **({"OMP_NUM_THREADS": slot[4:]} if cpu else {"CUDA_VISIBLE_DEVICES": slot}),
    }
    log = open(logs / f"{job.label}_seed_{job.seed}.log", "a")
    cmd = [sys.executable, "-m", "gptrain", "train", *job.argv]
    proc = subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    where = f"CPU, {slot[4:]} thread(s)" if cpu else f"GPU {slot}"
    print(f"race: {where}: {job.label} seed {job.seed} -> {job.run_dir}", file=sys.stderr)
    return job, proc, log


@contextlib.contextmanager
def _signals_noted(received: list[int]):
    """SIGTERM and SIGINT only noted in `received` inside the block (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = (signal.SIGTERM, signal.SIGINT)
    previous = {sig: signal.signal(sig, lambda signum, _: received.append(signum)) for sig in sigs}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop(running, sig: int) -> None:
    """Pass `sig` on to each run in progress and wait for all, STOP_WAIT_S in all; a run still
    going then is killed (it resumes from its newest checkpoint)."""
    running = list(running)
    for _job, proc, _log in running:
        proc.send_signal(sig)
    deadline = time.monotonic() + STOP_WAIT_S
    for job, proc, log in running:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(
                f"race: {job.run_dir} did not stop within {STOP_WAIT_S:g} s of {signal.Signals(sig).name}: killed; it resumes from its newest checkpoint",
                file=sys.stderr,
            )
            proc.kill()
            proc.wait()
        log.close()


def record(job: Job, code: int, fpt: float) -> dict:
    """A run's entry in race.json: status, curve and final numbers."""
    rec = {"config": job.label, "seed": job.seed, "dir": str(job.run_dir), "status": "done"}
    summary_path = job.run_dir / "summary.json"
    if code != 0 or not summary_path.is_file():
        rec["status"] = f"failed (exit {code})" if code else "not finished"
        return rec
    rows = read_metrics(job.run_dir)
    curve = curve_from_metrics(rows)
    if not curve["tokens"]:
        return {**rec, "status": "no evaluation in metrics.jsonl"}
    if not math.isfinite(curve["val_loss"][-1]):  # diverged: no loss to compare
        return {**rec, "status": f"final val loss {curve['val_loss'][-1]}"}
    summary = json.loads(summary_path.read_text())
    g = summary.get("goodput", {})
    hella = [r["hellaswag_acc_norm"] for r in rows if "hellaswag_acc_norm" in r]
    return {
        **rec,
        "val_loss": curve["val_loss"][-1],
        "val_bpb": curve["val_bpb"][-1],
        "tokens": summary.get("tokens", curve["tokens"][-1]),
        "train_s": curve["seconds"][-1],
        "wall_s": g["wall_s"] - g.get("gaps_s", 0.0) if "wall_s" in g else None,
        "flops_per_token": fpt,
        "hellaswag_acc_norm": hella[-1] if hella else None,
        "curve": curve,
    }


def main(argv: list[str]) -> int:
    args = parse_args(argv, __doc__)
    p = plan(args)
    check_plan(args.out, p)  # before the lock: a refusal writes nothing
    with RunLock(args.out, "gptrain race") as held:  # one race writes OUT at a time
        check_plan(args.out, p)  # again, now that no other race can write its plan
        fresh = not (args.out / PLAN).exists()
        write_configs(args.out, p)
        try:
            return _race(args, p, argv, held)
        except UserError:  # bad input found by the first run: the corrected command may follow
            if fresh and not any(trained(job.run_dir) for job in p.jobs):
                remove_configs(args.out, p)
            raise


def _race(args: Args, p: Plan, argv: list[str], held: RunLock) -> int:
    labels, cfgs, jobs = p.labels, p.cfgs, p.jobs
    try:
        codes = run_all(jobs, slots(cfgs, args.jobs), args.out / "logs")
    except Stopped as e:
        print(f"gptrain race: {e}", file=sys.stderr)
        return 0
    except RunFailed as e:
        print(f"gptrain race: a run failed: {e}", file=sys.stderr)
        return RUN_FAILED
    fpt = {label: flops_per_token(cfg) for label, cfg in zip(labels, cfgs, strict=True)}
    runs = [record(job, codes[job], fpt[job.label]) for job in jobs]
    failed = [f"{r['dir']} ({r['status']})" for r in runs if r["status"] != "done"]
    if not any(r["status"] == "done" for r in runs if r["config"] == labels[0]):
        print(
            f"gptrain race: a run failed: no run of the baseline {labels[0]} finished (see {args.out}/{labels[0]}/*/train.log); fix the cause and run the same command to continue",
            file=sys.stderr,
        )
        return RUN_FAILED
    held.check()  # another race took OUT over (this one's heartbeat was late): LockLost
    race = {"command": ["gptrain", "race", *argv], "seeds": args.seeds}
    try:
        race |= analyse(runs, labels, args.target, p.rungs, regime(args.out, cfgs[0]))
    except UserError as e:
        if not failed:
            raise
        print(f"gptrain race: a run failed: {failed[0]}, so {e}", file=sys.stderr)
        return RUN_FAILED
    atomic_write_bytes(args.out / "race.json", json.dumps(race, indent=1).encode())
    plot_race(race, args.out / "race.png")
    print(markdown_table(race))
    print(f"\nrace.json and race.png in {args.out}", file=sys.stderr)
    if failed:
        print(
            f"gptrain race: a run failed: {len(failed)} of {len(runs)} ({', '.join(failed)}); race.json holds the others; see each run's train.log",
            file=sys.stderr,
        )
        return RUN_FAILED
    return 0

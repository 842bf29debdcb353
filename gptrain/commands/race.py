"""`gptrain race`: configs x seeds, each run an ordinary run directory, compared with statistics.

    gptrain race --config configs/default.toml --config configs/race.toml --seeds 5 \\
        --data.dir=data/tinyshakespeare --eval.tokens=100000 --out races/shakespeare

    --config FILE            a config to race (one flag per config); the first is the baseline
    --seeds N                runs per config, train.seed = 1..N (initialisation and data order);
                             default 5, at least 2 when there is more than one config
    --target VALUE|baseline  the val loss to reach: a number, or baseline (the baseline's mean
                             final val loss; the default)
    --out DIR                the race's folder (default races/<first>-vs-<second>...)
    --hellaswag              also score HellaSwag at the end of each run (eval.hellaswag)
    --section.key=value      an override applied to every run

The race is frozen at its start: DIR/plan.json holds each config as resolved (file + overrides),
and each run is `gptrain train --config DIR/<config>/config.toml --train.seed=K
--run.dir=DIR/<config>/seed_K`, that config.toml written from the plan (a config file edited
mid-race changes nothing; the next command naming it is refused). The runs are
trained in this process one after another (its output goes to stderr); on a machine with several
GPUs, when every run is one process, one run per GPU at a time (subprocesses, CUDA_VISIBLE_DEVICES).
The race holds DIR's run-folder lock throughout (a second race into DIR stops with one line).
A race stopped part-way continues when the same command runs again: every run directory resumes,
or says it is already trained, through gptrain train's own resume. At the end: DIR/race.json
(every run's curve and numbers, each config's statistics), DIR/race.png, and the markdown table
on stdout. The statistics are explained in docs/race.md.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from gptrain.cache import atomic_write_bytes
from gptrain.checkpoint.lock import RunLock
from gptrain.commands.race_plan import (
    PLAN,
    Args,
    Job,
    Plan,
    check_plan,
    parse_args,
    plan,
    remove_configs,
    trained,
    write_configs,
)
from gptrain.config.load import Config
from gptrain.errors import UserError, first_line
from gptrain.logs.plot import read_metrics
from gptrain.logs.race import analyse, curve_from_metrics
from gptrain.logs.race_report import markdown_table, plot_race


class Stopped(Exception):
    """A run was stopped by a signal (preemption): the race stops too, and continues next time."""


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


def run_all(jobs: list[Job], slots: list[str | None], logs: Path) -> dict[Job, int]:
    """Each job's exit code. A run stopped by Ctrl-C stops the race (KeyboardInterrupt)."""
    if slots == [None]:
        codes = {}
        for n, job in enumerate(jobs, 1):
            print(
                f"race: run {n}/{len(jobs)}: {job.label} seed {job.seed} -> {job.run_dir}",
                file=sys.stderr,
            )
            try:
                codes[job] = _train_in_process(list(job.argv))
            except (UserError, KeyboardInterrupt):
                raise
            except Exception as e:  # a bug or a crash in one run: recorded, the race goes on
                print(f"race: {job.run_dir} failed: {first_line(e)}", file=sys.stderr)
                codes[job] = 1
            if codes[job] == 130:
                raise KeyboardInterrupt
            if codes[job] == 0 and not (job.run_dir / "summary.json").is_file():
                raise Stopped(
                    f"{job.run_dir} was stopped by a signal (its checkpoint is saved); run the same command to continue the race"
                )
        return codes
    return _run_parallel(jobs, slots, logs)


def _run_parallel(jobs: list[Job], slots: list[str | None], logs: Path) -> dict[Job, int]:
    """One `python -m gptrain train` subprocess per slot at a time; output in OUT/logs/."""
    logs.mkdir(parents=True, exist_ok=True)
    pending, running, codes = list(jobs), {}, {}  # running: slot index -> (job, process, log)
    try:
        while pending or running:
            for i in [i for i in range(len(slots)) if i not in running and pending]:
                job = pending.pop(0)
                env = {**os.environ, "CUDA_VISIBLE_DEVICES": slots[i]}
                log = open(logs / f"{job.label}_seed_{job.seed}.log", "a")
                cmd = [sys.executable, "-m", "gptrain", "train", *job.argv]
                proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
                running[i] = (job, proc, log)
                print(
                    f"race: GPU {slots[i]}: {job.label} seed {job.seed} -> {job.run_dir}",
                    file=sys.stderr,
                )
            for i, (job, proc, log) in list(running.items()):
                if proc.poll() is not None:
                    log.close()
                    codes[job] = proc.returncode
                    del running[i]
            time.sleep(0.2)
    finally:
        for _job, proc, log in running.values():  # stopped: these runs resume next time
            proc.terminate()
            proc.wait()
            log.close()
    return codes


def flops_per_token(cfg: Config) -> float:
    """The model's training FLOPs per token (the model's own count), built on the meta device."""
    from gptrain.data.prepare import resolve_data_dir
    from gptrain.data.shards import read_manifest
    from gptrain.training.build import build_model

    vocab = int(read_manifest(resolve_data_dir(cfg.data.dir, cfg.data.tokenizer))["vocab_size"])
    return build_model(cfg, vocab, meta=True).flops_per_token(cfg.train.seq_len)


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
    with RunLock(args.out, "gptrain race"):  # one race writes OUT at a time
        check_plan(args.out, p)  # again, now that no other race can write its plan
        fresh = not (args.out / PLAN).exists()
        write_configs(args.out, p)
        try:
            return _race(args, p, argv)
        except UserError:  # bad input found by the first run: the corrected command may follow
            if fresh and not any(trained(job.run_dir) for job in p.jobs):
                remove_configs(args.out, p)
            raise


def _race(args: Args, p: Plan, argv: list[str]) -> int:
    labels, cfgs, jobs = p.labels, p.cfgs, p.jobs
    try:
        codes = run_all(jobs, gpu_slots(cfgs), args.out / "logs")
    except Stopped as e:
        print(f"gptrain race: {e}", file=sys.stderr)
        return 0
    fpt = {label: flops_per_token(cfg) for label, cfg in zip(labels, cfgs, strict=True)}
    runs = [record(job, codes[job], fpt[job.label]) for job in jobs]
    if not any(r["status"] == "done" for r in runs if r["config"] == labels[0]):
        raise UserError(
            f"no run of the baseline {labels[0]} finished (see {args.out}/{labels[0]}/*/train.log); fix the cause and run the same command to continue"
        )
    race = {"command": ["gptrain", "race", *argv], "seeds": args.seeds}
    race |= analyse(runs, labels, args.target)
    atomic_write_bytes(args.out / "race.json", json.dumps(race, indent=1).encode())
    plot_race(race, args.out / "race.png")
    print(markdown_table(race))
    print(f"\nrace.json and race.png in {args.out}", file=sys.stderr)
    return 0

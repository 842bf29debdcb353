"""The study's plan and speeds: `study.py plan` (each stage's runs, projected CPU hours and the
hours left) and `study.py measure` (each size's and block's tokens per CPU second on one thread
here: GPT-2's block as configs/study_baseline.toml, nanochat's as configs/study_nanochat_adamw.toml,
both AdamW; an arm is projected at its block's speed, nanochat's at GPT-2's until measured)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import study_progress
import study_reuse
import study_tuning
from study_cells import (
    BASE,
    NANOCHAT,
    REPO,
    SIZES,
    batch_tokens,
    cells,
    ladders,
    multiples,
    race_specs,
    run_seconds,
    tuning_dir,
)

from gptrain.cache import atomic_write_bytes
from gptrain.errors import UserError


def speed_of(speeds: dict[str, dict], size: str, arm: str) -> dict | None:
    """The measured speed of `arm`'s block at `size` (nanochat's: GPT-2's until measured)."""
    mine = speeds.get(f"{size}/nanochat") if arm.split("@")[0] in NANOCHAT else None
    return mine or speeds.get(size)


def plan_rows(args, speeds: dict[str, dict]) -> list[dict]:
    """Each stage's runs, projected CPU seconds and the seconds of them still to go (both None
    where its size is not measured; study_progress reads what OUT already holds)."""
    rows = []
    for corpus in args.corpora:
        for cell in study_tuning.tunings(args, corpus):
            n, cap = len(args.arms) * args.budget, len(args.arms) * args.cap
            each = [speed_of(speeds, cell.size.name, arm) for arm in args.arms]
            s = None if None in each else args.budget * sum(run_seconds(cell, v) for v in each)
            left = s and s * study_progress.tuning_left(tuning_dir(args.out, cell))
            rows.append({"stage": "tune", "cell": cell, "runs": f"{n} (+ up to {cap})", "s": s, "left": left})  # fmt: skip
    for cell in cells(args.corpora, args.cells):
        folder = args.out / "races" / cell.name
        every = [  # each race: its ladder's rungs and one run of its other config, every seed
            run
            for name, text, arms in race_specs(args)
            for run in study_progress.race_runs(folder / name, multiples(text), arms, args.seeds)
        ]  # less the runs that repeat an earlier race's: copies (study_reuse)
        runs = [run for run in every if study_reuse.twin(run[0], ladders(args)) is None]
        speed = [speed_of(speeds, cell.size.name, d.parent.name) for (d, _) in runs]
        s, left = None, None
        if None not in speed:
            s = sum(run_seconds(cell, v, m) for v, (_, m) in zip(speed, runs, strict=True))
            left = sum(run_seconds(cell, v, m) * study_progress.run_left(d, round(cell.steps * m)) for v, (d, m) in zip(speed, runs, strict=True))  # fmt: skip
        rows.append({"stage": "race", "cell": cell, "runs": f"{len(runs)} (+{len(every) - len(runs)} copied)", "s": s, "left": left})  # fmt: skip
    return rows


def plan(args) -> int:
    measured = read_throughput(args.out)
    speeds = measured.get("sizes", {})
    print("| stage | cell | blocks' params | tokens per run (1x) | runs | projected CPU hours | left |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|")
    parts: dict[str, dict] = {"s": {}, "left": {}}  # seconds by (stage, corpus of a tuning)
    for row in plan_rows(args, speeds):
        c = row["cell"]
        hours, to_go = ("not measured" if row[k] is None else f"{row[k] / 3600:.2f}" for k in ("s", "left"))  # fmt: skip
        where = (row["stage"], c.corpus if row["stage"] == "tune" else "")
        for k in parts:
            parts[k][where] = parts[k].get(where, 0.0) + (row[k] or 0.0)
        print(f"| {row['stage']} | {c.name} | {c.size.block_params:,} | {c.steps * batch_tokens():,} | {row['runs']} | {hours} | {to_go} |")  # fmt: skip
    if not speeds:
        print(
            f"\nno tokens/s measured yet: run python benchmarks/study/study.py measure --out {args.out}"
        )
        return 0
    (total, wall), (left, left_wall) = (_hours(args, parts[k]) for k in ("s", "left"))
    rates = ", ".join(f"{k} {v['tok_per_cpu_s']:,.0f}" for k, v in speeds.items())
    print(f"\nprojected: {total:.1f} CPU hours (one thread per run); {wall:.1f} hours with --jobs "
          f"{args.jobs} (nothing else running) on {measured['machine']}, {measured['date']} "
          f"(tokens per CPU second: {rates})")  # fmt: skip
    if any(a in NANOCHAT for a in args.arms) and not any("/" in k for k in speeds):
        print("nanochat's block at GPT-2's speed: not measured here (study.py measure measures it)")  # fmt: skip
    print(f"left: {left:.1f} CPU hours; {left_wall:.1f} hours with --jobs {args.jobs} (each "
          f"unfinished run from its newest checkpoint, in {args.out})")  # fmt: skip
    return 0


def _hours(args, parts: dict) -> tuple[float, float]:
    """(CPU hours, wall hours) of `parts` ({(stage, corpus): CPU seconds}) as `run` spends them
    with --jobs J: the corpora's tunings side by side (one corpus: its arms), then the races'
    runs J at a time."""
    total = sum(parts.values())
    if args.jobs <= 1:
        return total / 3600, total / 3600
    tunes = [v for (stage, _), v in parts.items() if stage == "tune"]
    tune = max(tunes, default=0.0) if len(tunes) > 1 else sum(tunes) / args.jobs
    return total / 3600, (tune + parts.get(("race", ""), 0.0) / args.jobs) / 3600


def read_throughput(out: Path) -> dict:
    path = out / "throughput.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}"


def steady_rate(run_dir: Path) -> dict:
    """Tokens/s of a run's steps after its first two (whose kernels are still being set up)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train_s" in r and "tokens" in r]
    if not rows:
        raise UserError(f"{run_dir}/metrics.jsonl has no step: the run was too short; use --seconds 30")  # fmt: skip
    first = rows[min(2, len(rows) - 2)] if len(rows) >= 2 else {"tokens": 0, "train_s": 0.0}
    tokens, seconds = rows[-1]["tokens"] - first["tokens"], rows[-1]["train_s"] - first["train_s"]
    return {"tok_per_s": tokens / seconds, "tokens": tokens, "train_s": seconds, "steps": len(rows)}


def timed_run(cmd: list[str]) -> tuple[int, float, float]:
    """(exit code, wall seconds, CPU seconds) of a child process on one thread."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=sys.stderr, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, time.perf_counter() - t0, usage.ru_utime + usage.ru_stime


def measure(args) -> int:
    """Each size's and block's training tokens per CPU second on one thread (~`seconds` of a run
    after start-up: GPT-2's block as the baseline, "<size>/nanochat" as nanochat_adamw), and its
    start-up's CPU seconds: the share of a core the run had (its CPU time over its wall time)
    turns wall-clock rates into CPU rates, so other jobs on the machine move the numbers less."""
    data = args.data_dir or str(args.data / f"{args.corpora[0]}-tune")
    if not Path(data, "manifest.json").is_file():
        raise UserError(f"{data} is not prepared; run python benchmarks/study/study_data.py first (or pass --data-dir)")  # fmt: skip
    sizes, load = {}, os.getloadavg()[0]
    blocks = (("", BASE), ("/nanochat", REPO / "configs/study_nanochat_adamw.toml"))
    for size, (block, config) in ((s, b) for s in SIZES.values() for b in blocks):
        key = size.name + block
        run_dir = args.out / "measure" / key.replace("/", "-")
        cmd = [sys.executable, "-m", "gptrain", "train", "--config", str(config)]
        cmd += [f"--{o}" for o in size.overrides()] + [f"--data.dir={data}", f"--run.dir={run_dir}"]
        cmd += [f"--train.time_budget={args.seconds}s", "--train.max_steps=100000"]
        cmd += ["--eval.every=0", "--eval.tokens=8192", "--checkpoint.every=0", "--log.every=1"]
        shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: no resume of an earlier one
        code, wall, cpu = timed_run(cmd)
        if code != 0:
            raise UserError(f"the measuring run {run_dir} failed (its output is above)")
        rate = steady_rate(run_dir)
        share = min(1.0, cpu / wall)
        train_s = json.loads((run_dir / "summary.json").read_text())["train_s"]
        sizes[key] = rate | {
            "cpu_share": share,
            "tok_per_cpu_s": rate["tok_per_s"] / share,
            "start_cpu_s": max(0.0, cpu - train_s * share),
        }
        print(f"study: {key}: {rate['tok_per_s']:,.0f} tok/s with {share:.2f} of a core", file=sys.stderr)  # fmt: skip
    record = {
        "machine": machine(),
        "date": datetime.date.today().isoformat(),
        "threads": 1,
        "load_average_before": load,
        "load_average_after": os.getloadavg()[0],
        "sizes": sizes,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(args.out / "throughput.json", json.dumps(record, indent=1).encode())
    return plan(args)

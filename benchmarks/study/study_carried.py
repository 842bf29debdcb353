"""Do the tuning cell's points carry over? At a cell tuned at its own size and steps
(--tune-cells), each arm's best point of its corpus's tuning cell (the small model at 1x) is
trained there as one more trial of the same kind (the cell's tuning split, seed and steps, in
OUT/tuning/<cell>/<arm>/<point>, kept like every trial), and its final loss is set beside the
cell's own best and the spread of the arm's seeds in the cell's races at 1x:

    python benchmarks/study/study.py run --stages check --cells large-1x --tune-cells code-large-1x

    trials(args, cell)   # the carried points trained at `cell` (each a finished trial read back)
    rows(args, cell)     # per arm: own best, carried point's loss, difference, seed sd, verdict
    table(rows)          # the Markdown table `study.py report` prints for each tuned cell

An arm's carried point "holds" when it ends within one seed standard deviation of the cell's own
best (the difference is measured on one seed of the tuning split; the spread on the races' seeds
at 1x on the held-out split). Where every arm holds at the largest cell tuned, the tuning cell's
points stand for the cells not tuned at their own size (docs/study.md).
"""

from __future__ import annotations

import json
import statistics
from concurrent.futures import ThreadPoolExecutor

import study_saved
import study_tuned
import study_tuning
import tune
from study_cells import Cell, tune_cell, tuning_dir

# each arm's runs at 1x in a cell's races: (race folder, config label)
AT_1X = {
    "baseline": ("baseline-ladder", "baseline@1"),
    "ablation": ("baseline-ladder", "ablation"),
    "recipe": ("recipe-ladder", "recipe@1"),
    "nanochat": ("nanochat-ladder", "nanochat@1"),
    "nanochat_adamw": ("nanochat_adamw-on-baseline-ladder", "nanochat_adamw"),
}


def carried(args, cell: Cell) -> dict[str, dict[str, float]]:
    """Each arm's best point at the tuning cell of `cell`'s corpus (--tuned's record, or the
    finished tuning in OUT)."""
    if args.tuned is not None:
        return study_tuned.points(args.tuned, cell.corpus, args.arms)
    path = tuning_dir(args.out, tune_cell(cell.corpus)) / "tune.json"
    return study_tuned.finished(path, cell.corpus, args.arms)


def trials(args, cell: Cell) -> dict[str, float]:
    """Train (or read back) each arm's carried point at `cell`, --jobs at a time (one thread
    each): its final val loss per arm."""
    out = tuning_dir(args.out, cell)
    o = cell.overrides(args.data / f"{cell.corpus}-tune")  # what run_tuning gives tune.py
    env = study_tuning.one_thread(args)

    def trial(arm: str, point: dict[str, float]) -> float:
        run_dir, overrides = tune.trial_of(arm, point, o, out)
        kept = study_saved.kept(args.out, args.results, run_dir)
        return tune.train_trial(tune.ARMS[arm], run_dir, overrides, kept, env)

    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        done = {arm: pool.submit(trial, arm, p) for arm, p in carried(args, cell).items()}
    return {arm: f.result() for arm, f in done.items()}


def seed_sd(race: dict | None, label: str) -> float | None:
    """The standard deviation of `label`'s finished runs' final val loss in a race.json."""
    if race is None:
        return None
    losses = [r["val_loss"] for r in race["runs"] if r["config"] == label and r["status"] == "done"]
    return statistics.stdev(losses) if len(losses) >= 2 else None


def rows(args, cell: Cell) -> list[dict]:
    """Per arm: the cell's own best loss, the carried point's, their difference, the arm's seed
    sd at 1x in the cell's races and whether the carried point holds (None: not yet known)."""
    report = json.loads((tuning_dir(args.out, cell) / "tune.json").read_text())
    out, points = [], carried(args, cell)
    for arm, point in points.items():
        carried_loss = tune.read_loss(tune.trial_dir(arm, point, tuning_dir(args.out, cell)))
        own = report["arms"][arm]["best"]["val_loss"]
        folder, label = AT_1X[arm]
        race = study_saved.find(args.out, args.results, cell.name, folder, "race.json")
        sd = seed_sd(json.loads(race.read_text()) if race else None, label)
        diff = None if carried_loss is None or own is None else carried_loss - own
        holds = None if diff is None or sd is None else diff <= sd
        out.append({"arm": arm, "own": own, "carried": carried_loss, "diff": diff, "sd": sd, "holds": holds})  # fmt: skip
    return out


def table(rows: list[dict]) -> str:
    def num(v, fmt=".4f"):
        return "not yet" if v is None else format(v, fmt)

    lines = ["| arm | own best | carried point | difference | seed sd at 1x | holds |"]
    lines.append("|---|---:|---:|---:|---:|---|")
    for r in rows:
        holds = {None: "not yet known", True: "yes", False: "no"}[r["holds"]]
        lines.append(f"| {r['arm']} | {num(r['own'])} | {num(r['carried'])} | {num(r['diff'], '+.4f')} | {num(r['sd'])} | {holds} |")  # fmt: skip
    return "\n".join(lines)

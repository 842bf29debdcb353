"""The token-efficiency study (docs/study.md): the recipe (Muon + wsd), its ablation (AdamW + wsd)
and llm.c's AdamW baseline with the recipe's freedoms, and the recipe and AdamW on nanochat's
block, tuned alike, raced on two corpora at two sizes and two horizons.

    python benchmarks/study/study.py plan      # the cells, their runs and the projected CPU hours
    python benchmarks/study/study.py measure   # each size's and block's tokens per CPU second here
    python benchmarks/study/study.py run       # data, tuning, races: resumable, run it again after a stop
    python benchmarks/study/study.py report    # each race's table, the cells', the block's

Options: --out DIR (default studies/main), --data DIR (default data/study), --corpora prose,code,
--stages data,tune,race (and check: each --tune-cells cell trains its corpus's tuning-cell points
as one more trial each, benchmarks/study/study_carried.py), --arms (default all five: baseline, recipe, ablation, nanochat,
nanochat_adamw), --tuned FILE (the tuning cell's points from a record such as
benchmarks/study/study_tuned.toml instead of tuning it), --cells small-1x,large-1x,small-4x (a kind on
every corpus, or one cell: code-small-4x), --tune-cells (cells tuned at their own size and steps:
benchmarks/study/study_tuning.py), --seeds 3, --baseline-ladder 0.5,1,2, --recipe-ladder
0.125,0.25,0.5,1, --budget 12 (tuning trials per arm), --cap 28, --results DIR (where finished
races are kept, default benchmarks/study/study_results), report --save, --jobs 2 (one-thread runs at a
time: in tuning, with two corpora the corpora side by side, with one its arms; in the races, one
cell at a time, its runs side by side. On 2 cores two one-thread runs of these small models do
more than one two-thread run).

The cells, in the order they run (cheapest first, so that a study stopped part-way has whole
cells): for each corpus, the small model at ~20 tokens per parameter in its blocks (compute-
optimal), the large one at ~20, the small one at ~80 (4x). Each cell is four races of complete
runs (every rung its own schedule), with the arms' configs written to OUT/configs/<cell>/ from
configs/study_*.toml, the cell's size and steps, and each arm's best point of benchmarks/study/tune.py
on the corpus's tuning split (the small model at 1x, or the cell itself with --tune-cells):

    gptrain race --config baseline.toml --config ablation.toml --ladder 0.5,1,2
        --seeds 3 --jobs J --out OUT/races/<cell>/baseline-ladder
    gptrain race --config recipe.toml --config baseline.toml --ladder 0.125,0.25,0.5,1
        --seeds 3 --jobs J --out OUT/races/<cell>/recipe-ladder
    gptrain race --config nanochat.toml --config recipe.toml --ladder 0.125,0.25,0.5,1
        --seeds 3 --jobs J --out OUT/races/<cell>/nanochat-ladder
    gptrain race --config baseline.toml --config nanochat_adamw.toml --ladder 0.5,1,2
        --seeds 3 --jobs J --out OUT/races/<cell>/nanochat_adamw-on-baseline-ladder

The first says how many times the baseline's tokens the ablation's loss is worth; the second at
how many tokens the recipe reaches the baseline's loss, whose inverse is the recipe's multiplier
(benchmarks/study/study_report.py): each crossing falls inside a ladder whatever the size of the gap,
and the recipe's ladder reads no token twice. The third measures nanochat's block against GPT-2's
under the recipe, inverted alike; the fourth nanochat's block under AdamW against the baseline
(benchmarks/study/study_block.py). A run that repeats a finished run of an earlier race (the same config
and seed: the recipe race's baseline, nanochat's race's recipe, the fourth race's rungs) is
copied, not trained again (benchmarks/study/study_reuse.py). Each finished race's race.json and
table.md are kept in --results (benchmarks/study/study_saved.py), which `report` reads where OUT lacks
a race; so is each finished run (tuning trials and race runs, in --results/finished_runs/), which a `run`
on another machine copies back instead of training it again.

Every stage resumes itself (tuning trials and race runs are run directories); `run` again
after any stop continues where it was.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import study_block  # noqa: E402
import study_carried  # noqa: E402
import study_report  # noqa: E402
import study_reuse  # noqa: E402
import study_saved  # noqa: E402
import study_tuning  # noqa: E402
import tune  # noqa: E402
from study_cells import (  # noqa: E402
    ARMS,
    ORDER,
    RACES,
    REPO,
    Cell,
    batch_tokens,
    cells,
    known,
    ladders,
    multiples,
    race_specs,
)
from study_plan import measure, plan  # noqa: E402

from gptrain.cache import atomic_write_bytes  # noqa: E402
from gptrain.commands.race_plan import rung_entries  # noqa: E402
from gptrain.config.load import load_config, to_toml  # noqa: E402
from gptrain.errors import UserError, first_line  # noqa: E402

DATA = Path("data/study")
STAGES = ("data", "tune", "check", "race")


def prepare_data(args) -> None:
    """The corpora's prepared folders, by benchmarks/study/study_data.py when one is missing."""
    want = [args.data / f"{c}{s}" / "manifest.json" for c in args.corpora for s in ("", "-tune")]
    if all(p.is_file() for p in want):
        return
    cmd = [sys.executable, str(REPO / "benchmarks/study/study_data.py"), "--out", str(args.data)]
    if subprocess.run(cmd).returncode != 0:
        raise UserError(
            "benchmarks/study/study_data.py failed (its line is above); fix it and run again"
        )


def cell_configs(args, cell: Cell, points: dict[str, dict[str, float]]) -> dict[str, Path]:
    """The cell's configs, one per arm, written to OUT/configs/<cell>/ (rewritten only when
    changed)."""
    folder, paths = args.out / "configs" / cell.name, {}
    for arm in args.arms:
        spec = tune.ARMS[arm]
        overrides = cell.overrides(args.data / cell.corpus) + spec.overrides(
            points[arm], cell.steps
        )
        text = f"# {cell.name}, {arm}: written by benchmarks/study/study.py\n"
        text += to_toml(load_config(str(REPO / spec.config), overrides))
        path = folder / f"{arm}.toml"
        if not path.is_file() or path.read_text() != text:
            folder.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, text.encode())
        paths[arm] = path
    return paths


def race_has_ladder() -> bool:
    cmd = [sys.executable, "-m", "gptrain", "race", "--help"]
    return "--ladder" in subprocess.run(cmd, capture_output=True, text=True).stdout


def run_race(args, cell: Cell) -> bool:
    """The cell's races, OUT/races/<cell>/<race>, each with its table.md, each copied to
    --results when finished (study_saved). False when one was stopped."""
    paths = cell_configs(args, cell, study_tuning.tuned(args, cell))
    for folder, ladder, arms in race_specs(args):
        out = args.out / "races" / cell.name / folder
        cmd = [sys.executable, "-m", "gptrain", "race"]
        for arm in arms:
            cmd += ["--config", str(paths[arm])]
        cmd += ["--seeds", str(args.seeds), "--ladder", ladder, "--out", str(out)]
        cmd += ["--jobs", str(args.jobs)]
        copy_twins(args, out, ladder, arms, paths)
        print(f"study: race {cell.name}: {' '.join(cmd)}", file=sys.stderr)
        env = study_tuning.one_thread(args)
        code, table = study_saved.run_keeping(cmd, env, lambda: keep(args))
        keep(args)
        if code != 0:
            raise UserError(f"the race {out} failed (its line is above); fix it and run again")
        if not table.strip():
            return False
        atomic_write_bytes(out / "table.md", table.encode())
        for path in study_saved.save(out, args.results, cell.name, folder):
            print(f"study: kept {path}", file=sys.stderr)
        print(f"\n## {cell.name}, {folder}\n\n{table}")
    return True


def keep(args) -> None:
    """Every finished run in OUT kept in --results (study_saved), to continue elsewhere."""
    if written := study_saved.keep_runs(args.out, args.results):
        print(f"study: kept {len(written)} files of finished runs in {args.results}", file=sys.stderr)  # fmt: skip


def copy_twins(args, out: Path, ladder: str, arms: tuple[str, str], paths: dict[str, Path]) -> None:
    """The race's runs that repeat a finished run of the cell's other races, or that are kept in
    --results from another machine, copied (study_reuse): its other arm at 1x, and its rungs."""
    rungs = rung_entries(str(paths[arms[0]]), arms[0], [], multiples(ladder))
    configs = [(label, path, o) for label, path, o in rungs] + [(arms[1], str(paths[arms[1]]), [])]
    for label, path, extra in configs:
        for k in range(1, args.seeds + 1):
            run_dir = out / label / f"seed_{k}"
            twin = study_reuse.twin(run_dir, ladders(args))
            sources = [study_saved.kept(args.out, args.results, run_dir)]
            sources += [twin, study_saved.kept(args.out, args.results, twin)] if twin else []
            if run_dir.exists() or not any((s / "summary.json").is_file() for s in sources):
                continue
            expected = to_toml(load_config(path, [*extra, f"train.seed={k}", f"run.dir={run_dir}"]))  # fmt: skip
            for source in sources:
                if study_reuse.copy_finished(source, run_dir, expected):
                    print(f"study: {run_dir} is {source} (the same config and seed): copied", file=sys.stderr)  # fmt: skip
                    break


def run(args) -> int:
    stages = args.stages.split(",")
    if args.tuned is not None:
        for cell in cells(
            args.corpora, args.cells
        ):  # a bad record stops here, before anything runs
            if cell not in study_tuning.own(args):
                study_tuning.tuned(args, cell)
        print(f"study: the tuning cell's points from {args.tuned}", file=sys.stderr)
    keep(args)  # what finished here before a stop, kept before anything else runs
    if "data" in stages:
        prepare_data(args)
    if "tune" in stages:
        study_tuning.tune_stage(args, __file__)
    if "check" in stages:  # the tuning cell's points trained at each cell tuned at its own size
        for cell in study_tuning.own(args):
            study_carried.trials(args, cell)
    if "race" in stages:
        if not race_has_ladder():
            raise UserError(
                "gptrain race in this checkout has no --ladder; update gptrain, then run the same command"
            )
        for cell in cells(args.corpora, args.cells):
            if not run_race(args, cell):
                print("study: a race was stopped; run the same command to continue", file=sys.stderr)  # fmt: skip
                return 0
    return report(args)


def report(args) -> int:
    """Each cell's race tables and the study's tables, from OUT's races or, where OUT lacks one,
    from --results (study_saved); --save first copies OUT's finished races there."""
    every = cells(args.corpora)
    if args.save:
        keep(args)
        for cell in every:
            for folder in RACES:
                for path in study_saved.save(args.out / "races" / cell.name / folder, args.results, cell.name, folder):  # fmt: skip
                    print(f"study: kept {path}", file=sys.stderr)
    rows, blocks, final = [], [], []
    largest, longest = max(c.size.block_params for c in every), max(c.horizon for c in every)
    for cell in every:
        if cell.size.block_params == largest or cell.horizon == longest:
            final.append(len(rows))  # the index its row gets below
        print(f"\n## {cell.name} ({cell.size.block_params:,} parameters in the blocks, {cell.steps * batch_tokens():,} tokens)")  # fmt: skip
        races = {}
        for folder in RACES:
            table, race = (study_saved.find(args.out, args.results, cell.name, folder, n) for n in study_saved.FILES[::-1])  # fmt: skip
            print(f"\n### {folder}\n")
            print(table.read_text().strip() if table else "not yet run")
            races[folder] = json.loads(race.read_text()) if race else None
        blocks.append(study_block.row(cell.name, races["nanochat-ladder"], races["nanochat_adamw-on-baseline-ladder"]))  # fmt: skip
        if not races["baseline-ladder"] and not races["recipe-ladder"]:
            rows.append(study_report.not_run(cell.name))
            continue
        rows.append(study_report.row(cell.name, races["baseline-ladder"], races["recipe-ladder"], train_tokens(args, cell)))  # fmt: skip
    carried_over(args)
    print(f"\n## The cells\n\n{study_report.table(rows)}")
    _, why = study_report.config_steps([rows[i] for i in final])
    print(f"\nconfigs/gpt2_124m.toml (the largest size and the longest horizon): {why}")
    print(f"\n## The block: nanochat's against GPT-2's\n\n{study_block.table(blocks)}")
    _, why = study_block.nanochat_steps([rows[i] for i in final], [blocks[i] for i in final])
    print(f"\nconfigs/nanochat_124m.toml (the largest size and the longest horizon): {why}")
    print(f"\nthe numbers behind each table: {args.out}/races/<cell>/<race>/race.json, else {args.results}/<cell>/<race>/race.json", file=sys.stderr)  # fmt: skip
    return 0


def carried_over(args) -> None:
    """For each cell tuned at its own size whose carried-point trials ran (--stages check): the
    tuning cell's points against the cell's own best (study_carried)."""
    for cell in study_tuning.own(args):
        try:
            rows = study_carried.rows(args, cell)
        except (UserError, OSError):
            continue  # a tuning not finished, or not in OUT
        print(f"\n## Do the tuning cell's points carry to {cell.name}?\n\n{study_carried.table(rows)}")  # fmt: skip


def train_tokens(args, cell: Cell) -> int | float:
    """The cell's train split in tokens (its manifest), to mark rungs reading it twice; without
    the prepared data (a report read from --results), every rung is taken to read it once."""
    path = args.data / cell.corpus / "manifest.json"
    if path.is_file():
        return json.loads(path.read_text())["splits"]["train"]["tokens"]
    return math.inf


def parse_args(argv: list[str]):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("plan", "measure", "run", "report"))
    ap.add_argument("--out", type=Path, default=Path("studies/main"), help="the study's folder")
    ap.add_argument("--data", type=Path, default=DATA, help="study_data.py's --out")
    ap.add_argument("--corpora", default="prose,code", help="comma-separated: prose, code")
    ap.add_argument("--stages", default="data,tune,race", help="run: comma-separated, of data, tune, check, race")  # fmt: skip
    ap.add_argument(
        "--jobs",
        type=int,
        default=2,
        help="run: one-thread runs at a time: tuning's corpora (or arms), a race's runs",
    )
    ap.add_argument("--cells", default=",".join(ORDER), help="run, plan: the cells to race: kinds of " + ", ".join(ORDER) + " (every corpus) or cells (code-large-1x)")  # fmt: skip
    ap.add_argument("--tune-cells", default="", help="run, plan: cells tuned at their own size and steps, their races at their own best points (as --cells; default none: every cell carries the small model's 1x tuning)")  # fmt: skip
    ap.add_argument("--arms", default=",".join(ARMS), help="the arms to tune and race, of " + ", ".join(ARMS))  # fmt: skip
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--baseline-ladder", default="0.5,1,2", help="the baseline's step multiples")
    ap.add_argument("--recipe-ladder", default="0.125,0.25,0.5,1", help="the recipe's")
    ap.add_argument("--budget", type=int, default=12, help="tuning trials per arm")
    ap.add_argument("--cap", type=int, default=28, help="extra trials to leave a grid's edge")
    ap.add_argument("--tuned", type=Path, default=None, help="run: the tuning cell's points from this record (benchmarks/study/study_tuned.toml), not tuned again")  # fmt: skip
    ap.add_argument("--results", type=Path, default=study_saved.RESULTS, help="where finished races (race.json, table.md) and runs (finished_runs/) are kept")  # fmt: skip
    ap.add_argument("--save", action="store_true", help="report: first keep OUT's finished races and runs in --results")  # fmt: skip
    ap.add_argument("--seconds", type=int, default=15, help="measure: seconds of each run")
    ap.add_argument("--data-dir", default=None, help="measure: a prepared folder to train on")
    args = ap.parse_args(argv)
    args.corpora = args.corpora.split(",")
    if bad := [c for c in args.corpora if c not in ("prose", "code")]:
        raise UserError(f"--corpora: unknown {', '.join(bad)}; choose from prose, code")
    args.cells = tuple(args.cells.split(","))
    args.tune_cells = tuple(c for c in args.tune_cells.split(",") if c)
    for flag, names in (("--cells", args.cells), ("--tune-cells", args.tune_cells)):
        if bad := known(names, args.corpora):
            raise UserError(f"{flag}: unknown {', '.join(bad)}; choose from {', '.join(ORDER)}, or one of them on a corpus of --corpora (code-large-1x)")  # fmt: skip
    if bad := [s for s in args.stages.split(",") if s not in STAGES]:
        raise UserError(f"--stages: unknown {', '.join(bad)}; choose from {', '.join(STAGES)}")
    args.arms = tuple(args.arms.split(","))
    if bad := [a for a in args.arms if a not in ARMS]:
        raise UserError(f"--arms: unknown {', '.join(bad)}; choose from {', '.join(ARMS)}")
    for flag, text in (("--baseline-ladder", args.baseline_ladder), ("--recipe-ladder", args.recipe_ladder)):  # fmt: skip
        try:
            multiples(text)
        except ValueError:
            raise UserError(f"{flag} {text!r}: write multiples as 0.5,1,2") from None
    return args


def main(argv: list[str]) -> int:
    try:
        args = parse_args(argv)
        return {"plan": plan, "measure": measure, "run": run, "report": report}[args.action](args)
    except UserError as e:
        print(f"study: {first_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("study: stopped; run the same command to continue", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

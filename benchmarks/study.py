"""The token-efficiency study (docs/study.md): the recipe (Muon + wsd), its ablation (AdamW + wsd)
and llm.c's AdamW baseline, tuned alike, raced on two corpora at two sizes and two horizons.

    python benchmarks/study.py plan      # the cells, their runs and the projected CPU hours
    python benchmarks/study.py measure   # each size's tokens per CPU second here (~15 s each)
    python benchmarks/study.py run       # data, tuning, races: resumable, run it again after a stop
    python benchmarks/study.py report    # each race's table, and where its race.json is

Options: --out DIR (default studies/main), --data DIR (default data/study), --corpora prose,code,
--stages data,tune,race, --tuned FILE (each arm's point from a record such as
benchmarks/study_tuned.toml instead of the tune stage), --cells small-1x,large-1x,small-4x,
--seeds 3, --baseline-ladder 0.5,1,2, --recipe-ladder 0.125,0.25,0.5,1, --budget 12 (tuning
trials per arm), --cap 16, --jobs 2 (one-thread runs at a time: in tuning, with two corpora
the corpora side by side, with one its arms; in the races, one cell at a time, its runs side by
side, so that no core waits while another corpus's longer cells go on. On 2 cores two one-thread
runs of these small models do more than one two-thread run).

The cells, in the order they run (cheapest first, so that a study stopped part-way has whole
cells): for each corpus, the small model at ~20 tokens per parameter in its blocks (compute-
optimal), the large one at ~20, the small one at ~80 (4x). Each cell is two races of complete
runs (every rung its own schedule), with the three configs written to OUT/configs/<cell>/ from
configs/study_*.toml, the cell's size and steps, and each arm's best point of benchmarks/tune.py
on the corpus's tuning split (the small model at 1x):

    gptrain race --config baseline.toml --config ablation.toml --ladder 0.5,1,2
        --seeds 3 --jobs J --out OUT/races/<cell>/baseline-ladder
    gptrain race --config recipe.toml --config baseline.toml --ladder 0.125,0.25,0.5,1
        --seeds 3 --jobs J --out OUT/races/<cell>/recipe-ladder

The first says how many times the baseline's tokens the ablation's loss is worth; the second at
how many tokens the recipe reaches the baseline's loss, whose inverse is the recipe's multiplier
(benchmarks/study_report.py): each crossing falls inside a ladder whatever the size of the gap,
and the recipe's ladder reads no token twice. The second race's baseline runs are the first's 1x
runs (the same config and seed): they are copied, not trained again (benchmarks/study_reuse.py).

Every stage resumes itself (tuning trials and race runs are run directories); `run` again
after any stop continues where it was.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import study_report  # noqa: E402
import study_reuse  # noqa: E402
import study_tuned  # noqa: E402
import tune  # noqa: E402
from study_cells import (  # noqa: E402
    ARMS,
    ORDER,
    REPO,
    Cell,
    batch_tokens,
    cells,
    multiples,
    race_specs,
    tune_cell,
)
from study_plan import measure, plan  # noqa: E402

from gptrain.cache import atomic_write_bytes  # noqa: E402
from gptrain.config.load import load_config, to_toml  # noqa: E402
from gptrain.errors import UserError, first_line  # noqa: E402

DATA = Path("data/study")


def prepare_data(args) -> None:
    """The corpora's prepared folders, by benchmarks/study_data.py when one is missing."""
    want = [args.data / f"{c}{s}" / "manifest.json" for c in args.corpora for s in ("", "-tune")]
    if all(p.is_file() for p in want):
        return
    cmd = [sys.executable, str(REPO / "benchmarks/study_data.py"), "--out", str(args.data)]
    if subprocess.run(cmd).returncode != 0:
        raise UserError("benchmarks/study_data.py failed (its line is above); fix it and run again")


def tuned(args, corpus: str) -> dict[str, dict[str, float]]:
    """Each arm's best point from the corpus's finished tuning, or from the --tuned record."""
    if args.tuned is not None:
        return study_tuned.points(args.tuned, corpus)
    return study_tuned.finished(args.out / "tuning" / corpus / "tune.json", corpus)


def run_tuning(args, corpus: str) -> None:
    cell = tune_cell(corpus)
    cmd = [sys.executable, str(REPO / "benchmarks/tune.py"), "--out", str(args.out / "tuning" / corpus)]  # fmt: skip
    cmd += ["--budget", str(args.budget), "--cap", str(args.cap), "--jobs", str(args.jobs)]
    cmd += [f"--{o}" for o in cell.overrides(args.data / f"{corpus}-tune")]
    print(f"study: tuning {corpus}: {' '.join(cmd)}", file=sys.stderr)
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=one_thread(args))
    if done.returncode != 0:
        raise UserError(f"the tuning of {corpus} failed (its line is above); fix it and run again")
    print(done.stdout)
    tuned(args, corpus)  # a tuning stopped by a signal ends here, to continue next time


def one_thread(args) -> dict:
    """The environment of a stage running `--jobs` runs side by side: one thread each."""
    return {**os.environ, "OMP_NUM_THREADS": "1"} if args.jobs > 1 else dict(os.environ)


def cell_configs(args, cell: Cell, points: dict[str, dict[str, float]]) -> list[Path]:
    """The cell's three configs, written to OUT/configs/<cell>/ (rewritten only when changed)."""
    folder, paths = args.out / "configs" / cell.name, []
    for arm in ARMS:
        spec = tune.ARMS[arm]
        overrides = cell.overrides(args.data / cell.corpus) + spec.overrides(
            points[arm], cell.steps
        )
        text = f"# {cell.name}, {arm}: written by benchmarks/study.py\n"
        text += to_toml(load_config(str(REPO / spec.config), overrides))
        path = folder / f"{arm}.toml"
        if not path.is_file() or path.read_text() != text:
            folder.mkdir(parents=True, exist_ok=True)
            atomic_write_bytes(path, text.encode())
        paths.append(path)
    return paths


def race_has_ladder() -> bool:
    cmd = [sys.executable, "-m", "gptrain", "race", "--help"]
    return "--ladder" in subprocess.run(cmd, capture_output=True, text=True).stdout


def run_race(args, cell: Cell) -> bool:
    """The cell's two races, OUT/races/<cell>/<arm>-ladder, each with its table.md. False when
    one was stopped."""
    paths = dict(zip(ARMS, cell_configs(args, cell, tuned(args, cell.corpus)), strict=True))
    for ladder, arms in race_specs(args):
        out = args.out / "races" / cell.name / f"{arms[0]}-ladder"
        cmd = [sys.executable, "-m", "gptrain", "race"]
        for arm in arms:
            cmd += ["--config", str(paths[arm])]
        cmd += ["--seeds", str(args.seeds), "--ladder", ladder, "--out", str(out)]
        cmd += ["--jobs", str(args.jobs)]
        copy_twins(args, out, arms, paths)
        print(f"study: race {cell.name}: {' '.join(cmd)}", file=sys.stderr)
        done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=one_thread(args))
        if done.returncode != 0:
            raise UserError(f"the race {out} failed (its line is above); fix it and run again")
        if not done.stdout.strip():
            return False
        atomic_write_bytes(out / "table.md", done.stdout.encode())
        print(f"\n## {cell.name}, the {arms[0]}'s ladder\n\n{done.stdout}")
    return True


def copy_twins(args, out: Path, arms: tuple[str, str], paths: dict[str, Path]) -> None:
    """The race's runs that repeat a finished run of the cell's other race, copied (study_reuse)."""
    ladder = multiples(args.baseline_ladder)
    for run_dir in (out / arms[1] / f"seed_{k}" for k in range(1, args.seeds + 1)):
        source = study_reuse.twin(run_dir, ladder)
        if source is None:
            continue
        overrides = [f"train.seed={run_dir.name.removeprefix('seed_')}", f"run.dir={run_dir}"]
        expected = to_toml(load_config(str(paths[arms[1]]), overrides))
        if study_reuse.copy_finished(source, run_dir, expected):
            print(f"study: {run_dir} is {source} (the same config and seed): copied", file=sys.stderr)  # fmt: skip


def tune_parallel(args) -> None:
    """The corpora's tunings side by side: one `run --stages tune` process per corpus, on one
    thread (OMP_NUM_THREADS=1), its output in OUT/logs/run-<corpus>.log; the corpora's folders
    are disjoint."""
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    running = []
    for corpus in args.corpora:
        cmd = [sys.executable, __file__, "run", "--jobs", "1", "--corpora", corpus]
        cmd += ["--stages", "tune", "--out", str(args.out), "--data", str(args.data)]
        cmd += ["--budget", str(args.budget), "--cap", str(args.cap)]
        log = args.out / "logs" / f"run-{corpus}.log"
        with open(log, "a") as f:
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            running.append((corpus, log, subprocess.Popen(cmd, stdout=f, stderr=f, env=env)))
        print(f"study: {corpus}: running, its output in {log}", file=sys.stderr)
    try:
        failed = [(c, log) for c, log, proc in running if proc.wait() != 0]
    finally:
        for _, _, proc in running:  # stopped: each part resumes next time
            if proc.poll() is None:
                proc.terminate()
                proc.wait()
    if failed:
        raise UserError(f"the tuning of {failed[0][0]} failed: see the end of {failed[0][1]}")
    for corpus in args.corpora:  # a tuning stopped by a signal ends here, to continue next time
        tuned(args, corpus)


def run(args) -> int:
    stages = args.stages.split(",")
    if args.tuned is not None:
        for corpus in args.corpora:  # a bad record stops here, before anything runs
            tuned(args, corpus)
        print(f"study: each arm's tuned point from {args.tuned}: no tune stage", file=sys.stderr)
        stages = [s for s in stages if s != "tune"]
    if "data" in stages:
        prepare_data(args)
    if "tune" in stages and args.jobs > 1 and len(args.corpora) > 1:
        tune_parallel(args)
    elif "tune" in stages:
        for corpus in args.corpora:
            run_tuning(args, corpus)
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
    rows, final = [], []
    every = cells(args.corpora)
    largest, longest = max(c.size.block_params for c in every), max(c.horizon for c in every)
    for cell in every:
        if cell.size.block_params == largest or cell.horizon == longest:
            final.append(len(rows))  # the index its row gets below
        folder = args.out / "races" / cell.name
        print(f"\n## {cell.name} ({cell.size.block_params:,} parameters in the blocks, {cell.steps * batch_tokens():,} tokens)")  # fmt: skip
        races = {}
        for _, arms in race_specs(args):
            table, race = (
                folder / f"{arms[0]}-ladder" / name for name in ("table.md", "race.json")
            )
            print(f"\n### The {arms[0]}'s ladder\n")
            print(table.read_text().strip() if table.is_file() else "not yet run")
            races[arms[0]] = json.loads(race.read_text()) if race.is_file() else None
        if not any(races.values()):
            rows.append(study_report.not_run(cell.name))
            continue
        manifest = json.loads((args.data / cell.corpus / "manifest.json").read_text())
        train = manifest["splits"]["train"]["tokens"]
        rows.append(study_report.row(cell.name, races["baseline"], races["recipe"], train))
    print(f"\n## The cells\n\n{study_report.table(rows)}")
    _, why = study_report.config_steps([rows[i] for i in final])
    print(f"\nconfigs/gpt2_124m.toml (the largest size and the longest horizon): {why}")
    print(f"\nthe numbers behind each table: {args.out}/races/<cell>/<arm>-ladder/race.json", file=sys.stderr)  # fmt: skip
    return 0


def parse_args(argv: list[str]):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("plan", "measure", "run", "report"))
    ap.add_argument("--out", type=Path, default=Path("studies/main"), help="the study's folder")
    ap.add_argument("--data", type=Path, default=DATA, help="study_data.py's --out")
    ap.add_argument("--corpora", default="prose,code", help="comma-separated: prose, code")
    ap.add_argument("--stages", default="data,tune,race", help="run: comma-separated stages")
    ap.add_argument(
        "--jobs",
        type=int,
        default=2,
        help="run: one-thread runs at a time: tuning's corpora (or arms), a race's runs",
    )
    ap.add_argument("--cells", default=",".join(ORDER), help="run: the races to run, of " + ", ".join(ORDER))  # fmt: skip
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--baseline-ladder", default="0.5,1,2", help="the baseline's step multiples")
    ap.add_argument("--recipe-ladder", default="0.125,0.25,0.5,1", help="the recipe's")
    ap.add_argument("--budget", type=int, default=12, help="tuning trials per arm")
    ap.add_argument("--cap", type=int, default=16, help="extra trials to leave a grid's edge")
    ap.add_argument("--tuned", type=Path, default=None, help="run: each arm's point from this record (benchmarks/study_tuned.toml), not tuned again")  # fmt: skip
    ap.add_argument("--seconds", type=int, default=15, help="measure: seconds of each run")
    ap.add_argument("--data-dir", default=None, help="measure: a prepared folder to train on")
    args = ap.parse_args(argv)
    args.corpora = args.corpora.split(",")
    args.cells = tuple(args.cells.split(","))
    if bad := [c for c in args.cells if c not in ORDER]:
        raise UserError(f"--cells: unknown {', '.join(bad)}; choose from {', '.join(ORDER)}")
    if bad := [c for c in args.corpora if c not in ("prose", "code")]:
        raise UserError(f"--corpora: unknown {', '.join(bad)}; choose from prose, code")
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

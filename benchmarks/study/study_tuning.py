"""The study's tune stage (benchmarks/study/study.py run --stages tune): which cells are tuned, each
arm's point at a cell, and the tunings run by benchmarks/study/tune.py.

By default every arm is tuned once per corpus at the tuning cell (the small model at 1x, on the
corpus's tuning split) and its best point is carried to every cell. `--tune-cells` names cells
(a kind, large-1x, on every corpus, or one cell, code-large-1x) tuned at their own size and
steps, by the same procedure and trial count, on the same tuning split: each such cell's races
use its own best points, in OUT/tuning/<cell>/tune.json. The tuning cell is tuned too while a
raced cell carries its points (unless --tuned gives them). Each finished trial is kept in
--results (benchmarks/study/study_saved.py) and copied back from there on another machine.
"""

from __future__ import annotations

import os
import subprocess
import sys

import study_saved
import study_tuned
from study_cells import REPO, Cell, cells, tune_cell, tuning_dir

from gptrain.errors import UserError


def own(args) -> list[Cell]:
    """The cells tuned at their own size and steps (--tune-cells)."""
    return cells(args.corpora, args.tune_cells)


def tunings(args, corpus: str) -> list[Cell]:
    """The cells of `corpus` the tune stage tunes: the tuning cell while a raced cell carries
    its points and --tuned does not give them, then the --tune-cells of the corpus."""
    mine = [c for c in own(args) if c.corpus == corpus]
    carried = [c for c in cells([corpus], args.cells) if c not in mine]
    first = [tune_cell(corpus)] if carried and args.tuned is None else []
    return first + [c for c in mine if c not in first]


def tuned(args, cell: Cell) -> dict[str, dict[str, float]]:
    """Each arm's point for `cell`'s races: its own tuning's best (a --tune-cells cell), else the
    corpus's tuning cell's (from --tuned's record, or from OUT/tuning/<corpus>)."""
    if cell in own(args):
        return study_tuned.finished(tuning_dir(args.out, cell) / "tune.json", cell.name, args.arms)  # fmt: skip
    if args.tuned is not None:
        return study_tuned.points(args.tuned, cell.corpus, args.arms)
    path = tuning_dir(args.out, tune_cell(cell.corpus)) / "tune.json"
    return study_tuned.finished(path, cell.corpus, args.arms)


def one_thread(args) -> dict:
    """The environment of a stage running `--jobs` runs side by side: one thread each."""
    return {**os.environ, "OMP_NUM_THREADS": "1"} if args.jobs > 1 else dict(os.environ)


def run_tuning(args, cell: Cell) -> None:
    """benchmarks/study/tune.py at `cell`'s size and steps on its corpus's tuning split."""
    out = tuning_dir(args.out, cell)
    cmd = [sys.executable, str(REPO / "benchmarks/study/tune.py"), "--out", str(out)]
    cmd += ["--budget", str(args.budget), "--cap", str(args.cap), "--jobs", str(args.jobs)]
    cmd += [
        "--arms",
        ",".join(args.arms),
        "--kept",
        str(study_saved.kept(args.out, args.results, out)),
    ]
    cmd += [f"--{o}" for o in cell.overrides(args.data / f"{cell.corpus}-tune")]
    print(f"study: tuning {cell.name}: {' '.join(cmd)}", file=sys.stderr)
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=one_thread(args))
    if done.returncode != 0:
        raise UserError(f"the tuning of {cell.name} failed (its line is above); fix it and run again")  # fmt: skip
    print(done.stdout)
    # a tuning stopped by a signal ends here, to continue next time
    study_tuned.finished(out / "tune.json", cell.name, args.arms)


def passed_on(args) -> list[str]:
    """The flags a `run --stages tune` child process needs to tune what this one would."""
    flags = ["--out", str(args.out), "--data", str(args.data), "--budget", str(args.budget)]
    flags += ["--cap", str(args.cap), "--arms", ",".join(args.arms), "--results", str(args.results)]
    flags += ["--cells", ",".join(args.cells), "--tune-cells", ",".join(args.tune_cells)]
    return flags + (["--tuned", str(args.tuned)] if args.tuned is not None else [])


def tune_parallel(args, script: str) -> None:
    """The corpora's tunings side by side: one `run --stages tune` process per corpus, on one
    thread (OMP_NUM_THREADS=1), its output in OUT/logs/run-<corpus>.log; the corpora's folders
    are disjoint."""
    (args.out / "logs").mkdir(parents=True, exist_ok=True)
    running = []
    for corpus in args.corpora:
        cmd = [sys.executable, script, "run", "--jobs", "1", "--corpora", corpus]
        cmd += ["--stages", "tune", *passed_on(args)]
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
        for cell in tunings(args, corpus):
            study_tuned.finished(tuning_dir(args.out, cell) / "tune.json", cell.name, args.arms)


def tune_stage(args, script: str) -> None:
    """Every tuning the run needs: corpora side by side (--jobs > 1, two corpora or more), or
    one corpus after the other, its cells one after the other."""
    if not any(tunings(args, corpus) for corpus in args.corpora):
        return
    if args.jobs > 1 and len(args.corpora) > 1:
        tune_parallel(args, script)
        return
    for corpus in args.corpora:
        for cell in tunings(args, corpus):
            run_tuning(args, cell)

"""Finished races and runs kept in the repository: OUT is an ignored folder, lost with its
machine, so each finished race's race.json and table.md are copied to
benchmarks/study/study_results/<cell>/<race>/ (`study.py run` at the end of each race, `study.py
report --save` for every race in OUT), and `study.py report` reads a race from there when OUT
lacks it. A study takes more hours than one machine may live, so each finished run (a tuning
trial, a race's run) is kept too, as the files that say it finished and what it measured
(config.toml, summary.json, metrics.jsonl) in study_results/finished_runs/<its path under OUT>; on
another machine the study copies a kept run back into OUT instead of training it again, when its
config is the one the run would train (benchmarks/study/study_reuse.py copy_finished).

    save(race_dir, results, cell, race)    # the finished race's files, copied; their paths
    find(out, results, cell, race, name)   # OUT's file, else the saved one, else None
    keep_run(run_dir, dest)                # one finished run's files kept in dest
    keep_runs(out, results)                # every finished run under OUT kept; the files written
    kept(out, results, run_dir)            # where the run `run_dir` of OUT is kept
    run_keeping(cmd, env, keep)            # a race's command, `keep` called every few minutes

A race's runs are kept while it trains (run_keeping), not only at its end: a machine that stops
mid-race loses none of the race's finished runs.

A race is finished when its race.json exists (gptrain race writes it at its end), a run when its
summary.json does; a copy is written beside its destination and renamed into place, and a file
already equal is not rewritten.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

from gptrain.cache import atomic_write_bytes

RESULTS = Path(__file__).resolve().parent / "study_results"
FILES = ("race.json", "table.md")
RUN_FILES = ("config.toml", "summary.json", "metrics.jsonl")  # a finished run, as a race reads it
STAGES = ("tuning", "races")  # OUT's folders of runs
KEEP_EVERY_S = 300.0  # run_keeping's period


def _copy(source: Path, dest: Path) -> bool:
    """Copy one file, atomically, unless dest already holds the same bytes. True if written."""
    data = source.read_bytes()
    if dest.is_file() and dest.read_bytes() == data:
        return False
    dest.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(dest, data)
    return True


def kept(out: Path, results: Path, run_dir: Path) -> Path:
    """Where the run `run_dir` (a folder under OUT) is kept: results/finished_runs/<its path
    under OUT>."""
    return results / "finished_runs" / run_dir.relative_to(out)


def keep_run(run_dir: Path, dest: Path) -> list[Path]:
    """Keep the finished run `run_dir` in `dest` (RUN_FILES, those it has); the files written."""
    return [
        dest / name
        for name in RUN_FILES
        if (run_dir / name).is_file() and _copy(run_dir / name, dest / name)
    ]


def keep_runs(out: Path, results: Path) -> list[Path]:
    """Keep every finished run under OUT/tuning and OUT/races (its summary.json and config.toml
    exist; folders being copied, named with a leading dot, are not runs): RUN_FILES copied to
    kept(); the paths written."""
    written = []
    for stage in STAGES:
        for summary in sorted((out / stage).glob("**/summary.json")):
            run_dir = summary.parent
            parts = run_dir.relative_to(out).parts
            if any(p.startswith(".") for p in parts) or not (run_dir / "config.toml").is_file():
                continue
            written += keep_run(run_dir, kept(out, results, run_dir))
    return written


def save(race_dir: Path, results: Path, cell: str, race: str) -> list[Path]:
    """Copy the finished race in `race_dir` (its race.json and table.md) to results/<cell>/<race>/;
    the paths written (none when the race has not finished)."""
    if not (race_dir / "race.json").is_file():
        return []
    written = []
    for name in FILES:
        source, dest = race_dir / name, results / cell / race / name
        if source.is_file() and _copy(source, dest):
            written.append(dest)
    return written


def find(out: Path, results: Path, cell: str, race: str, name: str) -> Path | None:
    """OUT/races/<cell>/<race>/<name> when it exists, else results/<cell>/<race>/<name>, else
    None."""
    for path in (out / "races" / cell / race / name, results / cell / race / name):
        if path.is_file():
            return path
    return None


def run_keeping(
    cmd: list[str], env: dict, keep: Callable[[], None], every_s: float = KEEP_EVERY_S
) -> tuple[int, str]:
    """Run `cmd` to its end, its stdout captured, calling `keep` every `every_s` seconds while it
    runs: (exit code, stdout). Stopped (an exception here), it is killed, as subprocess.run does."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) as proc:
        try:
            while True:
                try:
                    out, _ = proc.communicate(timeout=every_s)  # a retry loses no output
                    return proc.returncode, out
                except subprocess.TimeoutExpired:
                    keep()
        except BaseException:
            proc.kill()
            raise

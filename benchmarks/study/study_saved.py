"""Finished races kept in the repository: OUT is an ignored folder, lost with its machine, so each
finished race's race.json and table.md are copied to benchmarks/study/study_results/<cell>/<race>/
(`study.py run` at the end of each race, `study.py report --save` for every race in OUT), and
`study.py report` reads a race from there when OUT lacks it.

    save(race_dir, results, cell, race)    # the finished race's files, copied; their paths
    find(out, results, cell, race, name)   # OUT's file, else the saved one, else None

A race is finished when its race.json exists (gptrain race writes it at its end); a copy is
written beside its destination and renamed into place, and a file already equal is not
rewritten.
"""

from __future__ import annotations

from pathlib import Path

from gptrain.cache import atomic_write_bytes

RESULTS = Path(__file__).resolve().parent / "study_results"
FILES = ("race.json", "table.md")


def save(race_dir: Path, results: Path, cell: str, race: str) -> list[Path]:
    """Copy the finished race in `race_dir` (its race.json and table.md) to results/<cell>/<race>/;
    the paths written (none when the race has not finished)."""
    if not (race_dir / "race.json").is_file():
        return []
    written = []
    for name in FILES:
        source, dest = race_dir / name, results / cell / race / name
        if not source.is_file():
            continue
        data = source.read_bytes()
        if dest.is_file() and dest.read_bytes() == data:
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(dest, data)
        written.append(dest)
    return written


def find(out: Path, results: Path, cell: str, race: str, name: str) -> Path | None:
    """OUT/races/<cell>/<race>/<name> when it exists, else results/<cell>/<race>/<name>, else
    None."""
    for path in (out / "races" / cell / race / name, results / cell / race / name):
        if path.is_file():
            return path
    return None

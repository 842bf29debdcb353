"""The recipe race's baseline runs are the baseline ladder's 1x runs: copied, not trained twice.

    source = twin(run_dir, baseline_ladder)   # the ladder's run a recipe-race run repeats, or None
    copied = copy_finished(source, run_dir, expected_config_text)

Both races of a cell train the baseline at 1x for seeds 1..N: the same config and seed in two
folders, so the same run bit for bit. `copy_finished` copies the ladder's finished run into the
recipe race's folder before that race starts, so the race finds it finished and does not start
it. It copies only a run that has finished (its summary.json) and whose config.toml equals the
one the recipe race would train but for run.dir; the copy is made beside the destination and
renamed into place (a stop mid-copy leaves no half folder), and its config.toml names its own
folder. A destination that exists is never touched.
"""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

from gptrain.cache import atomic_write_bytes

RECIPE_RACE, BASELINE_RACE = "recipe-ladder", "baseline-ladder"


def twin(run_dir: Path, baseline_ladder: list[float]) -> Path | None:
    """The baseline ladder's 1x run that `run_dir` (OUT/races/<cell>/recipe-ladder/baseline/
    seed_K) repeats; None for any other run, or when the ladder has no 1x rung."""
    label, race = run_dir.parent.name, run_dir.parent.parent
    if label != "baseline" or race.name != RECIPE_RACE or 1.0 not in baseline_ladder:
        return None
    return race.parent / BASELINE_RACE / "baseline@1" / run_dir.name


def _same_but_folder(a: str, b: str) -> bool:
    """Whether two resolved configs (to_toml's text) are equal but for run.dir."""
    try:
        x, y = tomllib.loads(a), tomllib.loads(b)
    except tomllib.TOMLDecodeError:
        return False
    for config in (x, y):
        config.get("run", {}).pop("dir", None)
    return x == y


def copy_finished(source: Path, dest: Path, expected: str) -> bool:
    """Copy the finished run `source` to `dest` when its config is `expected` (the config dest's
    run would train, run.dir = dest) but for run.dir, and dest does not exist. True if copied."""
    if dest.exists() or not (source / "summary.json").is_file():
        return False
    try:
        saved = (source / "config.toml").read_text()
    except OSError:
        return False
    if not _same_but_folder(saved, expected):
        return False
    part = dest.with_name(f".{dest.name}.copying")
    shutil.rmtree(part, ignore_errors=True)  # a copy cut short by a stop
    shutil.copytree(source, part, ignore=shutil.ignore_patterns(".lock*"))
    atomic_write_bytes(part / "config.toml", expected.encode())
    part.rename(dest)
    return True

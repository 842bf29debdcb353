"""A cell's runs that repeat a finished run of another of its races: copied, not trained twice.

    source = twin(run_dir, ladders)   # the run `run_dir` repeats in an earlier race, or None
    copied = copy_finished(source, run_dir, expected_config_text)

The races of a cell (benchmarks/study/study_cells.py RACES) share runs: the recipe race's baseline at
1x is the baseline ladder's 1x run, nanochat's race's recipe at 1x is the recipe ladder's 1x run,
and nanochat_adamw's race on the baseline's ladder has every rung of the baseline ladder's race:
the same config and seed in two folders, so the same run bit for bit. `copy_finished` copies the
earlier race's finished run into the later race's folder before that race starts, so the race
finds it finished and does not start it. It copies only a run that has finished (its
summary.json) and whose config.toml equals the one the later race would train but for run.dir
(a speed choice it left to `auto` counting as the value it chose: the study pins them);
the copy is made beside the destination and renamed into place (a stop mid-copy leaves no half
folder), and its config.toml names its own folder. A destination that exists is never touched.
"""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path

from study_cells import RACES

from gptrain.cache import atomic_write_bytes
from gptrain.config.load import resolved_again


def twin(run_dir: Path, ladders: dict[str, list[float]]) -> Path | None:
    """The earlier race's run that `run_dir` (OUT/races/<cell>/<race>/<label>/seed_K) repeats:
    a race's other arm at 1x is the 1x rung of the race that ladders that arm (when its ladder,
    `ladders[arm]`, has a 1x rung); a rung is the same rung of an earlier race laddering the same
    arm. None for any other run."""
    label, race = run_dir.parent.name, run_dir.parent.parent
    names = list(RACES)
    if race.name not in RACES:
        return None
    laddered, other = RACES[race.name]
    arm, at, multiple = label.rpartition("@") if "@" in label else (label, "", "")
    if not at and arm == other:
        for name, (first, _) in RACES.items():
            if first == other and name != race.name and 1.0 in ladders.get(other, []):
                return race.parent / name / f"{other}@1" / run_dir.name
        return None
    if at and arm == laddered:
        for name in names[: names.index(race.name)]:
            if RACES[name][0] == laddered:
                return race.parent / name / f"{laddered}@{multiple}" / run_dir.name
    return None


# the speed choices a run may leave to `auto`, as (section, key) and summary.json's name of it
CHOICES = {("train", "dtype"): "dtype", ("train", "attention"): "attention",
           ("train", "loss"): "loss", ("optim", "muon_dtype"): "muon_dtype"}  # fmt: skip


def _same_but_folder(saved: str, expected: str, chose: dict | None = None) -> bool:
    """Whether a run's saved config (to_toml's text, perhaps of an older gptrain: keys added
    since take their defaults) equals the expected one but for run.dir. A speed choice the saved
    run left to `auto` equals the expected value it chose (`chose`: its summary.json's
    speed_choices; a choice it records as None had no use in it, as muon_dtype without Muon):
    the run trained exactly as one given that value."""
    again = resolved_again(saved)
    if again is None:
        return False
    try:
        x, y = tomllib.loads(again), tomllib.loads(expected)
    except tomllib.TOMLDecodeError:
        return False
    for config in (x, y):
        config.get("run", {}).pop("dir", None)
    for (section, key), name in CHOICES.items():
        ran, want = x.get(section, {}), y.get(section, {})
        if ran.get(key) == "auto" and chose and name in chose and want.get(key) != "auto":
            if chose[name] in (None, want.get(key)):
                ran[key] = want.get(key)
    return x == y


def copy_finished(source: Path, dest: Path, expected: str) -> bool:
    """Copy the finished run `source` to `dest` when its config is `expected` (the config dest's
    run would train, run.dir = dest) but for run.dir, and dest does not exist. True if copied."""
    if dest.exists() or not (source / "summary.json").is_file():
        return False
    try:
        saved = (source / "config.toml").read_text()
        chose = json.loads((source / "summary.json").read_text()).get("speed_choices")
    except (OSError, ValueError):
        return False
    if not _same_but_folder(saved, expected, chose if isinstance(chose, dict) else None):
        return False
    part = dest.with_name(f".{dest.name}.copying")
    shutil.rmtree(part, ignore_errors=True)  # a copy cut short by a stop
    shutil.copytree(source, part, ignore=shutil.ignore_patterns(".lock*"))
    atomic_write_bytes(part / "config.toml", expected.encode())
    part.rename(dest)
    return True

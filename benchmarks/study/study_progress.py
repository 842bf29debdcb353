"""How much of the study is left: each run's share still to train, read from its folder.

    left = run_left(run_dir, steps)   # 0 when finished, 1 when not started, else the share to go

A run is finished when its summary.json exists; otherwise it resumes from its newest checkpoint
(`checkpoints/step_NNNNNNNN`), so the steps after that are still to train. `study.py plan`
multiplies each run's projected seconds by this share. A tuning counts as left until its
tune.json says it is complete.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

STEP = re.compile(r"step_(\d{8})")


def run_left(run_dir: Path, steps: int) -> float:
    """The share of a run of `steps` steps still to train (its newest checkpoint's steps done)."""
    if (run_dir / "summary.json").is_file():
        return 0.0
    saved = [int(m.group(1)) for p in (run_dir / "checkpoints").glob("step_*") if (m := STEP.fullmatch(p.name))]  # fmt: skip
    return 1.0 - min(max(saved, default=0), steps) / steps


def tuning_left(folder: Path) -> float:
    """1 until the tuning in `folder` is complete (its tune.json says so), then 0."""
    path = folder / "tune.json"
    try:
        return 0.0 if json.loads(path.read_text()).get("complete") else 1.0
    except (OSError, ValueError):
        return 1.0


def race_runs(folder: Path, ladder: list[float], arms: tuple[str, str], seeds: int):
    """(run folder, multiple of the cell's steps) of each run of one race in `folder`: the first
    arm on each rung of `ladder` and the second at 1x, seeds 1..`seeds`."""
    labels = [(f"{arms[0]}@{m:g}", m) for m in ladder] + [(arms[1], 1.0)]
    return [(folder / label / f"seed_{k}", m) for label, m in labels for k in range(1, seeds + 1)]

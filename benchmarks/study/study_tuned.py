"""A study's tuning, recorded: each corpus's and arm's best point of benchmarks/study/tune.py, as TOML.

    [prose.recipe]
    muon_lr = 0.0282842712474619
    lr = 0.013454342644059432
    decay_fraction = 0.2

    python benchmarks/study/study_tuned.py --out studies/main > tuned.toml   # from finished tunings

`study.py run --tuned FILE` races with these points instead of tuning again. The file is data:
it is parsed, never run, and each arm must name exactly its axes in benchmarks/study/tune.py, each a
finite number inside the axis's bounds.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tune  # noqa: E402
from study_cells import ARMS  # noqa: E402

from gptrain.errors import UserError, first_line  # noqa: E402


def points(path: Path, corpus: str, arms=ARMS) -> dict[str, dict[str, float]]:
    """Each of `arms`' recorded point on `corpus`; a UserError naming the fix when the record is
    bad or lacks one of them."""
    try:
        record = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise UserError(f"--tuned {path}: cannot read it ({e}); give a TOML record such as benchmarks/study/study_tuned.toml") from None  # fmt: skip
    table = record.get(corpus)
    if not isinstance(table, dict):
        raise UserError(f"--tuned {path}: no [{corpus}.*] tables; add the corpus's tuned points or tune it (--stages tune)")  # fmt: skip
    return {arm: _point(path, corpus, arm, table.get(arm)) for arm in arms}


def _point(path: Path, corpus: str, arm: str, given) -> dict[str, float]:
    where = f"--tuned {path}: [{corpus}.{arm}]"
    axes = {a.name: a for a in tune.ARMS[arm].axes}
    if not isinstance(given, dict):
        raise UserError(f"{where} is missing; give {', '.join(axes)}, tune the arm (leave out --tuned), or race without it (--arms)")  # fmt: skip
    if set(given) != set(axes):
        missing, unknown = sorted(set(axes) - set(given)), sorted(set(given) - set(axes))
        raise UserError(f"{where}: missing {missing or 'none'}, unknown {unknown or 'none'}; give exactly {', '.join(axes)}")  # fmt: skip
    point = {}
    for name, axis in axes.items():
        value = given[name]
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        ok = ok and math.isfinite(value) and axis.lo <= value <= axis.hi
        if ok and axis.choices:
            ok = value in axis.choices
        if not ok or (axis.scale == "log" and value <= 0):
            raise UserError(f"{where}: {name} = {value!r} is not a value of its axis; give a number inside its bounds")  # fmt: skip
        point[name] = float(value)
    return point


def finished(path: Path, corpus: str, arms=None) -> dict[str, dict[str, float]]:
    """Each of `arms`' best point (None: every arm it tuned) from a finished tuning's tune.json
    (benchmarks/study/tune.py)."""
    report = json.loads(path.read_text()) if path.is_file() else {}
    if not report.get("complete"):
        raise UserError(f"{path}: the tuning of {corpus} has not finished; run the tune stage first")  # fmt: skip
    if missing := [arm for arm in arms or () if arm not in report["arms"]]:
        raise UserError(f"{path}: the tuning of {corpus} has no {', '.join(missing)}; tune it in another --out, or race without it (--arms)")  # fmt: skip
    return {arm: report["arms"][arm]["best"]["point"] for arm in arms or report["arms"]}


def record(tunings: dict[str, Path]) -> str:
    """The TOML record of finished tunings (corpus -> its tune.json), every value exact."""
    out = []
    for corpus, path in tunings.items():
        for arm, point in finished(path, corpus).items():
            out.append(f"[{corpus}.{arm}]\n" + "".join(f"{k} = {v!r}\n" for k, v in point.items()))
    return "\n".join(out)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description="Print the TOML record of a study's finished tunings.")
    ap.add_argument("--out", type=Path, default=Path("studies/main"), help="the study's folder")
    ap.add_argument("--corpora", default="prose,code", help="comma-separated: prose, code")
    args = ap.parse_args(argv)
    tunings = {c: args.out / "tuning" / c / "tune.json" for c in args.corpora.split(",")}
    try:
        print(record(tunings), end="")
    except UserError as e:
        print(f"study_tuned: {first_line(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

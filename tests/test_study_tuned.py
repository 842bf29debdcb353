"""benchmarks/study/study_tuned.py: a study's tuning recorded as TOML, so that its races can be rerun
without tuning again. A record written from finished tunings gives back their points exactly; the
committed record holds values on tune.py's grid; a bad record is one line and exit code 2 before
anything runs."""

import json
import math
import sys
from pathlib import Path

import forked
import pytest
from train_helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks" / "study"))
import study_tuned  # noqa: E402
import tune  # noqa: E402
from study_cells import ARMS  # noqa: E402

from gptrain.errors import UserError  # noqa: E402

RECORD = REPO / "benchmarks" / "study" / "study_tuned.toml"
OLD = ("baseline", "recipe", "ablation")
# points as tune.py's search makes them: geometric midpoints of a grid (not round numbers)
POINTS = {
    "baseline": {
        "lr": math.sqrt(8e-3 * 0.016),
        "warmup_share": 0.175,
        "weight_decay": 0.0,
        "final_lr_ratio": 0.15,
        "beta2": tune.BETA2_KEPT,
        "embed_lr_factor": 2**-1.5,
    },  # fmt: skip
    "recipe": {
        "muon_lr": math.sqrt(0.02 * math.sqrt(0.02 * 0.04)),
        "lr": 8e-3 / 3,
        "decay_fraction": 0.1375,
    },  # fmt: skip
    "ablation": {
        "lr": math.sqrt(4e-3 * math.sqrt(4e-3 * 8e-3)),
        "decay_fraction": 0.3,
        "warmup_share": tune.WARMUP_START + 0.025,
        "embed_lr_factor": 2**0.5,
    },
    "nanochat": {
        "muon_lr": 0.02 * 2**0.25,
        "lr": 8e-3 / 3,
        "decay_fraction": 0.1375,
        "head_lr_factor": 2**-4.5,
    },  # fmt: skip
}
POINTS["nanochat_adamw"] = dict(
    POINTS["baseline"], lr=8e-3 * 2**0.75, beta2=0.95, head_lr_factor=2**-3
)


def finished_tuning(folder: Path, corpus: str, points: dict, complete=True) -> Path:
    path = folder / "tuning" / corpus / "tune.json"
    path.parent.mkdir(parents=True)
    arms = {arm: {"best": {"point": p, "loss": 4.0}, "trials": []} for arm, p in points.items()}
    path.write_text(json.dumps({"arms": arms, "complete": complete}))
    return path


def test_a_record_of_finished_tunings_gives_their_points_back_exactly(tmp_path):
    tunings = {c: finished_tuning(tmp_path, c, POINTS) for c in ("prose", "code")}
    path = tmp_path / "tuned.toml"
    path.write_text(study_tuned.record(tunings))
    for corpus in tunings:
        assert study_tuned.points(path, corpus) == POINTS  # == on floats: bit for bit


def test_the_committed_record_holds_its_arms_on_tune_pys_grid():
    """The record holds the three arms tuned then (the nanochat arms came later)."""
    for corpus in ("prose", "code"):
        points = study_tuned.points(RECORD, corpus, OLD)
        assert set(points) == set(OLD) and set(ARMS) > set(OLD)
        with pytest.raises(UserError, match=r"\[code.nanochat\] is missing.*--arms"):
            study_tuned.points(RECORD, "code")
        for arm, point in points.items():
            for axis in tune.ARMS[arm].axes:
                if axis.scale != "log":
                    continue
                # the search's values are the centre times 2^(k / 2^m): a rounded value is not
                steps = math.log(point[axis.name] / axis.center, axis.step) * 64
                assert steps == pytest.approx(round(steps), abs=1e-6), (corpus, arm, axis.name)


@pytest.mark.parametrize(
    "text, says",
    [
        ("not toml [", "cannot read it"),
        ("[code.baseline]\nlr = 0.01\n", "no [prose.*] tables"),
        (
            "[prose.recipe]\nmuon_lr = 0.02\nlr = 0.008\ndecay_fraction = 0.4\n",
            "[prose.baseline] is missing",
        ),  # fmt: skip
    ],
)
def test_a_record_without_the_corpus_or_an_arm_is_refused(tmp_path, text, says):
    path = tmp_path / "tuned.toml"
    path.write_text(text)
    with pytest.raises(UserError) as e:
        study_tuned.points(path, "prose")
    assert says in str(e.value)


@pytest.mark.parametrize(
    "arm, change, says",
    [
        ("baseline", {"lr": -0.01}, "lr = -0.01 is not a value"),
        ("baseline", {"lr": True}, "lr = True is not a value"),
        ("baseline", {"weight_decay": 0.05}, "weight_decay = 0.05 is not a value"),
        ("recipe", {"decay_fraction": 1.5}, "decay_fraction = 1.5 is not a value"),
        ("ablation", {"lr": "0.01"}, "lr = '0.01' is not a value"),
        ("ablation", {"momentum": 0.9}, "unknown ['momentum']"),
    ],
)
def test_a_value_off_its_axis_or_an_unknown_key_is_refused(tmp_path, arm, change, says):
    points = {a: dict(p) for a, p in POINTS.items()}
    points[arm].update(change)
    lines = [f"[prose.{a}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in p.items()) for a, p in points.items()]  # fmt: skip
    path = tmp_path / "tuned.toml"
    path.write_text("\n".join(lines))
    with pytest.raises(UserError) as e:
        study_tuned.points(path, "prose")
    assert f"[prose.{arm}]" in str(e.value) and says in str(e.value)


@pytest.mark.parametrize("stages", [[], ["--stages", "data,race"]])
def test_study_run_with_a_bad_record_stops_with_one_line_before_anything_runs(tmp_path, stages):
    path = tmp_path / "tuned.toml"
    path.write_text("[prose.baseline]\nlr = 0.01\n")
    out = tmp_path / "study"
    cmd = [sys.executable, str(REPO / "benchmarks/study/study.py"), "run", "--corpora", "prose"]
    cmd += ["--tuned", str(path), "--out", str(out), "--data", str(tmp_path / "data"), *stages]
    done = forked.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert (
        done.stderr.strip().splitlines()
        == [
            f"study: --tuned {path}: [prose.baseline]: missing ['beta2', 'embed_lr_factor', 'final_lr_ratio', 'warmup_share', 'weight_decay'], unknown none; give exactly lr, warmup_share, weight_decay, final_lr_ratio, beta2, embed_lr_factor",  # fmt: skip
        ]
    )
    assert not out.exists() and not (tmp_path / "data").exists()


def test_recording_an_unfinished_tuning_is_refused(tmp_path):
    finished_tuning(tmp_path, "prose", POINTS, complete=False)
    cmd = [sys.executable, str(REPO / "benchmarks/study/study_tuned.py"), "--out", str(tmp_path)]
    done = forked.run(cmd + ["--corpora", "prose"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert (
        done.stderr.strip().splitlines()
        == [
            f"study_tuned: {tmp_path}/tuning/prose/tune.json: the tuning of prose has not finished; run the tune stage first"  # fmt: skip
        ]
    )

"""benchmarks/study/study_reuse.py: the recipe race's baseline runs are copies of the baseline ladder's
finished 1x runs. A copy is a finished run in its own folder (gptrain train there says already
trained, as in the source), and nothing else is ever copied or overwritten."""

import json
import sys

import pytest
from train_helpers import DEBUG, REPO

from gptrain.__main__ import main as cli
from gptrain.config.load import load_config, to_toml

sys.path.insert(0, str(REPO / "benchmarks" / "study"))
import study_reuse  # noqa: E402

FAST = ["log.progress=false", "log.plot=false", "train.max_steps=4", "eval.every=2", "eval.tokens=1024"]  # fmt: skip
FAST += ["eval.sample_every=0", "checkpoint.every=2", "optim.warmup_steps=1"]


LADDERS = {"baseline": [0.5, 1.0, 2.0], "recipe": [0.125, 0.25, 0.5, 1.0]}
LADDERS["nanochat"] = LADDERS["recipe"]


def test_the_twin_of_a_recipe_race_baseline_run_is_the_ladders_1x_run(tmp_path):
    cell = tmp_path / "races" / "code-small-4x"
    run = cell / "recipe-ladder" / "baseline" / "seed_2"
    assert study_reuse.twin(run, LADDERS) == cell / "baseline-ladder/baseline@1/seed_2"
    no_1x = dict(LADDERS, baseline=[0.5, 2.0])
    assert study_reuse.twin(run, no_1x) is None  # no 1x rung: nothing to copy
    assert study_reuse.twin(cell / "recipe-ladder" / "recipe@1" / "seed_2", LADDERS) is None
    assert study_reuse.twin(cell / "baseline-ladder" / "baseline" / "seed_2", LADDERS) is None
    assert study_reuse.twin(cell / "baseline-ladder" / "ablation" / "seed_2", LADDERS) is None


def test_the_block_races_repeat_the_recipe_ladders_1x_and_the_baseline_ladders_rungs(tmp_path):
    """nanochat's race has the recipe at 1x (the recipe ladder's 1x run); nanochat_adamw's race
    on the baseline's ladder has every rung of the baseline ladder's race; its own arm, and
    nanochat's rungs, are trained."""
    cell = tmp_path / "races" / "prose-large-1x"
    nano, adamw = cell / "nanochat-ladder", cell / "nanochat_adamw-on-baseline-ladder"
    assert study_reuse.twin(nano / "recipe" / "seed_3", LADDERS) == cell / "recipe-ladder/recipe@1/seed_3"  # fmt: skip
    assert study_reuse.twin(nano / "nanochat@0.5" / "seed_3", LADDERS) is None
    for m in ("0.5", "1", "2"):
        want = cell / "baseline-ladder" / f"baseline@{m}" / "seed_1"
        assert study_reuse.twin(adamw / f"baseline@{m}" / "seed_1", LADDERS) == want
    assert study_reuse.twin(adamw / "nanochat_adamw" / "seed_1", LADDERS) is None
    assert study_reuse.twin(cell / "elsewhere" / "baseline@1" / "seed_1", LADDERS) is None


def config_text(byte_data, run_dir, *more) -> str:
    overrides = [f"data.dir={byte_data}", f"run.dir={run_dir}", "train.seed=2", *FAST, *more]
    return to_toml(load_config(DEBUG, overrides))


def train(byte_data, run_dir, capsys, *more) -> str:
    config = run_dir.parent / f"{run_dir.name}.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(config_text(byte_data, run_dir, *more))
    capsys.readouterr()
    assert cli(["train", "--config", str(config)]) == 0
    return capsys.readouterr().out


@pytest.fixture
def ladder_run(byte_data, tmp_path, capsys):
    source = tmp_path / "baseline-ladder" / "baseline@1" / "seed_2"
    train(byte_data, source, capsys)
    return source


def test_a_finished_run_is_copied_and_trains_no_further_in_its_new_folder(
    ladder_run, byte_data, tmp_path, capsys
):
    dest = tmp_path / "recipe-ladder" / "baseline" / "seed_2"
    (dest.parent / ".seed_2.copying").mkdir(parents=True)  # a copy cut short by a stop
    (ladder_run / ".lock").write_text("stale")
    assert study_reuse.copy_finished(ladder_run, dest, config_text(byte_data, dest))
    assert not (dest.parent / ".seed_2.copying").exists() and not (dest / ".lock").exists()
    assert (dest / "config.toml").read_text() == config_text(byte_data, dest)
    out = train(byte_data, dest, capsys)  # the race's own start of this run, were it started
    assert "already trained to step 4" in out
    rows = [json.loads(line) for line in (dest / "metrics.jsonl").read_text().splitlines()]
    source = [json.loads(line) for line in (ladder_run / "metrics.jsonl").read_text().splitlines()]
    assert rows == source and rows[-1]["step"] == 4 and "val_loss" in rows[-1]


def test_only_a_finished_run_of_the_same_config_into_a_new_folder_is_copied(
    ladder_run, byte_data, tmp_path
):
    dest = tmp_path / "recipe-ladder" / "baseline" / "seed_2"
    other = config_text(byte_data, dest, "optim.lr=1e-3")
    assert not study_reuse.copy_finished(ladder_run, dest, other)  # another config
    assert not dest.exists()
    dest.mkdir(parents=True)
    (dest / "train.log").write_text("its own")
    assert not study_reuse.copy_finished(ladder_run, dest, config_text(byte_data, dest))
    assert [p.name for p in dest.iterdir()] == ["train.log"]  # an existing folder: untouched
    (ladder_run / "summary.json").unlink()  # unfinished (killed before its summary)
    fresh = tmp_path / "recipe-ladder" / "baseline" / "seed_3"
    assert not study_reuse.copy_finished(ladder_run, fresh, config_text(byte_data, fresh))
    assert not fresh.exists()


def test_a_run_that_left_a_speed_choice_to_auto_is_the_run_pinned_to_what_it_chose(
    byte_data, tmp_path, capsys
):
    """A kept run trained with train.dtype, attention and loss = auto is copied where the study
    now pins them to the values it chose, and only there: a run given those values trains the
    same losses, bit for bit; pinned to another dtype, it is not copied."""
    auto = ["train.dtype=auto", "train.attention=auto", "train.loss=auto"]
    source = tmp_path / "kept" / "seed_2"
    train(byte_data, source, capsys, *auto)
    chose = json.loads((source / "summary.json").read_text())["speed_choices"]
    pinned = [f"train.{k}={chose[k]}" for k in ("dtype", "attention", "loss")]
    again = tmp_path / "pinned" / "seed_2"
    train(byte_data, again, capsys, *pinned)
    losses = [
        [json.loads(line).get("loss") for line in (d / "metrics.jsonl").read_text().splitlines()]
        for d in (source, again)
    ]
    assert losses[0] == losses[1]
    other = "float32" if chose["dtype"] != "float32" else "bfloat16"
    dest = tmp_path / "copy" / "seed_2"
    wrong = [o for o in pinned if not o.startswith("train.dtype=")] + [f"train.dtype={other}"]
    assert not study_reuse.copy_finished(source, dest, config_text(byte_data, dest, *wrong))
    assert study_reuse.copy_finished(source, dest, config_text(byte_data, dest, *pinned))
    assert "already trained to step 4" in train(byte_data, dest, capsys, *pinned)


def test_a_cells_later_races_copy_exactly_the_runs_their_plans_repeat(tmp_path):
    """The cell's configs as study.py writes them; each race planned by gptrain race itself
    (race_plan.plan: the texts its runs train from); the earlier races' runs finished with the
    config.toml gptrain train writes. study.py copies into the later races exactly the runs
    that repeat one, each with the config that race's own run would have written."""
    import study
    from study_cells import cells

    from gptrain.commands.race_plan import parse_args, plan

    args = study.parse_args(["run", "--corpora", "code", "--seeds", "2", "--out", str(tmp_path)])
    cell = cells(["code"], ("small-1x",))[0]
    centers = {arm: {a.name: a.center for a in study.tune.ARMS[arm].axes} for arm in args.arms}
    paths = study.cell_configs(args, cell, centers)
    folder = tmp_path / "races" / cell.name

    def runs(name, ladder, arms, finish):
        out = folder / name
        argv = ["--config", str(paths[arms[0]]), "--config", str(paths[arms[1]])]
        p = plan(parse_args([*argv, "--ladder", ladder, "--seeds", "2", "--out", str(out)], ""))
        want = {}
        for label, text in p.texts.items():
            (out / label).mkdir(parents=True, exist_ok=True)
            (out / label / "config.toml").write_text(text)
            for k in (1, 2):
                run_dir = out / label / f"seed_{k}"
                o = [f"train.seed={k}", f"run.dir={run_dir}"]
                want[run_dir] = to_toml(load_config(str(out / label / "config.toml"), o))
                if finish:
                    run_dir.mkdir()
                    (run_dir / "config.toml").write_text(want[run_dir])
                    (run_dir / "summary.json").write_text("{}")
        return want

    runs("baseline-ladder", "0.5,1,2", ("baseline", "ablation"), True)
    runs("recipe-ladder", "0.125,0.25,0.5,1", ("recipe", "baseline"), True)
    for name, ladder, arms, copied in (
        ("nanochat-ladder", "0.125,0.25,0.5,1", ("nanochat", "recipe"), ["recipe"]),
        (
            "nanochat_adamw-on-baseline-ladder",
            "0.5,1,2",
            ("baseline", "nanochat_adamw"),
            ["baseline@0.5", "baseline@1", "baseline@2"],
        ),  # fmt: skip
    ):
        want = runs(name, ladder, arms, False)
        study.copy_twins(args, folder / name, ladder, arms, paths)
        made = {d for d in want if d.is_dir()}
        assert made == {d for d in want if d.parent.name in copied}
        for d in made:
            assert (d / "config.toml").read_text() == want[d]

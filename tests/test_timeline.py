"""`checkpoint.resume = STEP` acts once (gptrain/checkpoint/retention.py): it starts a new timeline,
which `resume = auto` never leaves for the checkpoints it abandoned, locally or on the mirror, and
which the same command requeued continues instead of going back to STEP. Bad input (a step with
no checkpoint, a mirror whose history contradicts the local one) is one line, exit 2, and nothing
written or deleted."""

import dataclasses
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import forked
import pytest
import torch
from train_helpers import DEBUG, REPO, run, weights

from gptrain.__main__ import main as cli
from gptrain.checkpoint import folder, mirror, retention
from gptrain.checkpoint import manager as checkpoint
from gptrain.config.identity import NOT_TRAINING, training_identity
from gptrain.config.load import Config, key_name, to_toml
from gptrain.config.model import NANOCHAT_ONLY
from gptrain.distributed import faults

COMMON = ["train.max_steps=12", "checkpoint.every=2", "checkpoint.keep_last=10"]
COMMON += ["eval.every=0", "eval.sample_every=0", "eval.tokens=512", "eval.sample_tokens=1"]
COMMON += ["optim.warmup_steps=1", "log.every=1", "model.dropout=0.1"]
BRANCH = ["checkpoint.resume=6", "optim.lr=1e-3"]  # back to step 6 with another learning rate
# a requeue on other nodes, with other logging and retention: keys that cannot change training
REQUEUE = ["dist.rdzv_endpoint=node7:29500", "dist.rdzv_id=4242", "log.every=2"]
REQUEUE += ["checkpoint.keep_last=9", "checkpoint.every=4"]


@pytest.fixture(autouse=True)
def no_mirror_left():
    yield
    mirror._mirror = None


def start(byte_data, run_dir, *overrides, fault=""):
    """`gptrain train` in its own process (a `crash` fault ends it); (exit code, stdout + err)."""
    cmd = [sys.executable, "-m", "gptrain", "train", "--config", DEBUG, f"--data.dir={byte_data}"]
    cmd += [f"--run.dir={run_dir}", "--log.progress=false", "--log.plot=false", *(f"--{o}" for o in overrides)]  # fmt: skip
    env = {**os.environ, faults.ENV: fault, "PYTHONPATH": str(REPO)}
    p = forked.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout + p.stderr


def cli_train(byte_data, run_dir, *overrides) -> int:
    """`gptrain train` in this process (its one-line errors on stderr)."""
    args = ["train", "--config", DEBUG, f"--data.dir={byte_data}", f"--run.dir={run_dir}"]
    return cli([*args, "--log.progress=false", "--log.plot=false", *(f"--{o}" for o in overrides)])


def same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def contents(folder) -> dict:
    """{relative path: sha256} of every file under `folder`."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def trained(byte_data, tmp_path_factory):
    """A run to step 12 (checkpoints 2, 4, ..., 12), and the reference: a copy of it resumed
    from step 6 with optim.lr = 1e-3, uninterrupted, to step 12."""
    root = tmp_path_factory.mktemp("timeline")
    run(byte_data, root / "a", *COMMON)
    shutil.copytree(root / "a", root / "ref")
    run(byte_data, root / "ref", *COMMON, *BRANCH)
    return root / "a", weights(root / "ref")


def test_resume_step_starts_a_timeline_that_auto_and_requeues_continue(
    trained, byte_data, tmp_path
):
    """The user's path: to step 12, then --checkpoint.resume=6 --optim.lr=1e-3, killed at step 8
    before its first new checkpoint; the requeued job with resume = auto continues from step 6
    (not the old step 12), is killed at step 10 after saving step 8; the branch's own command
    requeued (on other nodes, with other logging and retention, its data staged to another
    folder) continues from step 8 with one line saying so. The end equals the uninterrupted branch bit for bit."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained[0], run_dir)
    code, out = start(byte_data, run_dir, *COMMON, *BRANCH, fault="crash@8")
    assert code == 1, out[-3000:]
    assert "checkpoint.resume = 6: a new timeline starts from step_00000006" in out
    assert "step_00000008, step_00000010, step_00000012" in out
    assert checkpoint.latest(run_dir).name == "step_00000006"
    timeline = json.loads((run_dir / "checkpoints" / "timeline.json").read_text())
    assert timeline["from_step"] == 6 and timeline["ancestors"][-1]["until"] == 6
    code, out = start(byte_data, run_dir, *COMMON, "optim.lr=1e-3", fault="crash@10")
    assert code == 1 and f"resumed from {run_dir / 'checkpoints' / 'step_00000006'}" in out, out
    meta = checkpoint.load_meta(checkpoint.find(run_dir, 8))
    assert meta["timeline"] == timeline and meta["parent_step"] == 6
    staged = tmp_path / "staged"  # the requeued job reads the same data from another folder
    shutil.copytree(byte_data, staged)
    code, out = start(staged, run_dir, *COMMON, *BRANCH, *REQUEUE)
    assert code == 0, out[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000008'}" in out, out
    line = "checkpoint.resume = 6 already started this timeline with the same training config (the keys that differ cannot change training): continuing it from step_00000008, not going back to step 6"
    assert line in out
    same(trained[1], weights(run_dir))


def test_a_step_with_no_checkpoint_is_one_line_and_nothing_is_written(
    trained, byte_data, tmp_path, capsys
):
    run_dir = tmp_path / "run"
    shutil.copytree(trained[0], run_dir)
    before = contents(run_dir)
    capsys.readouterr()
    assert cli_train(byte_data, run_dir, *COMMON, "checkpoint.resume=7") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint.resume = 7: no checkpoint of step 7" in err[0], err
    assert "(steps there: 2, 4, 6, 8, 10, 12)" in err[0]
    assert contents(run_dir) == before


def test_the_mirror_never_offers_an_abandoned_timeline(trained, byte_data, tmp_path, capsys):
    """The same path with checkpoint.mirror and the local run directory lost after the crash at
    step 8: the mirror still has the old steps 8-12 (its `latest` names step 12), but resume =
    auto fetches step 6, the new timeline's start, and ends equal to the uninterrupted branch.
    A mirror whose timeline neither continues nor precedes the local one is one line, exit 2,
    and nothing is written or deleted on either side."""
    run_dir, url = tmp_path / "run", f"file://{tmp_path / 'mirror'}"
    shutil.copytree(trained[0], run_dir)
    remote = tmp_path / "mirror" / "checkpoints"
    for name in ("step_00000006", "step_00000012"):  # the verified copies of the first timeline
        shutil.copytree(run_dir / "checkpoints" / name, remote / name)
    (remote / "latest").write_text("step_00000012\n")
    mirrored = [*COMMON, f"checkpoint.mirror={url}"]
    code, out = start(byte_data, run_dir, *mirrored, *BRANCH, fault="crash@8")
    assert code == 1, out[-3000:]
    shutil.rmtree(run_dir)  # the node is gone
    code, out = start(byte_data, run_dir, *mirrored, "optim.lr=1e-3")
    assert code == 0, out[-3000:]
    assert f"resumed from the mirror's copy {url}/checkpoints/step_00000006" in out, out
    same(trained[1], weights(run_dir))
    # another timeline on the mirror, unrelated to the local one
    other = {"id": "another-run", "from_step": 4, "command": "x", "ancestors": []}
    (remote / "timeline.json").write_text(json.dumps(other))
    here, there = contents(run_dir), contents(tmp_path / "mirror")
    capsys.readouterr()
    assert cli_train(byte_data, run_dir, *mirrored) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "its history contradicts" in err[0] and "another-run" in err[0], err
    assert contents(run_dir) == here and contents(tmp_path / "mirror") == there


# --- the timeline's identity: keys that cannot change training may differ on a requeue ---------


def toml(**sections) -> str:
    """The resolved config text of the defaults with some keys replaced: toml(optim={"lr": 2e-3})."""
    cfg = Config()
    for name, values in sections.items():
        section = dataclasses.replace(getattr(cfg, name), **values)
        cfg = dataclasses.replace(cfg, **{name: section})
    return to_toml(cfg)


def changed(value):
    """Another value of the same type."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value * 2 + 1
    return value + "x"


def test_only_the_listed_keys_leave_the_training_identity():
    """Each key of every section, changed on its own: the identity changes exactly when the key
    is not listed in NOT_TRAINING (by itself or by its section); every listed name exists."""
    cfg, base = Config(), training_identity(toml())
    keys = {}
    for f in dataclasses.fields(cfg):
        for g in dataclasses.fields(getattr(cfg, f.name)):
            keys[f"{f.name}.{key_name(g.name)}"] = (f.name, g.name)
    assert set(NOT_TRAINING) <= set(keys) | {f.name for f in dataclasses.fields(cfg)}
    moved = []
    for key, (section, field) in keys.items():
        value = changed(getattr(getattr(cfg, section), field))
        # a key of the other block than the default's changes the identity of that block's runs
        arch = {"arch": "nanochat"} if section == "model" and field in NANOCHAT_ONLY else {}
        same = training_identity(toml(**{section: {**arch, field: value}}))
        if (same == training_identity(toml(model=arch))) != (
            key in NOT_TRAINING or section in NOT_TRAINING
        ):
            moved.append(key)
    assert not moved
    # spot checks against the list's purpose
    assert training_identity(toml(dist={"rdzv_endpoint": "node7:29500", "nnodes": 2})) == base
    assert training_identity(toml(optim={"lr": 2e-3})) != base
    assert training_identity(toml(train={"seed": 1})) != base


def test_a_requeue_differing_only_in_keys_that_cannot_change_training_continues(tmp_path):
    """A timeline started by resume = 6 (on nodes behind node1:29500) with step 8 saved: the
    same command on other nodes, with another node count and micro-batch, other logging and
    checkpoint cadence, continues it from step 8; the same command with another learning rate
    starts a new timeline from step 6, and says that the earlier one had other settings."""
    for step in (2, 4, 6):
        fake_checkpoint(tmp_path, step)
    branch = {"checkpoint": {"resume": "6"}, "optim": {"lr": 2e-3}}
    first = toml(**branch, dist={"rdzv_endpoint": "node1:29500", "nnodes": 2})
    plan = retention.plan(tmp_path, "6", first)
    assert plan.branch
    retention.begin(tmp_path, plan)
    fake_checkpoint(tmp_path, 8)
    requeue = {"rdzv_endpoint": "node7:29500", "rdzv_id": "job2", "nnodes": 4}
    other_nodes = toml(
        optim={"lr": 2e-3},
        dist=requeue,
        train={"micro_batch_size": 4},
        log={"every": 1},
        eval={"every": 3},
        checkpoint={"resume": "6", "every": 5, "keep_last": 2},
    )
    again = retention.plan(tmp_path, "6", other_nodes)
    assert not again.branch and again.path.name == "step_00000008"
    assert again.timeline == plan.timeline
    assert (
        again.line
        == "checkpoint.resume = 6 already started this timeline with the same training config (the keys that differ cannot change training): continuing it from step_00000008, not going back to step 6 (a run with other training settings branches from step 6 again)"
    )
    same_text = retention.plan(tmp_path, "6", first)
    assert "with the same config: continuing it from step_00000008" in same_text.line
    other_lr = toml(checkpoint={"resume": "6"}, optim={"lr": 3e-3}, dist=requeue)
    new = retention.plan(tmp_path, "6", other_lr)
    assert new.branch and new.path.name == "step_00000006"
    assert (
        new.line
        == "checkpoint.resume = 6: a new timeline starts from step_00000006 (the timeline step 6 started before has other training settings: it is left as well); the checkpoints after it (step_00000008) stay on the timeline it leaves: resume = auto will not return to them; requeued, the same command continues the new timeline"
    )


def test_a_timeline_recorded_before_a_training_key_existed_continues_at_its_default(tmp_path):
    """A timeline started by resume = 6 under a gptrain without model.bias (its record lacks the
    key), step 8 saved: this gptrain's same command, bias at its default, continues it; with
    bias changed it branches from step 6. A record that keeps only the hash (an older format)
    is compared by the hash: the same text continues, the text with the new key branches."""
    for step in (2, 4, 6):
        fake_checkpoint(tmp_path, step)
    branch = {"checkpoint": {"resume": "6"}, "optim": {"lr": 2e-3}}
    now = toml(**branch)
    assert "bias = true" in now  # the default, written by to_toml
    older = now.replace("bias = true\n", "", 1)
    plan = retention.plan(tmp_path, "6", older)
    assert plan.branch and "bias" not in plan.timeline["keys"]["model"]
    retention.begin(tmp_path, plan)
    fake_checkpoint(tmp_path, 8)
    again = retention.plan(tmp_path, "6", now)
    assert not again.branch and again.path.name == "step_00000008"
    assert again.timeline == plan.timeline
    other = retention.plan(tmp_path, "6", toml(**branch, model={"bias": False}))
    assert other.branch and other.path.name == "step_00000006"

    record = json.loads((tmp_path / "checkpoints" / folder.TIMELINE).read_text())
    del record["keys"]  # as a gptrain that kept only the hashes wrote it
    (tmp_path / "checkpoints" / folder.TIMELINE).write_text(json.dumps(record))
    assert not retention.plan(tmp_path, "6", older).branch
    assert retention.plan(tmp_path, "6", now).branch


def fake_checkpoint(run_dir, step: int, layout: str = "") -> Path:
    """A checkpoint folder of `step` on the run's timeline, valid for retention.problem (hashed
    files, meta.json with the timeline, as a save writes it), named in `latest`. layout "dcp":
    the file set of an FSDP2 (DCP) checkpoint."""
    root = Path(run_dir) / "checkpoints"
    path = root / f"step_{step:08d}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    names = (
        [".metadata", "__0_0.distcp", "state.pt"] if layout else ["model.safetensors", "state.pt"]
    )
    for name in names:
        (path / name).write_bytes(f"{name} of step {step}".encode())
    files = {n: {"bytes": (path / n).stat().st_size} for n in names}
    for n in names:
        files[n]["sha256"] = hashlib.sha256((path / n).read_bytes()).hexdigest()
    meta = {"step": step, "files": files, **folder.timeline_keys(root)}
    (path / "meta.json").write_text(json.dumps(meta | ({"layout": "dcp"} if layout else {})))
    folder.point_latest(root, path.name)
    return path


def steps_in(root) -> set[int]:
    return {int(p.name[5:]) for p in Path(root).glob("step_*")}


def saves_with_a_branch(run_dir, layout="", upload=lambda path: None, begin=lambda plan: None):
    """Save every 3 steps to step 9 (keep_last = 3); then checkpoint.resume = 3 and save every 5
    steps to step 10. After each save: retention, `upload` (the mirror's), and after the resume's
    start `begin` (the mirror's record of the timeline). Returns {step: folders kept} after each
    save of the branch."""
    after = {}
    plan = retention.plan(run_dir, "auto", toml())
    retention.begin(run_dir, plan)
    begin(plan)
    for step in (3, 6, 9):
        upload(fake_checkpoint(run_dir, step, layout))
        retention.prune(run_dir, step, 3, 0)
    plan = retention.plan(run_dir, "3", toml(checkpoint={"every": 5, "resume": "3"}))
    assert plan.branch and plan.path.name == "step_00000003"
    retention.begin(run_dir, plan)
    begin(plan)
    for step in (5, 10):
        path = fake_checkpoint(run_dir, step, layout)
        retention.prune(run_dir, step, 3, 0)
        upload(path)
        after[step] = steps_in(Path(run_dir) / "checkpoints")
    return after


@pytest.mark.parametrize("layout", ["", "dcp"])
def test_abandoned_checkpoints_never_count_toward_keep_last(tmp_path, layout):
    """The abandoned 6 and 9 fill the slot the new timeline leaves free after its step 5, and go
    once it has keep_last of its own: {3, 5, 10} stay, so with step 10 damaged resume falls back
    to step 5 (counted together, {6, 9, 10} would stay and no checkpoint of the run could be
    resumed)."""
    after = saves_with_a_branch(tmp_path, layout)
    assert after == {5: {3, 5, 9}, 10: {3, 5, 10}}
    damaged = tmp_path / "checkpoints" / "step_00000010" / "state.pt"
    damaged.write_bytes(b"x" + damaged.read_bytes()[1:])
    path, warnings = retention.resume_point(tmp_path, "auto")
    assert path.name == "step_00000005"
    assert warnings == [
        f"skipped checkpoint {damaged.parent}: state.pt is damaged ({damaged.stat().st_size} bytes, meta.json recorded {damaged.stat().st_size}; its sha256 differs)"
    ]


def test_retention_keeps_milestones_of_any_timeline(tmp_path):
    """Checkpoints 2, 6, 9, 10 of an older gptrain (no timeline recorded), a branch from 2 that
    saves step 4, keep_last = 1, keep_every = 3: the abandoned milestones 6 and 9 stay, the
    abandoned 10 goes (the branch fills keep_last), and so does 2."""
    for step in (2, 6, 9, 10):
        fake_checkpoint(tmp_path, step)
    retention.begin(tmp_path, retention.plan(tmp_path, "2", toml()))
    fake_checkpoint(tmp_path, 4)
    assert retention.prune(tmp_path, 4, 1, 3) == ["step_00000002", "step_00000010"]
    assert steps_in(tmp_path / "checkpoints") == {4, 6, 9}


def test_a_damaged_newest_checkpoint_after_a_branch_falls_back_on_the_branch(byte_data, tmp_path):
    """Saves every 3 steps to step 9, then checkpoint.resume = 3 saving every 5 steps to step
    10, keep_last = 3 and a mirror: both places keep {3, 5, 10} (the abandoned 6 and 9 do not
    count). With step 10 damaged in both, the same command resumes from step 5 and ends equal
    to the undamaged step 10 bit for bit."""
    run_dir, url = tmp_path / "run", f"file://{tmp_path / 'mirror'}"
    quick = [*COMMON[1:], "checkpoint.keep_last=3", f"checkpoint.mirror={url}"]
    run(byte_data, run_dir, *quick, "train.max_steps=9", "checkpoint.every=3")
    branch = [*quick, "train.max_steps=10", "checkpoint.every=5", "checkpoint.resume=3"]
    run(byte_data, run_dir, *branch)
    assert steps_in(run_dir / "checkpoints") == {3, 5, 10}
    assert steps_in(tmp_path / "mirror" / "checkpoints") == {3, 5, 10}
    want = {k: v.clone() for k, v in weights(run_dir).items()}  # not mapped to the file damaged
    for root in (run_dir, tmp_path / "mirror"):
        path = root / "checkpoints" / "step_00000010" / "model.safetensors"
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 1
        path.write_bytes(bytes(data))
    run(byte_data, run_dir, *branch)
    log = (run_dir / "train.log").read_text()
    assert "skipped checkpoint" in log and "step_00000010: model.safetensors is damaged" in log
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000005'}" in log
    same(want, weights(run_dir))

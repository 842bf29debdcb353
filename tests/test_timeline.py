"""`checkpoint.resume = STEP` acts once (gptrain/checkpoint/retention.py): it starts a new timeline,
which `resume = auto` never leaves for the checkpoints it abandoned, locally or on the mirror, and
which the same command requeued continues instead of going back to STEP. Bad input (a step with
no checkpoint, a mirror whose history contradicts the local one) is one line, exit 2, and nothing
written or deleted."""

import hashlib
import json
import os
import shutil
import sys

import forked
import pytest
import torch
from train_helpers import DEBUG, REPO, run, weights

from gptrain.__main__ import main as cli
from gptrain.checkpoint import manager as checkpoint
from gptrain.checkpoint import mirror
from gptrain.distributed import faults

COMMON = ["train.max_steps=12", "checkpoint.every=2", "checkpoint.keep_last=10"]
COMMON += ["eval.every=0", "eval.sample_every=0", "eval.tokens=512", "eval.sample_tokens=1"]
COMMON += ["optim.warmup_steps=1", "log.every=1", "model.dropout=0.1"]
BRANCH = ["checkpoint.resume=6", "optim.lr=1e-3"]  # back to step 6 with another learning rate


@pytest.fixture(autouse=True)
def no_mirror_left():
    yield
    mirror._mirror = None


def start(byte_data, run_dir, *overrides, fault=""):
    """`gptrain train` in its own process (a `crash` fault ends it); (exit code, stdout + err)."""
    cmd = [sys.executable, "-m", "gptrain", "train", "--config", DEBUG, f"--data.dir={byte_data}"]
    cmd += [f"--run.dir={run_dir}", "--log.progress=false", *(f"--{o}" for o in overrides)]
    env = {**os.environ, faults.ENV: fault, "PYTHONPATH": str(REPO)}
    p = forked.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout + p.stderr


def cli_train(byte_data, run_dir, *overrides) -> int:
    """`gptrain train` in this process (its one-line errors on stderr)."""
    args = ["train", "--config", DEBUG, f"--data.dir={byte_data}", f"--run.dir={run_dir}"]
    return cli([*args, "--log.progress=false", *(f"--{o}" for o in overrides)])


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
    requeued continues from step 8 with one line saying so. The end equals the uninterrupted
    branch bit for bit."""
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
    code, out = start(byte_data, run_dir, *COMMON, *BRANCH)
    assert code == 0, out[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000008'}" in out, out
    line = "checkpoint.resume = 6 already started this timeline with the same config: continuing it from step_00000008, not going back to step 6"
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

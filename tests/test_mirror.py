"""Off-node checkpoints (checkpoint.mirror, gptrain/checkpoint/mirror.py), against file:// and a
local S3-compatible server (moto, on 127.0.0.1 only; skipped without moto and s3fs): an upload cut
short, one bit flipped in the remote copy, the local run directory deleted. Each time the rerun
resumes from the newest valid copy and ends equal to the uninterrupted run bit for bit."""

import shutil
import subprocess
import sys
import time

import pytest
import torch
from train_helpers import DEBUG, run, weights

from gptrain.__main__ import main as cli
from gptrain.checkpoint import mirror

QUICK = ["eval.every=0", "eval.sample_every=0", "eval.tokens=512", "eval.sample_tokens=1"]
QUICK += ["optim.warmup_steps=1", "optim.min_lr=3e-3", "optim.lr=3e-3", "log.every=1"]
QUICK += ["model.dropout=0.1", "checkpoint.every=4"]


@pytest.fixture(autouse=True)
def no_mirror_left():
    yield
    mirror._mirror = None


@pytest.fixture(scope="module")
def reference(byte_data, tmp_path_factory):
    """The uninterrupted run to step 12 (a constant learning rate: the runs below that stop at 8
    and continue to 12 follow the same schedule)."""
    d = tmp_path_factory.mktemp("ref") / "run"
    run(byte_data, d, "train.max_steps=12", *QUICK)
    return weights(d)


def same(a, b):
    for k in a:
        assert torch.equal(a[k], b[k]), k


def flip_a_bit(data: bytes) -> bytes:
    b = bytearray(data)
    b[len(b) // 2] ^= 0x01
    return bytes(b)


def scenario(byte_data, tmp_path, url, monkeypatch, how, fs):
    """A mirrored run to step 8 (checkpoints 4 and 8), then `how`, the local run directory
    deleted, and the same command to step 12. Returns (run dir, train.log)."""
    run_dir = tmp_path / "run"
    keep = 2 if how == "flip" else 1  # flip: step 4 is there to fall back on
    opts = ["train.max_steps=8", *QUICK, f"checkpoint.mirror={url}", f"checkpoint.keep_last={keep}"]
    put = mirror.Mirror._put
    with pytest.MonkeyPatch.context() as mp:  # cut: the upload of step 8 stops after one file

        def cut(self, local, remote):
            if "step_00000008" in remote and not remote.endswith("meta.json"):
                if getattr(self, "cut_done", False):
                    raise OSError("killed (simulated)")
                self.cut_done = True
            put(self, local, remote)

        if how == "cut":
            mp.setattr(mirror.Mirror, "_put", cut)
        run(byte_data, run_dir, *opts)
    m = mirror.Mirror(url)
    if how == "cut":
        assert m.latest() == "step_00000004" and m.problem("step_00000008") is not None
        assert m.steps() == [8, 4]  # retention (keep_last = 1) kept the last verified copy
    else:
        assert m.latest() == "step_00000008" and m.steps() == ([8, 4] if keep == 2 else [8])
        assert m.problem("step_00000008") is None
    if how == "flip":
        path = f"{m.root}/step_00000008/state.pt"
        fs.pipe(path, flip_a_bit(fs.cat_file(path)))
        assert "state.pt is damaged" in m.problem("step_00000008")
    shutil.rmtree(run_dir)
    opts[0] = "train.max_steps=12"
    run(byte_data, run_dir, *opts)
    return run_dir, (run_dir / "train.log").read_text()


@pytest.mark.parametrize("how", ["gone", "flip", "cut"])
def test_file_mirror(byte_data, tmp_path, monkeypatch, reference, how):
    import fsspec

    url = f"file://{tmp_path / 'mirror'}"
    run_dir, log = scenario(byte_data, tmp_path, url, monkeypatch, how, fsspec.filesystem("file"))
    want = "step_00000004" if how in ("flip", "cut") else "step_00000008"
    assert f"resumed from the mirror's copy {url}/checkpoints/{want}" in log
    if how == "flip":
        assert f"skipped mirror checkpoint {url}/checkpoints/step_00000008: state.pt is damaged" in log  # fmt: skip
    same(reference, weights(run_dir))
    assert mirror.Mirror(url).latest() == "step_00000012"


def test_unreachable_mirror_is_one_line_before_training(tmp_path, capsys):
    for url, needle in [
        ("file:///proc/gptrain-mirror", "is not reachable or not writable"),
        ("nosuch://bucket/run", "Protocol not known"),
    ]:
        run_dir = tmp_path / "r"
        assert cli(["train", "--config", DEBUG, f"--run.dir={run_dir}", f"--checkpoint.mirror={url}"]) == 2  # fmt: skip
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "checkpoint.mirror" in err[0] and needle in err[0], err
        assert not run_dir.exists()


# --- S3, against a moto server on the loopback interface ----------------------------------------


@pytest.fixture(scope="module")
def s3_server():
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    yield endpoint
    proc.kill()
    proc.wait()


@pytest.fixture
def s3(s3_server, monkeypatch, tmp_path):
    """AWS variables pointing at the loopback server only (no instance metadata lookups)."""
    import boto3
    import fsspec

    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    bucket = f"gptrain-{tmp_path.name.lower().replace('_', '-')[-40:]}"
    boto3.client("s3", endpoint_url=s3_server).create_bucket(Bucket=bucket)
    fsspec.filesystem("s3").clear_instance_cache()
    yield f"s3://{bucket}/run"
    fsspec.filesystem("s3").clear_instance_cache()


@pytest.mark.parametrize("how", ["gone", "flip", "cut"])
def test_s3_mirror(byte_data, tmp_path, monkeypatch, reference, s3, how):
    import fsspec

    run_dir, log = scenario(byte_data, tmp_path, s3, monkeypatch, how, fsspec.filesystem("s3"))
    want = "step_00000004" if how in ("flip", "cut") else "step_00000008"
    assert f"resumed from the mirror's copy {s3}/checkpoints/{want}" in log
    same(reference, weights(run_dir))


def test_s3_missing_credentials_is_one_line(s3, monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    run_dir = tmp_path / "r"
    assert cli(["train", "--config", DEBUG, f"--run.dir={run_dir}", f"--checkpoint.mirror={s3}"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1 and "is not reachable or not writable" in err[0] and "credentials" in err[0]
    )
    assert not run_dir.exists()


def test_local_retention_keeps_the_folder_being_uploaded(tmp_path):
    from gptrain.checkpoint import retention

    root = tmp_path / "checkpoints"
    for s in (2, 4, 6):
        (root / f"step_{s:08d}").mkdir(parents=True)
    assert retention.prune(tmp_path, 6, 1, 0, protect={"step_00000002"}) == ["step_00000004"]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000006"]


def test_mirror_retention_counts_only_the_run_timeline(tmp_path):
    """The local sequence of tests/test_timeline.py (saves 3, 6, 9; resume = 3; saves 5, 10;
    keep_last = 3), each checkpoint uploaded: the mirror keeps what the run keeps, {3, 5, 10}
    (counting the abandoned 6 and 9 it would keep {6, 9, 10}: a damaged step 10 would leave
    nothing of the run's timeline to fall back on); after step 5 the abandoned 9 fills the slot
    the new timeline leaves free."""
    from test_timeline import saves_with_a_branch

    m = mirror.configure(f"file://{tmp_path / 'mirror'}", keep_last=3, keep_every=0)
    kept = {}

    def upload(path):
        m.upload(path)
        kept[int(path.name[5:])] = set(m.steps())

    saves_with_a_branch(
        tmp_path / "run", upload=upload, begin=lambda p: m.record_timeline(p.timeline)
    )
    assert kept == {3: {3}, 6: {3, 6}, 9: {3, 6, 9}, 5: {3, 5, 9}, 10: {3, 5, 10}}
    assert m.latest() == "step_00000010"
    assert m.candidates(m.timeline()) == ["step_00000010", "step_00000005", "step_00000003"]

"""Resume (one process): a resumed run equals an uninterrupted one bit for bit, after a clean stop,
SIGKILL at any moment or during a checkpoint write; half-written or damaged checkpoints are never
used and nothing already written is overwritten; a changed architecture is refused."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import forked
import pytest
import torch
from safetensors.torch import load_file
from train_helpers import DEBUG, REPO, run, weights

from gptrain.__main__ import main as cli
from gptrain.checkpoint import manager as checkpoint


@pytest.mark.parametrize(
    "every, optim",
    [
        (6, []),
        # Muon + AdamW, wsd: the resumed part crosses the decay start (step 6 of 12)
        (4, ["optim.name=muon", "optim.lr_schedule=wsd", "optim.decay_fraction=0.5"]),
        # the embeddings and head in an AdamW group of their own, at their own lr
        (6, ["optim.embed_lr=1e-2"]),
        # nanochat's untied head in a group of its own, beside the embedding's
        (6, ["model.arch=nanochat", "optim.embed_lr=1e-2", "optim.head_lr=2e-3"]),
    ],
)
def test_resume_equals_uninterrupted_run_bit_for_bit(byte_data, tmp_path, every, optim):
    """Dropout on (RNG matters): stop after step `every`, resume to 12 == straight to 12."""
    common = [
        "train.max_steps=12",
        f"checkpoint.every={every}",
        f"eval.every={every}",
        "eval.sample_every=0",
        "model.dropout=0.1",
        "eval.tokens=1024",
        *optim,
    ]
    full, cut = tmp_path / "full", tmp_path / "cut"
    run(byte_data, full, *common)
    shutil.copytree(full, cut)
    # the crash: nothing after step `every` happened for `cut`
    for later in range(2 * every, 13, every):
        shutil.rmtree(cut / "checkpoints" / f"step_{later:08d}")
    (cut / "checkpoints" / "latest").write_text(f"step_{every:08d}\n")
    summary = run(byte_data, cut, *common)
    assert summary["steps"] == 12
    a, b = weights(full), weights(cut)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    sa = checkpoint.load_state(checkpoint.find(full))
    sb = checkpoint.load_state(checkpoint.find(cut))
    assert sa["data"] == sb["data"]
    for k, v in sa["optimizer"]["state"].items():
        for name, t in v.items():
            assert torch.equal(t, sb["optimizer"]["state"][k][name]), (k, name)
    muon = "momentum_buffer" in sa["optimizer"]["state"]["transformer.h.0.mlp.c_fc.weight"]
    assert muon == ("optim.name=muon" in optim)
    embed = [g for g in sb["optimizer"]["param_groups"] if g.get("embed")]
    assert len(embed) == ("optim.embed_lr=1e-2" in optim)
    nanochat = "model.arch=nanochat" in optim
    for g in embed:  # set by the schedule after the resume: 1e-2 x the debug config's min/lr
        want = ["transformer.wte.weight"] if nanochat else ["transformer.wpe.weight", "transformer.wte.weight"]  # fmt: skip
        assert sorted(g["params"]) == want
        assert g["lr"] == pytest.approx(1e-2 * 3e-4 / 3e-3)
    head = [g for g in sb["optimizer"]["param_groups"] if g.get("head")]
    assert [(g["params"], g["lr"]) for g in head] == ([(["lm_head.weight"], pytest.approx(2e-3 * 3e-4 / 3e-3))] if nanochat else [])  # fmt: skip
    rows = [json.loads(r) for r in (cut / "metrics.jsonl").read_text().splitlines()]
    full_rows = [json.loads(r) for r in (full / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("lr") for r in rows] == [r.get("lr") for r in full_rows]


def test_half_written_checkpoint_is_invisible(byte_data, tmp_path):
    """A crash while writing step 6 leaves its temporary folder: resume takes step 4, the save of
    step 6 succeeds over the leftover, and the run ends equal to one that never crashed."""
    common = [
        "train.max_steps=6",
        "optim.warmup_steps=1",
        "checkpoint.every=2",
        "eval.every=0",
        "eval.sample_every=0",
        "eval.tokens=512",
    ]
    full, cut = tmp_path / "full", tmp_path / "cut"
    run(byte_data, full, *common)
    shutil.copytree(full, cut)
    # the crash: step 6 was being written; `latest` still names step 4
    shutil.rmtree(cut / "checkpoints" / "step_00000006")
    (cut / "checkpoints" / "latest").write_text("step_00000004\n")
    tmp = cut / "checkpoints" / ".tmp-step_00000006"
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(b"partial")
    assert checkpoint.latest(cut).name == "step_00000004"
    summary = run(byte_data, cut, *common)
    assert summary["steps"] == 6
    assert checkpoint.latest(cut).name == "step_00000006"
    a, b = weights(full), weights(cut)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_resume_none_refuses_to_overwrite(byte_data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run(
        byte_data,
        run_dir,
        "train.max_steps=2",
        "optim.warmup_steps=1",
        "eval.every=0",
        "eval.sample_every=0",
        "eval.tokens=512",
    )
    before = (run_dir / "metrics.jsonl").read_text()
    rc = cli(
        [
            "train",
            "--config",
            DEBUG,
            f"--data.dir={byte_data}",
            f"--run.dir={run_dir}",
            "--checkpoint.resume=none",
        ]
    )
    assert rc == 2 and "checkpoint.resume" in capsys.readouterr().err
    assert (run_dir / "metrics.jsonl").read_text() == before


@pytest.mark.parametrize(
    "damaged, how",
    [
        ("model.safetensors", "truncated"),
        ("state.pt", "truncated"),
        ("meta.json", "truncated"),
        ("model.safetensors", "one bit flipped"),  # still a valid file: only the hash can tell
        ("state.pt", "one bit flipped"),
    ],
)
def test_damaged_checkpoint_is_one_line_and_nothing_is_overwritten(
    byte_data, tmp_path, capsys, damaged, how
):
    run_dir = tmp_path / "run"
    run(byte_data, run_dir, "train.max_steps=2", "optim.warmup_steps=1", "eval.every=0", "eval.sample_every=0", "eval.tokens=512")  # fmt: skip
    path = checkpoint.find(run_dir) / damaged
    data = bytearray(path.read_bytes())
    if how == "truncated":  # e.g. by a full disk or a bad copy
        data = data[:40]
    else:  # bit rot in the middle of the tensor data
        data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    rc = cli(["train", "--config", DEBUG, f"--data.dir={byte_data}", f"--run.dir={run_dir}", "--train.max_steps=4", "--optim.warmup_steps=1"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and damaged in err[0], err
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


def test_rerunning_a_finished_run_changes_nothing(byte_data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = ["train.max_steps=2", "optim.warmup_steps=1", "eval.every=0", "eval.sample_every=0", "eval.tokens=512"]  # fmt: skip
    run(byte_data, run_dir, *args)
    before = {p: p.read_bytes() for p in (run_dir / "checkpoints").rglob("*") if p.is_file()}
    summary = (run_dir / "summary.json").read_text()
    capsys.readouterr()
    assert run(byte_data, run_dir, *args)["steps"] == 2
    assert "already trained to step 2" in capsys.readouterr().out
    assert (run_dir / "summary.json").read_text() == summary
    assert {
        p: p.read_bytes() for p in (run_dir / "checkpoints").rglob("*") if p.is_file()
    } == before


def test_sigkill_at_any_moment_then_resume_equals_uninterrupted_run(byte_data, tmp_path):
    """A run killed with SIGKILL (no chance to clean up) and started again with the same command
    ends with the uninterrupted run's weights bit for bit, and its metrics hold every step once."""
    common = ["train.max_steps=90", "checkpoint.every=30", "eval.every=0", "eval.sample_every=0"]
    common += ["eval.tokens=512", "eval.sample_tokens=1", "model.dropout=0.1", "log.every=1"]
    run(byte_data, tmp_path / "full", *common)
    crashed = tmp_path / "crashed"
    cmd = [sys.executable, "-m", "gptrain", "train", "--config", DEBUG, f"--data.dir={byte_data}"]
    cmd += [f"--run.dir={crashed}", "--log.progress=false", "--log.plot=false", *(f"--{o}" for o in common)]  # fmt: skip
    proc = forked.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    metrics_file = crashed / "metrics.jsonl"
    while time.time() < deadline and proc.poll() is None:  # kill between checkpoints 30 and 60
        text = metrics_file.read_text() if metrics_file.is_file() else ""
        if '"step": 40,' in text:
            break
        time.sleep(0.005)
    proc.kill()
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    stopped_at = checkpoint.latest(crashed).name
    logged = [
        json.loads(x)["step"] for x in metrics_file.read_text().splitlines() if x.endswith("}")
    ]
    assert stopped_at == "step_00000030" and max(logged) >= 40  # 10+ steps past the checkpoint
    assert run(byte_data, crashed, *common)["steps"] == 90
    a, b = weights(tmp_path / "full"), weights(crashed)
    for k in a:
        assert torch.equal(a[k], b[k]), (k, stopped_at)
    rows = [json.loads(line) for line in (crashed / "metrics.jsonl").read_text().splitlines()]
    ref = [
        json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == [r["step"] for r in ref] == list(range(1, 91))
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref]


def test_sigkill_while_a_checkpoint_is_being_written_then_resume_equals_uninterrupted_run(
    byte_data, tmp_path
):
    """The process is frozen (SIGSTOP) the moment a checkpoint's temporary folder appears; when it
    is caught mid-save it is SIGKILLed there. The half-written folder stays invisible, `latest`
    names the previous checkpoint, and the restarted run ends equal to the uninterrupted one."""
    common = ["train.max_steps=30", "checkpoint.every=3", "eval.every=0", "eval.sample_every=0"]
    common += ["eval.tokens=512", "model.dropout=0.1", "log.every=1"]
    run(byte_data, tmp_path / "full", *common)
    crashed = tmp_path / "crashed"
    ckpts = crashed / "checkpoints"
    cmd = [sys.executable, "-m", "gptrain", "train", "--config", DEBUG, f"--data.dir={byte_data}"]
    cmd += [f"--run.dir={crashed}", "--log.progress=false", "--log.plot=false", *(f"--{o}" for o in common)]  # fmt: skip
    caught = []  # steps whose save was killed half-way
    for _attempt in range(3):
        proc = forked.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        seen_tmp = set(ckpts.glob(".tmp-*")) if ckpts.is_dir() else set()
        while proc.poll() is None:
            fresh = set(ckpts.glob(".tmp-*")) - seen_tmp if ckpts.is_dir() else set()
            if not fresh:
                time.sleep(0.0002)
                continue
            proc.send_signal(signal.SIGSTOP)
            tmp = fresh.pop()
            if tmp.exists():  # frozen in the middle of writing this checkpoint
                proc.kill()
                proc.wait(timeout=30)
                step = int(tmp.name.rsplit("_", 1)[1])
                before = checkpoint.latest(crashed)  # None: killed in the very first save
                expected = f"step_{step - 3:08d}" if step > 3 else None
                assert (before.name if before else None) == expected
                caught.append(step)
                break
            seen_tmp.add(tmp)  # it finished before the stop arrived: let it go on
            proc.send_signal(signal.SIGCONT)
        proc.wait(timeout=120)
        if proc.returncode == 0:
            break
    assert run(byte_data, crashed, *common)["steps"] == 30
    a, b = weights(tmp_path / "full"), weights(crashed)
    for k in a:
        assert torch.equal(a[k], b[k]), (k, caught)
    assert len(caught) >= 2, caught
    rows = [json.loads(line) for line in (crashed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 31))  # each step once


def test_killed_between_the_renames_of_a_re_save_resumes(byte_data, tmp_path):
    """Re-saving a step (after resuming from an earlier one) moves the old folder aside, then
    renames the new one in; a kill between the two leaves `latest` naming a moved folder. The
    moved copy is complete, so resume uses it instead of refusing."""
    common = ["train.max_steps=6", "checkpoint.every=3", "eval.every=0", "eval.sample_every=0"]
    common += ["eval.tokens=512", "model.dropout=0.1"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    run(byte_data, full, *common)
    shutil.copytree(full, cut)
    root = cut / "checkpoints"
    os.replace(root / "step_00000006", root / ".old-step_00000006")  # the first rename only
    assert checkpoint.latest(cut) == root / ".old-step_00000006"
    assert run(byte_data, cut, *common)["steps"] == 6  # nothing left to do, no error
    assert checkpoint.latest(cut) == root / ".old-step_00000006"
    assert run(byte_data, cut, *common, "train.max_steps=9")["steps"] == 9  # and it goes on
    assert checkpoint.latest(cut) == root / "step_00000009"


@pytest.mark.parametrize(
    "first, now, fix",
    [("model.gelu=erf", "model.gelu = 'tanh'", "--model.gelu=erf"), ("model.bias=false", "model.bias = True", "--model.bias=false")],
)  # fmt: skip
def test_resume_with_another_gelu_or_bias_is_refused(byte_data, tmp_path, capsys, first, now, fix):
    """No parameter shape changes with model.gelu: without this check a resume would go on
    silently with another function; with model.bias the tensors would not match. One line, exit
    2, the run directory untouched. The bias-free run's checkpoint has no bias tensors."""
    run_dir = tmp_path / "run"
    common = ["train.max_steps=2", "optim.warmup_steps=1", "eval.every=0", "eval.sample_every=0"]
    common += ["checkpoint.every=2"]
    run(byte_data, run_dir, *common, first)
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    if first == "model.bias=false":
        latest = (run_dir / "checkpoints" / "latest").read_text().strip()
        keys = load_file(run_dir / "checkpoints" / latest / "model.safetensors").keys()
        assert keys and not [k for k in keys if k.endswith(".bias")]
    args = ["train", "--config", DEBUG, f"--data.dir={byte_data}", f"--run.dir={run_dir}"]
    args += [f"--{o}" for o in common] + ["--train.max_steps=4", "--log.progress=false", "--log.plot=false"]  # fmt: skip
    capsys.readouterr()
    assert cli(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and now in err[0] and fix in err[0]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before


def test_checkpoint_io_threads_follow_the_cores_and_hash_like_one_thread(tmp_path, monkeypatch):
    """folder.io_threads: an explicit checkpoint.io_threads wins; auto is one thread per core of
    this process's share of the node, at least 1, at most MAX_IO_THREADS. file_records in threads
    gives every file's record as hashlib does in one pass."""
    import hashlib

    from gptrain.checkpoint import folder

    monkeypatch.setattr(folder, "cpu_cores", lambda: 16)
    assert [folder.io_threads(n) for n in (1, 2, 4, 8, 32)] == [folder.MAX_IO_THREADS, 8, 4, 2, 1]
    assert folder.io_threads(8, asked=5) == 5
    files = []
    for i in range(5):
        files.append(tmp_path / f"f{i}")
        files[-1].write_bytes(os.urandom(1000 * i + 1))
    want = {f.name: {"bytes": f.stat().st_size, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()} for f in files}  # fmt: skip
    assert folder.file_records(files, threads=3) == folder.file_records(files) == want

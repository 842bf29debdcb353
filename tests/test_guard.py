"""Unattended runs (one process): a crafted checkpoint runs nothing, a damaged newest checkpoint
is skipped, non-finite steps under each policy, retention, a save that runs out of disk space."""

import copy
import errno
import hashlib
import json
import shutil
from pathlib import Path

import forked
import pytest
import torch
from train_helpers import DEBUG, run, weights

from gptrain.__main__ import main as cli
from gptrain.checkpoint import folder as ckpt_folder
from gptrain.checkpoint import manager as checkpoint
from gptrain.checkpoint import retention
from gptrain.model.gpt import GPT
from gptrain.training.guards import NonFinite, NonFiniteStop

QUICK = ["eval.every=0", "eval.sample_every=0", "eval.tokens=512", "eval.sample_tokens=1"]
QUICK += ["optim.warmup_steps=1"]


def cli_train(byte_data, run_dir, *overrides):
    args = ["train", "--config", DEBUG, f"--data.dir={byte_data}", f"--run.dir={run_dir}"]
    return cli([*args, "--log.progress=false", "--log.plot=false", *(f"--{o}" for o in overrides)])


def rewrite_state(folder: Path, state, fmt=checkpoint.FORMAT) -> None:
    """Replace state.pt with any object and make meta.json vouch for it (as whoever hands out a
    checkpoint can): size and sha256 recorded anew."""
    torch.save(state, folder / "state.pt")
    meta = json.loads((folder / "meta.json").read_text())
    data = (folder / "state.pt").read_bytes()
    meta["files"]["state.pt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    meta["format"] = fmt
    (folder / "meta.json").write_text(json.dumps(meta))


class Payload:
    """Unpickling this creates a file: the proof that a loader ran code from a checkpoint."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_crafted_checkpoint_runs_nothing(byte_data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run(byte_data, run_dir, "train.max_steps=2", *QUICK)
    folder = checkpoint.find(run_dir)
    marker = tmp_path / "pwned"
    state = torch.load(folder / "state.pt", weights_only=True)
    state["train_state"]["extra"] = Payload(marker)
    rewrite_state(folder, state)
    torch.load(folder / "state.pt", weights_only=False)  # the control: unpickling runs the payload
    assert marker.exists()
    marker.unlink()
    capsys.readouterr()
    assert cli_train(byte_data, run_dir, "train.max_steps=4", *QUICK) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "state.pt" in err[0] and "never code" in err[0], err
    assert not marker.exists()
    # sample and export read only meta.json (JSON) and model.safetensors: they work, run nothing
    assert cli(["sample", "--run", str(run_dir), "--max-new-tokens", "3"]) == 0
    assert cli(["export", "--run", str(run_dir), "--out", str(tmp_path / "hf")]) == 0
    assert not marker.exists()
    # a checkpoint of the old format (pickled Python objects) is refused by its meta.json alone
    rewrite_state(folder, state, fmt=1)
    capsys.readouterr()
    assert cli_train(byte_data, run_dir, "train.max_steps=4", *QUICK) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "older gptrain" in err[0] and not marker.exists()


def test_damaged_newest_is_skipped_and_the_run_equals_an_uninterrupted_one(
    byte_data, tmp_path, capsys
):
    common = ["train.max_steps=9", "checkpoint.every=3", "model.dropout=0.1", *QUICK]
    full, cut = tmp_path / "full", tmp_path / "cut"
    run(byte_data, full, *common)
    shutil.copytree(full, cut)
    root = cut / "checkpoints"
    state = root / "step_00000009" / "state.pt"  # the newest: one flipped bit
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0x01
    state.write_bytes(bytes(data))
    (root / "step_00000006" / "meta.json").unlink()  # the one before: incomplete
    # an explicit step is never replaced by another one
    capsys.readouterr()
    assert cli_train(byte_data, cut, *common, "checkpoint.resume=9") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "step_00000009" in err[0] and "state.pt" in err[0], err
    assert retention.resume_point(cut, "auto")[0] == root / "step_00000003"
    capsys.readouterr()
    assert run(byte_data, cut, *common)["steps"] == 9  # auto: from step 3
    out = capsys.readouterr().out
    assert "warning: skipped checkpoint" in out and "step_00000009: state.pt is damaged" in out
    assert "step_00000006: incomplete (no meta.json)" in out
    a, b = weights(full), weights(cut)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_retention_over_a_long_run_with_resumes(byte_data, tmp_path):
    run_dir = tmp_path / "run"
    keep = ["checkpoint.every=2", "checkpoint.keep_last=3", "checkpoint.keep_every=4", *QUICK]

    def names():  # the checkpoint folders and `latest`
        return sorted(p.name for p in (run_dir / "checkpoints").glob("[ls]*"))

    run(byte_data, run_dir, "train.max_steps=7", *keep)  # saves 2 4 6 7
    assert names() == ["latest", "step_00000004", "step_00000006", "step_00000007"]
    run(byte_data, run_dir, "train.max_steps=13", *keep)  # 8 10 12 13
    assert names() == ["latest", "step_00000004", "step_00000008", "step_00000010"] + [
        "step_00000012",
        "step_00000013",
    ]
    run(byte_data, run_dir, "train.max_steps=20", *keep)  # 14 16 18 20
    assert names() == ["latest"] + [f"step_{s:08d}" for s in (4, 8, 12, 16, 18, 20)]
    assert checkpoint.latest(run_dir).name == "step_00000020"


@pytest.mark.parametrize("fails", ["fsync_write", "fsync_file"])
def test_a_save_that_runs_out_of_disk_space_keeps_the_previous_checkpoint(
    byte_data, tmp_path, capsys, monkeypatch, fails
):
    """The disk fills while meta.json is written (fsync_write), or while model.safetensors and
    state.pt are written side by side on two threads (fsync_file): one line naming the rank, the
    folder and the error, exit 1, the previous checkpoint stays `latest`, and the same command
    resumes once there is space."""
    run_dir = tmp_path / "run"
    write = getattr(ckpt_folder, fails)

    def full_disk(path, *data):
        if ".tmp-step_00000004" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        write(path, *data)

    monkeypatch.setattr(ckpt_folder, fails, full_disk)
    args = ("train.max_steps=4", "checkpoint.every=2", "checkpoint.io_threads=2", *QUICK)
    assert cli_train(byte_data, run_dir, *args) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "No space left on device" in err[0] and "step_00000002" in err[0]
    assert err[0].startswith("gptrain: error: rank 0: cannot write checkpoint step_00000004 in")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "latest",
        "step_00000002",
        "timeline.json",
    ]
    folder = checkpoint.latest(run_dir)
    assert folder.name == "step_00000002" and retention.problem(folder) is None
    assert checkpoint.load_state(folder)["train_state"]["step"] == 2
    monkeypatch.undo()  # space again: the same command resumes from step 2
    assert cli_train(byte_data, run_dir, *args) == 0
    assert checkpoint.latest(run_dir).name == "step_00000004"


# --- non-finite steps ---------------------------------------------------------------------------


@pytest.fixture
def nan_at(monkeypatch):
    """nan_at(step): the training loss of that optimizer step (both of its micro-steps: the debug
    config accumulates 2) becomes NaN, once."""
    original, calls, bad = GPT.forward, [0], set()

    def forward(self, idx, targets=None, *args, **kw):
        logits, loss = original(self, idx, targets, *args, **kw)
        if self.training and loss is not None:
            if calls[0] // 2 + 1 in bad:
                loss = loss * float("nan")
            calls[0] += 1
        return logits, loss

    monkeypatch.setattr(GPT, "forward", forward)
    return lambda step: bad.add(step)


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_nonfinite_skip_leaves_weights_and_optimizer_as_they_were(byte_data, tmp_path, nan_at):
    run_dir = tmp_path / "run"
    nan_at(5)
    common = ["train.max_steps=7", "checkpoint.every=1", "checkpoint.keep_last=10", "log.every=1"]
    run(byte_data, run_dir, *common, *QUICK)
    before, after = checkpoint.find(run_dir, 4), checkpoint.find(run_dir, 5)
    a, b = weights(run_dir, 4), weights(run_dir, 5)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    sa, sb = checkpoint.load_state(before), checkpoint.load_state(after)
    assert sa["optimizer"]["state"].keys() == sb["optimizer"]["state"].keys()
    for k, v in sa["optimizer"]["state"].items():
        for name, t in v.items():
            assert torch.equal(t, sb["optimizer"]["state"][k][name]), (k, name)
    assert sb["data"]["windows_consumed"] == sa["data"]["windows_consumed"] + 16  # batch used up
    c = weights(run_dir, 6)  # and training goes on
    assert any(not torch.equal(b[k], c[k]) for k in b)
    assert [r["skipped"] for r in rows(run_dir) if "loss" in r] == [0, 0, 0, 0, 1, 1, 1]


def test_nonfinite_stop_saves_nothing_new(byte_data, tmp_path, capsys, nan_at):
    run_dir = tmp_path / "run"
    nan_at(5)  # found at step 6, the next step that syncs (a save; log.every = 4)
    rc = cli_train(byte_data, run_dir, "train.max_steps=8", "checkpoint.every=2", "log.every=4", "train.nonfinite=stop", *QUICK)  # fmt: skip
    assert rc == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "step 5" in err[0] and "train.nonfinite = stop" in err[0], err
    assert checkpoint.latest(run_dir).name == "step_00000004"
    assert not (run_dir / "checkpoints" / "step_00000006").exists()


def test_nonfinite_max_skips_stops(byte_data, tmp_path, capsys, nan_at):
    for s in (3, 4, 5):
        nan_at(s)
    rc = cli_train(byte_data, tmp_path / "run", "train.max_steps=8", "train.max_skips=3", "log.every=1", *QUICK)  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "3 consecutive steps" in err[0], err


def test_nonfinite_rollback_equals_a_resume_with_the_cursor_past_the_bad_batch(
    byte_data, tmp_path, nan_at
):
    """NaN at step 5, checkpoint at 3: the run reloads step 3 and trains steps 4.. on the data after
    step 5's batch. Reference: step 3's checkpoint with its cursor moved by hand, resumed."""
    common = ["train.max_steps=8", "checkpoint.every=3", "log.every=1", *QUICK]
    rolled, ref = tmp_path / "rolled", tmp_path / "ref"
    run(byte_data, rolled, *common, "train.max_steps=3")  # the shared start
    shutil.copytree(rolled, ref)
    nan_at(5)  # training steps are counted from the start of the test: 3 done, 2 more
    run(byte_data, rolled, *common, "train.nonfinite=rollback")
    folder = ref / "checkpoints" / "step_00000003"
    state = checkpoint.load_state(folder)
    state["data"]["windows_consumed"] = 5 * 16  # past step 5's batch (16 windows a step)
    rewrite_state(folder, state)
    run(byte_data, ref, *common)
    a, b = weights(rolled), weights(ref)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert checkpoint.load_state(checkpoint.find(rolled))["data"]["windows_consumed"] == 10 * 16
    steps = [r["step"] for r in rows(rolled) if "loss" in r]
    assert steps == list(range(1, 9))  # the steps after the checkpoint are logged once
    assert rows(rolled)[-1]["rollbacks"] == 1
    assert "rolled back to step_00000003" in (rolled / "train.log").read_text()


@pytest.mark.parametrize("fused", [True, False])
def test_skip_is_exact_on_the_device_path_and_the_host_path(fused):
    """A fused AdamW skips on the device (GradScaler's found_inf, scale held at 1.0); foreach
    AdamW after a host check. Either way: a NaN step changes nothing, a finite step equals a
    plain optimizer step bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    ref = torch.nn.Linear(8, 4)
    ref.load_state_dict(model.state_dict())
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1, fused=fused, foreach=not fused) for m in (model, ref)]  # fmt: skip
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    guard = NonFinite("skip", 10, opts[0], scaler, "cpu", sharded=False)
    assert guard.device_side == fused
    x = torch.randn(16, 8)
    for step, poison in enumerate([False, True, False], start=1):
        snapshot = [p.detach().clone() for p in model.parameters()]
        state = {k: {n: t.clone() for n, t in v.items()} for k, v in opts[0].state_dict()["state"].items()}  # fmt: skip
        for m in (model, ref):
            m.zero_grad()
            loss = m(x).pow(2).mean() * (float("nan") if poison and m is model else 1.0)
            loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        guard.step(opts[0], scaler, norm, step)
        if poison:
            assert all(torch.equal(a, b) for a, b in zip(snapshot, model.parameters(), strict=True))
            new = opts[0].state_dict()["state"]
            assert all(torch.equal(state[k][n], new[k][n]) for k in state for n in state[k])
            ref.load_state_dict(model.state_dict())  # the reference skips too
            opts[1].load_state_dict(copy.deepcopy(opts[0].state_dict()))
            continue
        opts[1].step()
        for a, b in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(a, b)
    assert guard.count() == 1


@pytest.mark.parametrize("policy", ["stop", "rollback"])
def test_float16_scaler_overflows_are_skipped_until_max_skips_in_a_row(policy):
    """With a GradScaler (float16), an overflowing step is skipped by the scaler, which lowers its
    scale: counted, but stop / rollback act only on max_skips consecutive overflows. Without a
    scaler the same policy acts on the first non-finite step."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, foreach=True)
    x = torch.ones(2, 4)

    def one_step(guard, scaler, step, overflow):
        opt.zero_grad()
        loss = model(x).sum() * (float("inf") if overflow else 1.0)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        guard.step(opt, scaler, norm, step)
        return guard.check(step)

    plain = torch.amp.GradScaler("cpu", enabled=False)
    unscaled = NonFinite(policy, 3, opt, plain, "cpu", sharded=False)
    if policy == "stop":
        with pytest.raises(NonFiniteStop):
            one_step(unscaled, plain, 1, overflow=True)
    else:
        assert one_step(unscaled, plain, 1, overflow=True) == 1
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    guard = NonFinite(policy, 3, opt, scaler, "cpu", sharded=False)
    before = [p.detach().clone() for p in model.parameters()]
    pattern = [True, True, False, True, False]  # isolated overflows and a streak of 2
    for step, overflow in enumerate(pattern, start=1):
        assert one_step(guard, scaler, step, overflow) is None
    assert guard.count() == 3 and scaler.get_scale() == 2.0**16 / 8  # halved at each overflow
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    outcome = []
    for step in (6, 7, 8):  # three overflows in a row: the scaler does not recover
        try:
            outcome.append(one_step(guard, scaler, step, overflow=True))
        except NonFiniteStop:
            outcome.append("stop")
    assert outcome == [None, None, "stop" if policy == "stop" else 8]


@pytest.mark.parametrize(
    "override, needle",
    [
        ("--train.nonfinite=ignore", "train.nonfinite"),
        ("--train.max_skips=-1", "train.max_skips"),
        ("--checkpoint.keep_last=0", "checkpoint.keep_last"),
        ("--checkpoint.keep_every=-5", "checkpoint.keep_every"),
    ],
)
def test_bad_input_one_line_exit_2(tmp_path, capsys, override, needle):
    assert cli(["train", "--config", DEBUG, f"--run.dir={tmp_path / 'r'}", override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and "Traceback" not in err[0]


@pytest.mark.slow
def test_sigterm_to_one_rank_saves_exits_0_and_the_rerun_equals_an_uninterrupted_run(
    byte_data, tmp_path
):
    """2 ranks (gloo). SIGTERM reaches rank 1 only; rank 0 learns it through the per-step
    all-reduce. Both save at the same step and exit 0; more signals while rank 0 writes the
    checkpoint change nothing. The same command then finishes the run equal to one that was never
    stopped, bit for bit (dropout on, so the RNG of every rank matters)."""
    import signal
    import time

    import dist_helpers as h

    common = ["--train.max_steps=40", "--train.micro_batch_size=4", *h.FAST, "--model.dropout=0.1"]
    args = lambda d: ["-m", "gptrain", "train", "--config", h.DEBUG, f"--data.dir={byte_data}", f"--run.dir={d}", *common]  # noqa: E731 # fmt: skip
    full, cut = tmp_path / "full", tmp_path / "cut"
    h.check_ok(h.wait_all(h.spawn(args(full)), timeout=300))
    procs = h.spawn(args(cut))
    h.wait_for_step(cut, procs, 5)
    procs[1].send_signal(signal.SIGTERM)
    ckpts = cut / "checkpoints"
    saving = lambda: any(p.name != "timeline.json" for p in ckpts.glob("*"))  # noqa: E731
    while all(p.poll() is None for p in procs) and not saving():
        time.sleep(0.0005)
    for p in procs:  # during the save (or just after it): ignored
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    results = h.wait_all(procs, timeout=240)
    h.check_ok(results)
    stopped = checkpoint.latest(cut)
    step = checkpoint.load_meta(stopped)["step"]
    assert 5 <= step < 40, step
    assert "run the same command to resume" in results[0][1] + results[0][2]
    assert retention.problem(stopped) is None
    h.check_ok(h.wait_all(h.spawn(args(cut)), timeout=300))
    a, b = weights(full), weights(cut)
    for k in a:
        assert torch.equal(a[k], b[k]), (k, step)
    assert [r["step"] for r in rows(cut) if "loss" in r] == list(range(1, 41))


@pytest.mark.slow
def test_sigusr1_to_gptrains_own_launcher_reaches_the_workers(byte_data, tmp_path):
    """`gptrain train --dist.nproc_per_node=2` (torch.distributed.run underneath) forwards SIGUSR1
    (Slurm's --signal) to its workers: they save and the launcher exits 0."""
    import signal
    import subprocess
    import sys
    import time

    import dist_helpers as h

    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "gptrain", "train", "--config", DEBUG, f"--data.dir={byte_data}"]
    cmd += [f"--run.dir={run_dir}", "--dist.nproc_per_node=2", "--train.max_steps=200", *h.FAST]
    proc = forked.Popen(cmd, env=h.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    metrics, deadline = run_dir / "metrics.jsonl", time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if metrics.is_file() and '"step": 3,' in metrics.read_text():
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    assert "stopped by SIGUSR1" in out + err and "run the same command to resume" in out + err
    assert 3 <= checkpoint.load_meta(checkpoint.latest(run_dir))["step"] < 200


def test_a_step_that_saves_and_evaluates_saves_first(byte_data, tmp_path, monkeypatch):
    """An eval that dies (out of memory) on a step that also saves cannot cost its checkpoint."""
    import gptrain.evals.val as val

    calls = []

    def failing_eval(*args, **kw):
        calls.append(1)
        if len(calls) == 2:  # the first is the untrained baseline at step 0; then step 2
            raise RuntimeError("out of memory (simulated)")
        return 5.0, 7.0

    monkeypatch.setattr(val, "evaluate", failing_eval)
    with pytest.raises(RuntimeError, match="out of memory"):
        run(byte_data, tmp_path / "run", "train.max_steps=4", "checkpoint.every=2", *QUICK[1:], "eval.every=2")  # fmt: skip
    assert checkpoint.latest(tmp_path / "run").name == "step_00000002"

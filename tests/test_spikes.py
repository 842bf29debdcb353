"""Loss spikes (train.spike, training/guards.py Spikes): the detector's rules on given numbers; with
no spike a run with the detector on is bit-identical to one with it off; `spike` with rollback
equals a resume with the data cursor moved past the spike by hand; `log` only logs; `stop` stops;
a window < 2 is bad input."""

import json
import shutil

import pytest
import torch
from test_guard import rewrite_state
from train_helpers import DEBUG, run, weights

from gptrain.__main__ import main as cli
from gptrain.checkpoint import manager as checkpoint
from gptrain.distributed import faults
from gptrain.logs.loggers import NullLogger
from gptrain.training.guards import NonFiniteStop, Spikes

QUICK = ["eval.every=0", "eval.sample_every=0", "eval.tokens=512", "eval.sample_tokens=1"]
QUICK += ["optim.warmup_steps=1", "log.every=1", "model.dropout=0.1"]
DETECT = ["train.spike_window=4"]  # full after 4 steps (train.spike_z: the default 6)


class Lines(NullLogger):
    def __init__(self):
        self.lines = []

    def text(self, line, echo=True):
        self.lines.append(line)


@pytest.fixture
def fault():
    yield lambda spec: faults.install(0, {faults.ENV: spec})
    faults.install(0, {})


def feed(spikes, values, start=1):
    for i, (loss, norm) in enumerate(values, start=start):
        spikes.record(i, torch.tensor(loss), torch.tensor(norm))


def test_the_detector_on_given_numbers():
    calm = [(4.0, 1.0), (4.1, 1.1), (3.9, 0.9), (4.0, 1.0)]
    log = Lines()
    early = Spikes("rollback", 6.0, 4)
    feed(early, calm[:3] + [(80.0, 1.0)])  # the window is not full at step 4: no decision
    assert early.check(log) is None and not log.lines and list(early.losses)[-1] == 80.0
    s = Spikes("rollback", 6.0, 4)
    feed(s, calm)
    assert s.check(log) is None and not log.lines and len(s.losses) == 4
    feed(s, [(4.05, 1.0), (80.0, 1.0), (float("nan"), 1.0), (4.0, 30.0)], start=5)
    assert s.check(log) == 6  # the first spike; the NaN step is the non-finite guard's
    assert s.count == 2 and len(log.lines) == 2
    assert "step 6: loss spike: loss 80.0000" in log.lines[0] and "step 8:" in log.lines[1]
    assert 80.0 not in s.losses and 30.0 not in s.norms  # spikes never enter the window
    s2 = Spikes("stop", 6.0, 4)
    s2.load_state_dict(s.state_dict())
    assert s2.state_dict() == s.state_dict()
    feed(s2, [(4.0, 1.0), (40.0, 1.0)], start=9)
    with pytest.raises(NonFiniteStop, match="step 10: loss spike"):
        s2.check(log)
    s3 = Spikes("log", 6.0, 4)
    s3.load_state_dict(s.state_dict())
    feed(s3, [(40.0, 1.0)], start=9)
    assert s3.check(log) is None and s3.count == 3
    off = Spikes("off", 6.0, 4)
    feed(off, [(40.0, 1.0)] * 6)
    assert off.check(log) is None and not off._pending


def rows(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def test_no_spike_detector_on_is_bit_identical_to_off(byte_data, tmp_path):
    common = ["train.max_steps=10", "checkpoint.every=5", *QUICK]
    run(byte_data, tmp_path / "off", *common)
    run(byte_data, tmp_path / "on", *common, *DETECT, "train.spike=rollback")
    a, b = weights(tmp_path / "off"), weights(tmp_path / "on")
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert [r["loss"] for r in rows(tmp_path / "off")] == [r["loss"] for r in rows(tmp_path / "on")]
    assert {r["spikes"] for r in rows(tmp_path / "on")} == {0}
    window = checkpoint.load_state(checkpoint.find(tmp_path / "on"))["train_state"]["spikes"]
    assert len(window["losses"]) == 4  # the detector was deciding: its window is full


def test_spike_rollback_equals_a_resume_with_the_cursor_moved_past_it(byte_data, tmp_path, fault):
    """A spike at step 8 (x20 loss), checkpoint at 6: the run reloads step 6 and trains 7.. on the
    data after step 8's batch. Reference: step 6's checkpoint with its cursor moved by hand."""
    common = ["train.max_steps=12", "checkpoint.every=6", *QUICK, *DETECT, "train.spike=rollback"]
    rolled, ref = tmp_path / "rolled", tmp_path / "ref"
    run(byte_data, rolled, *common, "train.max_steps=6")  # the shared start
    shutil.copytree(rolled, ref)
    fault("spike@8")
    run(byte_data, rolled, *common)
    fault("")
    folder = ref / "checkpoints" / "step_00000006"
    state = checkpoint.load_state(folder)
    state["data"]["windows_consumed"] = 8 * 16  # past step 8's batch (16 windows a step)
    rewrite_state(folder, state)
    run(byte_data, ref, *common)
    a, b = weights(rolled), weights(ref)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert [r["step"] for r in rows(rolled)] == list(range(1, 13))  # each step logged once
    assert rows(rolled)[-1]["rollbacks"] == 1 and rows(rolled)[-1]["spikes"] == 1
    log = (rolled / "train.log").read_text()
    assert "step 8: loss spike: loss" in log and "step 8: loss spike; rolled back to step_00000006" in log  # fmt: skip


def test_spike_log_only_logs_and_stop_stops(byte_data, tmp_path, fault):
    common = ["train.max_steps=10", "checkpoint.every=5", *QUICK, *DETECT]
    fault("spike@7")
    run(byte_data, tmp_path / "off", *common)
    fault("spike@7")
    run(byte_data, tmp_path / "log", *common, "train.spike=log")
    a, b = weights(tmp_path / "off"), weights(tmp_path / "log")
    for k in a:
        assert torch.equal(a[k], b[k]), k  # logging changed nothing
    assert [r["spikes"] for r in rows(tmp_path / "log")][5:] == [0, 1, 1, 1, 1]
    assert "step 7: loss spike: loss" in (tmp_path / "log" / "train.log").read_text()
    assert rows(tmp_path / "log")[-1]["rollbacks"] == 0
    fault("spike@7")
    with pytest.raises(NonFiniteStop, match="step 7: loss spike"):
        run(byte_data, tmp_path / "stop", *common, "train.spike=stop")
    assert checkpoint.latest(tmp_path / "stop").name == "step_00000005"


@pytest.mark.parametrize(
    "override, needle",
    [
        ("--train.spike_window=1", "train.spike_window = 1 must be >= 2"),
        ("--train.spike_z=0", "train.spike_z = 0.0 must be > 0"),
        ("--train.spike=maybe", "train.spike"),
    ],
)
def test_bad_input_one_line_exit_2(tmp_path, capsys, override, needle):
    assert cli(["train", "--config", DEBUG, f"--run.dir={tmp_path / 'r'}", override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]
    assert not (tmp_path / "r").exists()

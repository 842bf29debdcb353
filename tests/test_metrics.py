"""Metrics: measured peak, MFU arithmetic, and the loggers behind one interface."""

import importlib.machinery
import json
import sys
import types

import pytest
import torch

from gptrain.errors import UserError
from gptrain.metrics import NullLogger, RunLogger, format_duration, measure_peak_flops, mfu


def test_measured_peak_is_a_real_matmul_rate_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    peak = measure_peak_flops("cpu", torch.float32, seconds_per_shape=0.05)
    assert torch.equal(state, torch.get_rng_state())
    # no faster than a timed matmul of one of the shapes could possibly be (sanity bounds)
    assert 1e8 < peak < 1e15
    assert mfu(tokens_per_s=1000, flops_per_token=peak / 2000, peak_flops=peak) == pytest.approx(
        0.5
    )


def test_format_duration():
    assert format_duration(59) == "00:59" and format_duration(3661) == "1:01:01"


def test_run_logger_writes_jsonl_and_text(tmp_path):
    echoed = []
    logger = RunLogger(tmp_path, echo=echoed.append)
    logger.log(10, {"loss": 2.5, "lr": 1e-3})
    logger.text("hello")
    logger.text("quiet", echo=False)
    logger.close()
    assert json.loads((tmp_path / "metrics.jsonl").read_text()) == {
        "step": 10,
        "loss": 2.5,
        "lr": 1e-3,
    }
    assert (tmp_path / "train.log").read_text() == "hello\nquiet\n"
    assert echoed == ["hello"]
    NullLogger().log(1, {"loss": 1.0})  # the non-main ranks' logger accepts the same calls


def test_tensorboard_and_wandb_receive_the_same_scalars(tmp_path, monkeypatch):
    calls = []

    class Writer:
        def __init__(self, logdir):
            calls.append(("tb_dir", logdir))

        def add_scalar(self, key, value, step):
            calls.append(("tb", key, value, step))

        def close(self):
            calls.append(("tb_close",))

    class Run:
        def log(self, metrics, step):
            calls.append(("wandb", metrics, step))

        def finish(self):
            calls.append(("wandb_finish",))

    def fake(name, **attrs):  # an importable stand-in module
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        module.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, module)

    fake("tensorboard")
    fake("torch.utils.tensorboard", SummaryWriter=Writer)
    fake("wandb", init=lambda **kw: Run())
    logger = RunLogger(tmp_path, tensorboard=True, wandb_project="proj", echo=lambda line: None)
    logger.log(5, {"loss": 1.5, "val_loss": 1.7})
    logger.close()
    assert ("tb", "loss", 1.5, 5) in calls and ("tb", "val_loss", 1.7, 5) in calls
    assert ("wandb", {"loss": 1.5, "val_loss": 1.7}, 5) in calls
    assert ("tb_close",) in calls and ("wandb_finish",) in calls


def test_missing_logging_packages_are_one_line_errors(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails
    with pytest.raises(UserError, match="pip install wandb"):
        RunLogger(tmp_path, wandb_project="proj")
    assert not (tmp_path / "metrics.jsonl").exists()  # refused before writing anything

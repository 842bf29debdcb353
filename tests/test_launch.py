"""gptrain's own launcher (gptrain/distributed/launch.py): how many workers dist.nproc_per_node
asks for (auto, the default: every GPU, 1 without CUDA), and the torch.distributed.run it finds:
it passes only options that torch accepts (torch 2.11 has no --shutdown-timeout, and an unknown
option stops torch's launcher with a usage message, exit code 2), and it says how long the
workers were given to save after a forwarded signal. The launches themselves, signals included,
are tested end to end in test_guard.py and test_elastic.py."""

import argparse
import signal

import pytest
import torch
from torch.distributed import run as torch_run
from torch.distributed.elastic.multiprocessing import SignalException

from gptrain.__main__ import main as cli
from gptrain.config.sections import DistConfig
from gptrain.distributed import launch
from gptrain.errors import UserError


def _torch_2_11_parser() -> argparse.ArgumentParser:
    """torch.distributed.run's parser without --shutdown-timeout, as torch 2.11 ships it."""
    real = torch_run.get_args_parser()
    p = argparse.ArgumentParser()
    for action in real._actions:
        if action.option_strings and "--shutdown-timeout" not in action.option_strings:
            if action.option_strings != ["-h", "--help"]:
                p._add_action(action)
    p.add_argument("training_script")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


def test_supported_keeps_what_torch_accepts_and_drops_the_rest():
    keep = ["--standalone", "--nproc_per_node=2", "--signals-to-handle=SIGTERM,SIGUSR1"]
    assert launch.supported([*keep, "--no-such-option=1"]) == keep


def _launched(monkeypatch, parser=None, raises=None) -> list:
    calls = []
    if parser is not None:
        monkeypatch.setattr(torch_run, "get_args_parser", lambda: parser)

    def main(args):
        torch_run.get_args_parser().parse_args(args)  # exits 2 on an unknown option, as torchrun
        calls.append(args)
        if raises:
            raise raises

    monkeypatch.setattr(torch_run, "main", main)
    return calls


@pytest.mark.parametrize("old_torch", [False, True])
def test_launcher_args_parse_on_this_torch_and_on_one_without_shutdown_timeout(monkeypatch, capsys, old_torch):  # fmt: skip
    calls = _launched(monkeypatch, _torch_2_11_parser() if old_torch else None, SignalException("stop", signal.SIGTERM))  # fmt: skip
    assert launch.launch(2, ["--config", "configs/debug.toml"], DistConfig()) == 0
    (args,) = calls
    assert f"--signals-to-handle={','.join(launch.FORWARDED)}" in args
    has = not old_torch and any("--shutdown-timeout" in a.option_strings for a in torch_run.get_args_parser()._actions)  # fmt: skip
    assert any(a.startswith("--shutdown-timeout") for a in args) is has
    grace = launch.SHUTDOWN_S if has else launch.TORCH_SHUTDOWN_S
    err = capsys.readouterr().err
    assert f"given up to {grace} s to save" in err and err.count("\n") == 1


def _gpus(monkeypatch, count: int) -> None:
    """Make torch see `count` CUDA devices (0: no CUDA)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_nproc_per_node_auto_is_every_gpu_or_one_without_cuda(monkeypatch):
    """auto (the default) counts torch's CUDA devices; a number is checked against them."""
    assert DistConfig().nproc_per_node == "auto"
    _gpus(monkeypatch, 0)
    assert launch.nproc_for("auto") == 1
    _gpus(monkeypatch, 4)
    assert launch.nproc_for("auto") == 4
    assert launch.nproc_for("2") == 2
    with pytest.raises(UserError) as e:
        launch.nproc_for("8")
    assert (
        str(e.value) == "dist.nproc_per_node = 8 but this machine has 4 GPUs; use at most 4 or auto"
    )


def test_default_launches_one_worker_per_gpu(monkeypatch, tmp_path):
    """`gptrain train` without dist.nproc_per_node on a node with 2 GPUs hands torch's launcher 2
    workers (the launch itself is replaced by a recorder)."""
    calls = []
    monkeypatch.delenv("RANK", raising=False)
    _gpus(monkeypatch, 2)
    monkeypatch.setattr(launch, "launch", lambda n, argv, cfg: calls.append((n, argv)) or 0)
    argv = ["train", f"--run.dir={tmp_path / 'run'}"]  # the defaults: a batch for 2 workers
    assert cli(argv) == 0
    assert calls == [(2, argv[1:])]


@pytest.mark.parametrize("bad", ["0", "-1", "many", "2.5", "²"])
def test_bad_nproc_per_node_is_one_line_exit_2(bad, capsys):
    assert cli(["train", f"--dist.nproc_per_node={bad}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"gptrain: error: dist.nproc_per_node = {bad!r}; allowed: a whole number >= 1 or auto"]  # fmt: skip

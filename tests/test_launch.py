"""gptrain's own launcher (gptrain/distributed/launch.py): how many workers dist.nproc_per_node
asks for (auto, the default: every GPU, 1 without CUDA), and the torch.distributed.run it finds:
it passes only options that torch accepts (torch 2.11 has no --shutdown-timeout, and an unknown
option stops torch's launcher with a usage message, exit code 2), and it says how long the
workers were given to save after a forwarded signal; who hosts a multi-node job's rendezvous
store (a `gptrain store`: the agents connect as clients; else this agent, which says so) and the
one line when that store is gone; `gptrain store` itself. The launches themselves, signals included,
are tested end to end in test_guard.py and test_elastic.py."""

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

import dist_helpers as h
import forked
import pytest
import torch
from torch.distributed import run as torch_run
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from gptrain.__main__ import main as cli
from gptrain.checkpoint import lock
from gptrain.config.sections import DistConfig
from gptrain.distributed import launch
from gptrain.distributed import store as rdzv_store
from gptrain.distributed.runtime import FRESH_STORE
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


def _elastic(monkeypatch, endpoint: str) -> DistConfig:
    """An elastic DistConfig at endpoint; the variables launch() sets are restored afterwards."""
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0")
    monkeypatch.setenv(FRESH_STORE, "0")
    monkeypatch.setenv(launch.JOB_ENV, "")
    return DistConfig(nnodes="1:2", rdzv_endpoint=endpoint, rdzv_conf="last_call_timeout=5")


def test_agents_connect_to_a_gptrain_store_as_clients(monkeypatch, capsys):
    """A `gptrain store` at the endpoint (here in this process): torch's c10d backend is told not
    to host the store (is_host=false), and nothing warns about a node that cannot be lost."""
    store = rdzv_store.serve(0)
    calls = _launched(monkeypatch)
    cfg = _elastic(monkeypatch, f"127.0.0.1:{store.port}")
    assert launch.launch(1, ["--config", "configs/debug.toml"], cfg) == 0
    assert "--rdzv_conf=last_call_timeout=5,is_host=false" in calls[0]
    assert capsys.readouterr().err == ""
    # the workers learn their job, for the run folder's lock (checkpoint/lock.py)
    assert os.environ[lock.JOB_ENV] == f"gptrain@127.0.0.1:{store.port}"
    assert launch.JOB_ENV == lock.JOB_ENV


def test_a_store_hosted_by_this_agent_is_marked_and_named(monkeypatch, capsys):
    """No store at the endpoint, which is this machine: this agent hosts it before torch does
    (torch's backend shares the server), marks it with this node and says, in one line, that
    losing this node ends the job and how to avoid it."""
    port = h.free_port()
    endpoint = f"127.0.0.1:{port}"
    seen = []
    calls = _launched(monkeypatch)
    real_main = torch_run.main
    monkeypatch.setattr(
        torch_run, "main", lambda a: seen.append(rdzv_store.who_hosts(endpoint, 5)) or real_main(a)
    )
    assert (
        launch.launch(1, ["--config", "configs/debug.toml"], _elastic(monkeypatch, endpoint)) == 0
    )
    me = rdzv_store.Host(rdzv_store.NODE, socket.gethostname(), os.getpid())
    assert seen == [me] and not any("is_host" in a for a in calls[0])
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"is hosted by {me.text}: losing that node ends the job" in err[0]
    assert f"run `gptrain store --port {port}` on a stable host" in err[0]


def test_a_lost_store_is_one_line_naming_its_host_exit_1(monkeypatch):
    """The rendezvous fails and the store no longer answers: one line naming the store's address
    and its host, exit code 1; while the store answers, the rendezvous error stays exit 2."""
    held = [rdzv_store.serve(0)]
    port = held[0].port
    endpoint = f"127.0.0.1:{port}"
    lost = RendezvousConnectionError("The connection to the C10d store has failed.")
    _launched(monkeypatch, raises=lost)
    cfg = _elastic(monkeypatch, endpoint)
    with pytest.raises(UserError) as e:
        launch.launch(1, [], cfg)
    assert e.value.exit_code == 2 and str(e.value).startswith(f"rendezvous at {endpoint} failed")
    real_main = torch_run.main
    monkeypatch.setattr(torch_run, "main", lambda a: held.clear() or real_main(a))
    with pytest.raises(UserError) as e:
        launch.launch(1, [], cfg)
    me = rdzv_store.Host(rdzv_store.EXTERNAL, socket.gethostname(), os.getpid())
    assert e.value.exit_code == 1
    assert str(e.value) == (
        f"the rendezvous store at {endpoint}, hosted by {me.text}, is gone ({lost}); "
        f"start `gptrain store --port {port}` on {me.node} again, then the job"
    )


def _close_rendezvous(endpoint: str, run_id: str):
    """What torch's agents do when their job ends: close the rendezvous (here through torch's
    own handler, as a client of the store at endpoint). Returns a function telling whether the
    rendezvous of another id is closed there."""
    from torch.distributed.elastic.rendezvous import (
        RendezvousParameters,
        rendezvous_handler_registry,
    )

    def handler(rid):
        params = RendezvousParameters("c10d", endpoint, rid, 1, 2, is_host="false")
        return rendezvous_handler_registry.create_handler(params)

    handler(run_id).set_closed()
    return lambda rid: handler(rid).is_closed()


@pytest.mark.parametrize("kind", [rdzv_store.EXTERNAL, rdzv_store.NODE])
def test_a_closed_rendezvous_names_the_earlier_job_its_store_and_the_fix(monkeypatch, kind):
    """A store that outlived a job (a `gptrain store`, or an agent still ending) keeps that
    job's rendezvous closed: the next job with the same dist.rdzv_id (the default) is one line
    saying so, naming the store and the fix, exit 2; another id is not closed there."""
    port = h.free_port()
    endpoint = f"127.0.0.1:{port}"
    held = rdzv_store.serve(port) if kind == rdzv_store.EXTERNAL else None
    held = held or rdzv_store.host_here(endpoint, 30)
    is_closed = _close_rendezvous(endpoint, "gptrain")
    with pytest.raises(UserError) as e:
        launch.launch(1, ["--config", "configs/debug.toml"], _elastic(monkeypatch, endpoint))
    me = rdzv_store.Host(kind, socket.gethostname(), os.getpid())
    head = f"the rendezvous 'gptrain' at {endpoint} is closed: a job with dist.rdzv_id = 'gptrain' already ended there"
    fix = 'give each job a dist.rdzv_id of its own (e.g. --dist.rdzv_id="$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}", the same on every node of that job)'
    if kind == rdzv_store.EXTERNAL:
        want = f"{head}, and {me.text} keeps a closed rendezvous as long as it runs; {fix}, or restart `gptrain store --port {port}` between jobs"
    else:
        want = f"{head} or is ending, and {me.text} still serves its store; {fix}, or wait until that job's agents have exited"
    assert e.value.exit_code == 2 and str(e.value) == want
    assert is_closed("gptrain") and not is_closed("4242.0")
    del held


@pytest.mark.parametrize(
    "argv, needle",
    [
        ([], "the following arguments are required: --port"),
        (["--port", "70000"], "--port 70000 is not a TCP port (0 to 65535)"),
        (["--port", "x"], "argument --port: invalid int value: 'x'"),
    ],
)
def test_bad_store_flags_are_one_line_exit_2(capsys, argv, needle):
    assert cli(["store", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_store_on_a_taken_port_is_one_line_exit_2(capsys):
    taken = rdzv_store.serve(0)
    assert cli(["store", "--port", str(taken.port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"cannot listen on port {taken.port}" in err[0], err


def test_store_serves_marked_and_ends_on_sigterm(tmp_path):
    """`gptrain store --port 0` prints its address once listening, carries its mark and ends
    with exit code 0 on SIGTERM."""
    out = tmp_path / "out"
    p = forked.Popen(
        [sys.executable, "-m", "gptrain", "store", "--port", "0"],
        env=h.env(),
        stdout=open(out, "w"),
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while "--dist.rdzv_endpoint=" not in out.read_text() and time.monotonic() < deadline:
            assert p.poll() is None, out.read_text()
            time.sleep(0.05)
        port = int(out.read_text().split("--dist.rdzv_endpoint=")[1].split()[0].rsplit(":", 1)[1])
        assert "and each job with a --dist.rdzv_id of its own" in out.read_text()
        host = rdzv_store.who_hosts(f"127.0.0.1:{port}", 10)
        assert host == rdzv_store.Host(rdzv_store.EXTERNAL, socket.gethostname(), p.pid)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0
    finally:
        if p.poll() is None:
            p.kill()
    assert (
        out.read_text().splitlines()[-1]
        == f"gptrain store: stopped ({socket.gethostname()}:{port})"
    )

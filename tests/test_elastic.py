"""Elastic node count (dist.nnodes = MIN:MAX through torch's elastic agent): malformed ranges and
node counts that cannot divide the global batch are one line before anything starts; two loopback
agents with --dist.nnodes=1:2: one is killed with its worker mid-run (a lost node), the other
re-forms at world size 1 and finishes on the same tokens, within float tolerance of an
uninterrupted run; the agent started again makes the job save, re-form at world size 2 and go on
from that very step. With a `gptrain store` as the rendezvous store, losing the node started first
(rank 0's) leaves the other training to the end; without one, losing the node whose agent hosts
the store ends the other within a bounded time with one line naming that node."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import dist_helpers as h
import forked
import pytest
import torch
from train_helpers import DEBUG, REPO, run, weights

from gptrain.__main__ import main as cli
from gptrain.checkpoint import manager as checkpoint

sys.path.insert(0, str(REPO / "benchmarks" / "drills"))
from chaos import workers as children  # noqa: E402  (processes whose parent is pid)


@pytest.mark.parametrize(
    "nodes, needle",
    [
        ("2:1", "dist.nnodes = '2:1'; allowed: a whole number >= 1, or MIN:MAX"),
        ("0:2", "dist.nnodes = '0:2'"),
        ("1:2:3", "dist.nnodes = '1:2:3'"),
        ("x", "dist.nnodes = 'x'"),
        ("1:3", "world size 3 (3 nodes) cannot divide train.total_batch_size = 1024"),
    ],
)
def test_bad_node_ranges_are_one_line_exit_2(tmp_path, capsys, nodes, needle):
    run_dir = tmp_path / "r"
    argv = ["train", "--config", DEBUG, f"--run.dir={run_dir}", f"--dist.nnodes={nodes}"]
    argv += ["--dist.nproc_per_node=1", "--dist.rdzv_endpoint=127.0.0.1:29555"]
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
    if nodes == "1:3":
        assert "node counts that can: 1, 2" in err[0]
    assert not run_dir.exists()


def test_bad_rdzv_conf_is_one_line_exit_2(tmp_path, capsys):
    run_dir = tmp_path / "r"
    argv = ["train", "--config", DEBUG, f"--run.dir={run_dir}", "--dist.nnodes=1:2"]
    argv += [
        "--dist.rdzv_endpoint=127.0.0.1:29555",
        "--dist.rdzv_conf=last_call_timeout=5,keepalive=2",
    ]
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dist.rdzv_conf" in err[0] and "'keepalive=2'" in err[0], err
    assert not run_dir.exists()


def lose_node(agent: subprocess.Popen) -> None:
    """SIGKILL an agent and its workers at once, as when the machine goes away."""
    workers = children(agent.pid)
    agent.kill()
    for pid in workers:
        os.kill(pid, signal.SIGKILL)
    agent.wait()


def log_lines(run_dir: Path) -> list[str]:
    path = run_dir / "train.log"
    return path.read_text().splitlines() if path.is_file() else []


def wait_for(predicate, procs, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and all(p.poll() is None for p in procs):
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError("timed out waiting (or an agent ended)")


# Each agent is gptrain's own launcher (gptrain.distributed.launch) with dist.rdzv_conf (torchrun's
# --rdzv_conf): a node's heartbeat is stale after 3 x 1 s (torch's default 3 x 5 s), and once the
# minimum node count has joined, the rendezvous waits 3 s for more before it closes (torch's
# default 30 s), so the survivor of a lost node re-forms after about 6 s, not 45 s. The second
# agent must join within those 3 s of the first: it imports first, then waits for the first
# agent's store.
RDZV_CONF = "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3"
AGENT = """import os, socket, time
import gptrain.commands.train
port = int(os.environ.get("WAIT_FOR_PORT", 0))
while port:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        break
    except OSError:
        time.sleep(0.05)
from gptrain.__main__ import entry
entry()  # main(sys.argv[1:]), exiting as gptrain does
"""


@pytest.mark.slow
def test_two_loopback_agents_lose_a_node_and_get_it_back(byte_data, tmp_path):
    steps = 160  # the survivor must still be training when the lost node is back (~40 steps)
    common = [f"train.max_steps={steps}", "train.micro_batch_size=4"]
    common += ["eval.every=0", "eval.sample_every=0", "eval.tokens=512", "eval.sample_tokens=1"]
    common += ["optim.warmup_steps=1", "log.every=1", "log.progress=false", "log.plot=false", "train.dtype=float32"]  # fmt: skip
    # uninterrupted, one process
    run(byte_data, tmp_path / "ref", *common, f"checkpoint.every={steps}")
    common += ["checkpoint.every=5"]
    run_dir, port = tmp_path / "el", h.free_port()
    cmd = [sys.executable, "-c", AGENT, "train", "--config", DEBUG, f"--data.dir={byte_data}"]
    cmd += [f"--run.dir={run_dir}", *(f"--{c}" for c in common), "--dist.nnodes=1:2"]
    cmd += ["--dist.nproc_per_node=1", f"--dist.rdzv_endpoint=127.0.0.1:{port}"]
    cmd += [f"--dist.rdzv_conf={RDZV_CONF}"]

    logs = []

    def agent(**env):  # stderr to a file: an unread pipe fills up and blocks the agent
        logs.append(tmp_path / f"agent{len(logs)}.err")
        return forked.Popen(cmd, env=h.env(**env), stdout=subprocess.DEVNULL, stderr=open(logs[-1], "w"), start_new_session=True)  # fmt: skip

    a = agent()  # its agent hosts the rendezvous store: b waits for it (a job without a
    b = None  # `gptrain store` cannot lose that node: on a cluster, the endpoint's node)
    try:
        b = agent(WAIT_FOR_PORT=port)
        wait_for(lambda: any("checkpoint" in x and "step_00000015" in x for x in log_lines(run_dir)), [a, b], 180)  # fmt: skip
        assert "world size 2" in log_lines(run_dir)[0]
        lose_node(b)
        lost = time.time()
        resumed = lambda: [x for x in log_lines(run_dir) if x.startswith("resumed from")]  # noqa: E731
        wait_for(lambda: len(resumed()) == 1, [a], 180)  # re-formed (stale heartbeat, last call)
        # torch's defaults (a 15 s stale heartbeat, then a 30 s last call) took 44 s here
        assert time.time() - lost < 30, "dist.rdzv_conf did not reach the agents"
        assert "world size 1, micro-batch 4, accumulation 4" in resumed()[0]
        # the node comes back: the job saves, re-forms at 2 and goes on from there
        b = agent(WAIT_FOR_PORT=port)
        wait_for(lambda: len(resumed()) == 2, [a, b], 180)
        a.wait(timeout=300)
        b.wait(timeout=300)
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                lose_node(p)
    assert a.returncode == 0 and b.returncode == 0, [p.read_text()[-3000:] for p in logs]
    lines = log_lines(run_dir)
    stopped = [x for x in lines if x.startswith("stopped by SIGTERM at step")]
    assert len(stopped) == 1, lines[-20:]
    at = int(stopped[0].split("at step ")[1].split(":")[0])
    assert (
        f"resumed from {run_dir / 'checkpoints' / f'step_{at:08d}'}" in resumed()[1]
    )  # no step lost
    assert "world size 2, micro-batch 4, accumulation 2" in resumed()[1]
    losses = [{r["step"]: r["loss"] for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines()) if "loss" in r} for d in (tmp_path / "ref", run_dir)]  # fmt: skip
    assert sorted(losses[1]) == list(range(1, steps + 1))  # every step once
    for step in losses[0]:  # world size 2, 1, 2 against 1 throughout: float tolerance only
        assert losses[1][step] == pytest.approx(losses[0][step], rel=1e-4), step
    ref_state = checkpoint.load_state(checkpoint.find(tmp_path / "ref"))
    el_state = checkpoint.load_state(checkpoint.find(run_dir))
    assert el_state["data"] == ref_state["data"]  # the same tokens seen
    a_w, b_w = weights(tmp_path / "ref"), weights(run_dir)
    for k in a_w:  # 160 AdamW steps magnify float noise in parameters whose gradient is ~0
        torch.testing.assert_close(b_w[k], a_w[k], rtol=0, atol=1e-2, msg=k)


def short_job(tmp_path: Path, data: Path, endpoint: str, steps: int) -> tuple[Path, list[str]]:
    """The run directory and an agent's command for a short elastic job at `endpoint`."""
    run_dir = tmp_path / "el"
    cmd = [sys.executable, "-c", AGENT, "train", "--config", DEBUG, f"--data.dir={data}"]
    cmd += [f"--run.dir={run_dir}", f"--train.max_steps={steps}", "--train.micro_batch_size=4"]
    cmd += ["--checkpoint.every=5", "--eval.every=0", "--eval.sample_every=0", "--log.every=1"]
    cmd += ["--log.progress=false", "--log.plot=false", "--dist.nnodes=1:2", "--dist.nproc_per_node=1"]  # fmt: skip
    cmd += [f"--dist.rdzv_endpoint={endpoint}", f"--dist.rdzv_conf={RDZV_CONF}"]
    return run_dir, cmd


def start_agent(cmd: list[str], err: Path, **env) -> subprocess.Popen:
    """An agent in a session of its own, stderr to a file (an unread pipe blocks it)."""
    out = subprocess.DEVNULL
    return forked.Popen(
        cmd, env=h.env(**env), stdout=out, stderr=open(err, "w"), start_new_session=True
    )


def start_store(tmp_path: Path) -> tuple[subprocess.Popen, int]:
    """`gptrain store --port 0` and the port it prints once it listens."""
    out = tmp_path / "store.out"
    store = forked.Popen(
        [sys.executable, "-m", "gptrain", "store", "--port", "0"],
        env=h.env(),
        stdout=open(out, "w"),
        stderr=subprocess.STDOUT,
    )
    wait_for(lambda: "--dist.rdzv_endpoint=" in out.read_text(), [store], 60)
    line = out.read_text().splitlines()[0]
    assert line.startswith("gptrain store: serving the rendezvous store at "), line
    return store, int(line.rsplit(":", 1)[1].split()[0])


def checkpointed(run_dir: Path, step: int):
    return lambda: any(f"step_{step:08d}" in x for x in log_lines(run_dir))


@pytest.mark.slow
def test_a_store_off_the_nodes_lets_the_job_lose_either_node(byte_data, tmp_path):
    """Two agents and a `gptrain store`: the node started first (rank 0, and the store's host
    had the agents hosted it) is lost; the other re-forms alone and finishes the run."""
    store, port = start_store(tmp_path)
    run_dir, cmd = short_job(tmp_path, byte_data, f"127.0.0.1:{port}", steps=40)
    errs = [tmp_path / "a.err", tmp_path / "b.err"]
    a = b = None
    try:
        a = start_agent(cmd, errs[0])
        b = start_agent(cmd, errs[1])
        wait_for(checkpointed(run_dir, 10), [a, b], 60)
        assert "world size 2" in log_lines(run_dir)[0]
        lose_node(a)
        assert b.wait(timeout=90) == 0, errs[1].read_text()[-3000:]
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                lose_node(p)
        store.terminate()
        assert store.wait(timeout=30) == 0  # SIGTERM ends it cleanly
    resumed = [x for x in log_lines(run_dir) if x.startswith("resumed from")]
    assert len(resumed) == 1 and "world size 1" in resumed[0], resumed
    assert "is_host" not in errs[1].read_text()  # no store trouble on the survivor
    records = (run_dir / "metrics.jsonl").read_text().splitlines()
    steps = {json.loads(x).get("step") for x in records}
    assert set(range(1, 41)) <= steps


@pytest.mark.slow
def test_losing_the_node_hosting_the_store_is_one_line_naming_it(byte_data, tmp_path):
    """Without a `gptrain store`, the first agent on the endpoint's machine hosts the store; it
    says so at the start, and when that node is lost the other ends within a bounded time with
    one line naming the store, the node that hosted it and the way to avoid it."""
    port = h.free_port()
    endpoint = f"127.0.0.1:{port}"
    run_dir, cmd = short_job(tmp_path, byte_data, endpoint, steps=400)
    errs = [tmp_path / "a.err", tmp_path / "b.err"]
    a = b = None
    try:
        a = start_agent(cmd, errs[0])
        b = start_agent(cmd, errs[1], WAIT_FOR_PORT=port)
        wait_for(checkpointed(run_dir, 10), [a, b], 60)
        lose_node(a)
        lost = time.time()
        code = b.wait(timeout=90)
        took = time.time() - lost
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                lose_node(p)
    err = errs[1].read_text()
    node = f"the agent of node {socket.gethostname()} (pid {a.pid})"
    note = f"the rendezvous store at {endpoint} is hosted by {node}: losing that node ends the job"
    assert note in err, err[-3000:]
    line = f"gptrain: error: the rendezvous store at {endpoint}, hosted by {node}, "
    line += "the node that started it, is gone"
    ends = [x for x in err.splitlines() if x.startswith("gptrain: error: the rendezvous store")]
    assert len(ends) == 1 and ends[0].startswith(line), err[-3000:]
    assert f"gptrain store --port {port}" in ends[0]
    assert code not in (0, None) and took < 60, (code, took)

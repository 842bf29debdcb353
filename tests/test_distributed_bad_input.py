"""Bad input to a multi-process run (CPU, gloo, 2 ranks as subprocesses): a world size that does
not divide the batch, settings that cannot work together, configs that differ between ranks, a
logger that cannot start, more processes than cores, an unreachable or missing rendezvous. Every
started rank ends with exit code 2 and one line naming the problem, and nothing is written."""

import sys

import dist_helpers as h
import forked
import pytest

from gptrain.distributed.runtime import cpu_cores

pytestmark = pytest.mark.slow


def one_line_errors(results, needle):
    for rank, (rc, _out, err) in enumerate(results):
        lines = err.strip().splitlines()
        assert rc == 2, f"rank {rank} exited {rc}: {err[-2000:]}"
        assert len(lines) == 1 and lines[0].startswith("gptrain: error:"), (rank, err[-2000:])
        assert needle in lines[0], (rank, lines[0])


def test_bad_input_world_size_does_not_divide_batch(byte_data, tmp_path):
    # 1536 tokens = 3 micro-steps of 8 x 64 on one process, but not divisible over 2 ranks
    args = ["-m", "gptrain", "train", "--config", h.DEBUG, f"--data.dir={byte_data}", f"--run.dir={tmp_path / 'r'}", "--train.total_batch_size=1536"]  # fmt: skip
    one_line_errors(h.wait_all(h.spawn(args), h.TIMEOUT), "x world size (2) = 1024")
    launched = forked.run([sys.executable, *args, "--dist.nproc_per_node=2"], env=h.env(), cwd=h.REPO, capture_output=True, text=True, timeout=h.TIMEOUT)  # fmt: skip
    one_line_errors([(launched.returncode, launched.stdout, launched.stderr)], "nearest valid")
    assert not (tmp_path / "r").exists()


def test_bad_input_static_graph_with_accumulation(byte_data, tmp_path):
    args = ["-m", "gptrain", "train", "--config", h.DEBUG, f"--data.dir={byte_data}", f"--run.dir={tmp_path / 'r'}", "--train.total_batch_size=2048", "--dist.static_graph=true"]  # fmt: skip
    one_line_errors(
        h.wait_all(h.spawn(args), h.TIMEOUT),
        "dist.static_graph = true with gradient accumulation (2",
    )


def test_bad_input_mismatched_configs(byte_data, tmp_path):
    def args(rank):
        lr = "--optim.lr=1e-3" if rank == 0 else "--optim.lr=2e-3"  # "node" 1 has another config
        return ["-m", "gptrain", "train", "--config", h.DEBUG, f"--data.dir={byte_data}", f"--run.dir={tmp_path / 'r'}", lr]  # fmt: skip

    one_line_errors(h.wait_all(h.spawn(args), h.TIMEOUT), "config differs between ranks")


def test_bad_input_logger_that_cannot_start_stops_every_rank(byte_data, tmp_path):
    """W&B without a login fails on rank 0 only (the one that logs): every rank exits 2 at once."""
    pytest.importorskip("wandb", reason="wandb not installed")
    args = ["-m", "gptrain", "train", "--config", h.DEBUG, f"--data.dir={byte_data}", f"--run.dir={tmp_path / 'r'}", "--log.wandb=proj"]  # fmt: skip
    home = dict(NETRC=tmp_path / "netrc", WANDB_CONFIG_DIR=tmp_path / "wandb", WANDB_MODE="online")
    results = h.wait_all(h.spawn(args, WANDB_API_KEY="", **home), h.TIMEOUT)
    one_line_errors(results[:1], "log.wandb = 'proj': W&B did not start")
    one_line_errors(results[1:], "another rank failed")
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_bad_input_more_processes_than_cores(byte_data, tmp_path):
    n = cpu_cores() + 1
    args = ["-m", "gptrain", "train", "--config", h.DEBUG, f"--data.dir={byte_data}", f"--run.dir={tmp_path / 'r'}"]  # fmt: skip
    # under a launcher: every started rank refuses (two of the n are enough to show it)
    procs = h.spawn(args, world=n, ranks=[0, 1], LOCAL_WORLD_SIZE=n)
    one_line_errors(h.wait_all(procs, h.TIMEOUT), f"has {n - 1} CPU cores")
    launched = forked.run([sys.executable, *args, f"--dist.nproc_per_node={n}"], env=h.env(), cwd=h.REPO, capture_output=True, text=True, timeout=h.TIMEOUT)  # fmt: skip
    one_line_errors(
        [(launched.returncode, launched.stdout, launched.stderr)], f"nproc_per_node = {n}"
    )


def test_bad_input_unreachable_rendezvous(byte_data, tmp_path):
    """Rank 1 alone: nobody listens at the endpoint; rank 0 alone: nobody joins. Both end after
    dist.timeout_s with one line naming the address (the two cases side by side, at two ports)."""
    args = ["-m", "gptrain", "train", "--config", h.DEBUG, f"--data.dir={byte_data}", "--dist.timeout_s=2"]  # fmt: skip
    ports = h.free_port(), h.free_port()
    worker = h.spawn([*args, f"--run.dir={tmp_path / 'r1'}"], ranks=[1], port=ports[0])
    host = h.spawn([*args, f"--run.dir={tmp_path / 'r0'}"], ranks=[0], port=ports[1])
    one_line_errors(
        h.wait_all(worker, 60), f"rank 1: cannot reach the rendezvous at 127.0.0.1:{ports[0]}"
    )
    one_line_errors(h.wait_all(host, 60), "rank 0: not all 2 processes reached the rendezvous")


def test_bad_input_multinode_endpoint(byte_data, tmp_path):
    """gptrain's own multi-node launch: a missing or unresolvable rendezvous endpoint is one line."""
    base = ["-m", "gptrain", "train", "--config", h.DEBUG, f"--data.dir={byte_data}", f"--run.dir={tmp_path / 'r'}", "--dist.nnodes=2"]  # fmt: skip
    for extra, needle in [
        ([], "dist.nnodes = 2 needs dist.rdzv_endpoint=HOST:PORT"),
        (
            ["--dist.rdzv_endpoint=no-such-node.invalid:29500"],
            "cannot resolve host 'no-such-node.invalid'",
        ),
    ]:
        done = forked.run([sys.executable, *base, *extra], env=h.env(), cwd=h.REPO, capture_output=True, text=True, timeout=h.TIMEOUT)  # fmt: skip
        one_line_errors([(done.returncode, done.stdout, done.stderr)], needle)
    assert not (tmp_path / "r").exists()

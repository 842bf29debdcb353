"""A failed publish on 2 ranks (gloo), full checkpoints (DDP) and sharded ones (FSDP2):
GPTRAIN_FAULT=publish_error@4 makes that rank's part of publishing step 4's checkpoint fail with
ENOSPC (rank 0: writing `latest` after the folder's rename; under FSDP2 rank 1: hashing its
shards). Every rank ends within 60 s with one line naming the failing rank, the path and the OS
error, exit 1; step 2's checkpoint stays complete and named in `latest`, no step-4 folder is left;
the same command without the fault then ends bit for bit where an uninterrupted run ends."""

import time

import dist_helpers as h
import pytest
import torch

from gptrain.checkpoint import manager as checkpoint

pytestmark = pytest.mark.slow

COMMON = ["--train.max_steps=6", "--train.micro_batch_size=4", *h.FAST, "--checkpoint.every=2"]
COMMON += ["--model.dropout=0.1"]


def args(byte_data, run_dir, mode):
    return ["-m", "gptrain", "train", "--config", h.DEBUG, f"--data.dir={byte_data}"] + [
        f"--run.dir={run_dir}",
        f"--dist.mode={mode}",
        *COMMON,
    ]


@pytest.fixture(scope="module")
def uninterrupted(byte_data, tmp_path_factory):
    """{mode: the run directory of an uninterrupted 2-rank run}."""
    root = tmp_path_factory.mktemp("publish")
    for mode in ("ddp", "fsdp"):
        h.check_ok(h.wait_all(h.spawn(args(byte_data, root / mode, mode)), h.TIMEOUT))
    return {mode: root / mode for mode in ("ddp", "fsdp")}


@pytest.mark.parametrize(
    "mode, fault, rank, path",
    [
        ("ddp", "publish_error@4", 0, ".latest.tmp"),
        ("fsdp", "publish_error@4/0", 0, ".latest.tmp"),
        ("fsdp", "publish_error@4/1", 1, ".tmp-step_00000004/__1_0.distcp"),
    ],
)
def test_a_failed_publish_ends_every_rank_and_keeps_the_previous_checkpoint(
    uninterrupted, byte_data, tmp_path, mode, fault, rank, path
):
    run_dir = tmp_path / "run"
    procs = h.spawn(args(byte_data, run_dir, mode), GPTRAIN_FAULT=fault)
    results = h.wait_all(procs, h.TIMEOUT)  # the default dist.timeout_s (300 s) is never waited
    ended = time.time()
    root = run_dir / "checkpoints"
    step3 = (run_dir / "metrics.jsonl").stat().st_mtime  # the last row before step 4's save
    assert ended - step3 < 60
    want = (
        f"gptrain: error: rank {rank}: cannot publish checkpoint step_00000004 in {root} "
        f"(OSError: [Errno 28] No space left on device: '{root / path}'); the previous "
        "checkpoint step_00000002 is intact and `latest` names it; free disk space"
    )
    for r, (rc, _, err) in enumerate(results):
        lines = [x for x in err.splitlines() if x.startswith("gptrain: error:")]
        assert rc == 1 and "Traceback" not in err, (r, err[-3000:])
        assert len(lines) == 1 and lines[0].startswith(want), (r, lines)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002", "timeline.json"]
    assert checkpoint.latest(run_dir).name == "step_00000002"
    assert checkpoint.problem(root / "step_00000002") is None
    h.check_ok(h.wait_all(h.spawn(args(byte_data, run_dir, mode)), h.TIMEOUT))
    a, b = h.checkpoint_tensors(uninterrupted[mode]), h.checkpoint_tensors(run_dir)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k

"""A run whose folder another job took over stops and writes nothing more there.

GPTRAIN_FAULT=lock_taken@5 has another host's job take over run.dir's lock at the start of step 5,
and the main process's heartbeat notice it at once (as it would within checkpoint/lock.py's
HEARTBEAT_S when a requeued job took over after this one's heartbeat was late). On 1 process and
on 2 gloo ranks (DDP, FSDP2): every rank ends at step 5's boundary with one line, exit 2, no
traceback; nothing is saved at step 5 or later (step 4's checkpoint stays `latest`), no metrics
row, no summary, no ledger line; the other job's lock stays. A rerun meets that lock, its
heartbeat moving, and is refused; once the other job is gone, the same command resumes from step
4 and ends bit for bit where an uninterrupted run ends."""

import contextlib
import json
import threading

import dist_helpers as h
import pytest
import torch

from gptrain.checkpoint import manager as checkpoint

pytestmark = pytest.mark.slow

COMMON = ["--train.max_steps=8", "--train.micro_batch_size=4", *h.FAST, "--checkpoint.every=2"]


@contextlib.contextmanager
def beating(path):
    """The other job runs: it rewrites its lock's heartbeat (as lock.py's holder does) every
    0.2 s until the block ends."""
    stop = threading.Event()

    def beat():
        content = json.loads(path.read_text())
        while not stop.wait(0.2):
            content["beats"] += 1
            tmp = path.with_name(".lock.tmp-beating")
            tmp.write_text(json.dumps(content))
            tmp.replace(path)

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def args(byte_data, run_dir, mode):
    cmd = ["-m", "gptrain", "train", "--config", h.DEBUG, f"--data.dir={byte_data}"]
    return [*cmd, f"--run.dir={run_dir}", f"--dist.mode={mode}", *COMMON]


@pytest.mark.parametrize("world, mode", [(1, "ddp"), (2, "ddp"), (2, "fsdp")])
def test_a_run_whose_folder_was_taken_over_stops_and_writes_nothing_more(
    byte_data, tmp_path, world, mode
):
    full, run_dir = tmp_path / "full", tmp_path / "run"
    h.check_ok(h.wait_all(h.spawn(args(byte_data, full, mode), world=world), h.TIMEOUT))
    results = h.wait_all(
        h.spawn(args(byte_data, run_dir, mode), world=world, GPTRAIN_FAULT="lock_taken@5"),
        h.TIMEOUT,
    )
    for rank, (rc, _, err) in enumerate(results):
        lines = [x for x in err.splitlines() if x.startswith("gptrain: error:")]
        assert rc == 2 and "Traceback" not in err and len(lines) == 1, (rank, err[-3000:])
        want = "run folder" if rank == 0 else "rank 0: another job took over the run folder"
        assert want in lines[0] and "took over" in lines[0], lines
    taken = json.loads((run_dir / ".lock").read_text())
    assert taken["what"] == "a drill's job" and taken["host"].endswith("-drill")
    assert checkpoint.latest(run_dir).name == "step_00000004"
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step"))
    assert ckpts == ["step_00000002", "step_00000004"]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) == 4
    assert not (run_dir / "summary.json").exists()
    ledger = [json.loads(x) for x in (run_dir / "attempts.jsonl").read_text().splitlines()]
    assert [r["event"] for r in ledger if r["event"] in ("start", "end")] == ["start"]

    # the other job still holds the folder (its heartbeat moves): refused, nothing written
    before = sorted(p.name for p in run_dir.rglob("*"))
    with beating(run_dir / ".lock"):
        rerun = h.spawn(args(byte_data, run_dir, mode), world=world)
        rc, _, err = h.wait_all(rerun, h.TIMEOUT)[0]
    assert rc == 2 and "is in use by a drill's job" in err, err[-2000:]
    assert sorted(p.name for p in run_dir.rglob("*")) == before

    # that job gone (its lock removed), the same command resumes from step 4
    (run_dir / ".lock").unlink()
    h.check_ok(h.wait_all(h.spawn(args(byte_data, run_dir, mode), world=world), h.TIMEOUT))
    a, b = h.checkpoint_tensors(full), h.checkpoint_tensors(run_dir)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k

"""Ranks that wait for the main process's I/O wait on the I/O group, within its budget
(runtime.IO_TIMEOUT_S), not dist.timeout_s: 2 ranks (gloo, DDP) with dist.timeout_s = 5, where
rank 0's resume verification, its restore read and its full checkpoint write each take longer
than that (slowed down here), resume, train and save without a time-out. Also run as a script:
one rank of those runs, its main-process I/O slowed by GPTRAIN_TEST_SLOW_IO_S seconds."""

import os
import sys
import time

import pytest

pytestmark = pytest.mark.slow

SLOW_S = 2.5  # each slowed step takes this long: more than dist.timeout_s
TIMEOUT_S = 2


def test_peers_wait_for_main_process_io_beyond_dist_timeout(byte_data, tmp_path):
    """A step-2 checkpoint (one process), resumed by 2 ranks to step 3: rank 0's verification,
    read and save are each slowed beyond dist.timeout_s."""
    import dist_helpers as h
    from train_helpers import run

    from gptrain.checkpoint import manager as checkpoint

    run_dir = tmp_path / "run"
    common = [f"--dist.timeout_s={TIMEOUT_S}", "--train.micro_batch_size=4", *h.FAST]
    common += ["--checkpoint.every=2", "--dist.mode=ddp"]
    run(byte_data, run_dir, *(o.removeprefix("--") for o in common), "train.max_steps=2")
    argv = [__file__, "train", "--config", h.DEBUG, f"--data.dir={byte_data}"]
    argv += [f"--run.dir={run_dir}", *common, "--train.max_steps=3"]
    t0 = time.monotonic()
    results = h.wait_all(h.spawn(argv, GPTRAIN_TEST_SLOW_IO_S=SLOW_S), h.TIMEOUT)
    h.check_ok(results)
    assert time.monotonic() - t0 > 3 * SLOW_S  # the verification, the read and the save
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000002'}" in results[0][1]
    assert checkpoint.load_meta(checkpoint.latest(run_dir))["step"] == 3


def slowed(fn, seconds: float):
    """fn, its first call in this process taking `seconds` longer."""
    calls = []

    def slow(*args, **kwargs):
        if not calls:
            calls.append(1)
            time.sleep(seconds)
        return fn(*args, **kwargs)

    return slow


if __name__ == "__main__":  # a rank of the runs above
    from gptrain.__main__ import exit_quickly, main
    from gptrain.checkpoint import folder, full, retention

    seconds = float(os.environ.get("GPTRAIN_TEST_SLOW_IO_S", "0"))
    full._write_folder = slowed(full._write_folder, seconds)  # a full save's write and hash
    retention.problem = slowed(retention.problem, seconds)  # resume verification
    folder.load_state = slowed(folder.load_state, seconds)  # a full restore's read
    exit_quickly(main(sys.argv[1:]))

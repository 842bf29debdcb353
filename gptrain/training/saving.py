"""The training loop's checkpoint phases, as functions of one Run (training/run.py): save (and
with checkpoint.async, publish at the next save), publish (rename into place, `latest`, retention),
and roll back (train.nonfinite or train.spike = rollback: reload the newest valid checkpoint and
move the data cursor past the bad batch). Every checkpoint goes through checkpoint.manager.
"""

from __future__ import annotations

import time

from gptrain.checkpoint import manager as checkpoint
from gptrain.distributed import runtime as dist
from gptrain.training.guards import NonFiniteStop
from gptrain.training.run import Run


def publish(run: Run):
    """Collective: complete the pending save (rename, `latest`), then retention; its path."""
    done, run.pending = run.pending, None
    if done is None:
        return None
    path = done.wait()
    c = run.cfg.checkpoint
    dist.on_main(
        run.info, lambda: checkpoint.prune(run.cfg.run.dir, done.step, c.keep_last, c.keep_every)
    )
    run.logger.text(f"step {done.step}: checkpoint {path}")
    return path


def save(run: Run, wait: bool):
    """Checkpoint run.step; with checkpoint.async and not `wait`, it completes at the next save."""
    publish(run)  # at most one save pending: the previous one first
    state = {
        "step": run.step,
        "tokens": run.tokens,
        "elapsed_s": run.elapsed_before + time.perf_counter() - run.t_start,
        "skipped": run.nonfinite.count(),
        "rollbacks": run.rollbacks,
        "spikes": run.spikes.state_dict(),
    }
    run.pending = checkpoint.save(  # DCP shards under FSDP2, else a full checkpoint
        run.cfg.run.dir,
        run.step,
        run.model,
        run.optimizer,
        run.loader,
        state,
        {**run.meta, "tokens": run.tokens, **run.best},
        run.info,
        background=run.cfg.checkpoint.async_,
        io_threads=run.cfg.checkpoint.io_threads,
    )
    return publish(run) if wait or not run.cfg.checkpoint.async_ else None


def roll_back(
    run: Run, bad_step: int, step: int, why: str = "non-finite loss or gradient norm"
) -> None:
    """train.nonfinite or train.spike = rollback (collective): reload the newest valid checkpoint and move the data
    cursor past the batch of `bad_step` (the steps since the checkpoint are trained again on the
    data that follows it); run.step and run.tokens become the checkpoint's."""
    per_step = run.cfg.train.total_batch_size // run.cfg.train.seq_len  # windows per step
    past_bad = run.loader.windows_consumed - (step - bad_step) * per_step
    ckpt, _ = dist.from_main(run.info, lambda: checkpoint.resume_point(run.cfg.run.dir, "auto"))
    if ckpt is None:
        raise NonFiniteStop(
            f"step {bad_step}: {why} and the policy is rollback, but there is no checkpoint to roll back to yet; "
            "lower optim.lr or save earlier (checkpoint.every)"
        )
    meta = dist.from_main(run.info, lambda: checkpoint.load_meta(ckpt))
    ts = checkpoint.restore(ckpt, meta, run.model, run.optimizer, run.loader, run.info)
    run.nonfinite.set_count(ts.get("skipped", 0))
    run.spikes.rewind(ts.get("spikes"))
    run.loader.skip_windows(past_bad - run.loader.windows_consumed)
    run.logger.rewind(ts["step"])  # the steps after the checkpoint are logged again
    run.logger.text(
        f"step {bad_step}: {why}; rolled back to {ckpt.name}, data cursor moved past step {bad_step}'s batch"
    )
    run.step, run.tokens = ts["step"], ts["tokens"]

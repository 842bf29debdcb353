"""The one entry point for checkpoints: the training loop, the guards and the commands call this
module, never a backend. It picks the backend: sharded (DCP, dcp.py) when the model's parameters
are sharded (distributed.parallelize.is_sharded, the one answer to "is this run sharded?"), else a
full checkpoint written by the main process (full.py); on load, the folder's meta.json says which.

    plan = manager.plan_resume(run_dir, "auto", config_text)  # main: what a start resumes
    manager.begin(run_dir, plan)                     # main, once start-up succeeded
    pending = manager.save(run_dir, step, model, optimizer, loader, train_state, meta, info)
    pending.wait()                                   # every rank; publishes it
    ckpt, skipped = manager.resume_point(run_dir, "auto")
    train_state = manager.restore(ckpt, manager.load_meta(ckpt), model, optimizer, loader, info)
"""

from __future__ import annotations

from pathlib import Path

from gptrain.checkpoint import dcp, folder, full, lock, mirror, retention
from gptrain.config.sections import DistConfig
from gptrain.distributed import faults
from gptrain.distributed import runtime as gdist
from gptrain.distributed.parallelize import is_sharded, shards
from gptrain.errors import UserError, first_line

# the folder contract's read-only helpers and the retention rules, re-exported so that callers
# need this module only
find = folder.find
latest = folder.latest
load_meta = folder.load_meta
load_state = folder.load_state
pointer = folder.pointer
shared_parameters = folder.shared_parameters
FORMAT = folder.FORMAT
TOKENIZER_FILE = folder.TOKENIZER_FILE
problem = retention.problem
Plan = retention.Plan
IOFailure = gdist.IOFailure  # a checkpoint write or publish that failed: one line on every rank
configure_mirror = mirror.configure  # checkpoint.mirror (main process, before training)
LockLost = lock.LockLost  # another job took over the run folder's lock: this one writes no more
RunLock = lock.RunLock  # a run folder has one owner: `with RunLock(run_dir, "gptrain train"):`


def resume_point(run_dir, resume: str) -> tuple[Path | None, list[str]]:
    """retention.resume_point, looking at the mirror too (when one is configured): under auto or
    latest, a verified remote checkpoint of the run's timeline newer than every valid local one
    is fetched first."""
    warnings = _fetch(run_dir) if resume in ("auto", "latest") else []
    path, skipped = retention.resume_point(run_dir, resume)
    return path, warnings + skipped


def plan_resume(run_dir, resume: str, command: str) -> retention.Plan:
    """Main process, at start-up: what this start resumes (retention.plan: resume = STEP acts
    once, on a new timeline), the mirror looked at as in resume_point. `command`: the run's
    resolved config as text; its keys that can change training identify the timeline
    (config/identity.py), so a requeue on other nodes continues it. Writes nothing but a mirror
    download."""
    warnings = _fetch(run_dir) if resume in ("auto", "latest") else []
    plan = retention.plan(run_dir, resume, command)
    plan.warnings = warnings + plan.warnings
    return plan


def begin(run_dir, plan: retention.Plan) -> None:
    """Main process, once start-up succeeded (nothing is written for a bad input): the run's
    timeline recorded locally and on the mirror; after a resume = STEP that branches, `latest`
    names that step's checkpoint until the new timeline's first save."""
    retention.begin(run_dir, plan)
    m = mirror.active()
    if m is None:
        return
    try:
        m.record_timeline(plan.timeline)
    except Exception as e:  # noqa: BLE001 any filesystem's error: network, credentials
        raise gdist.IOFailure(
            f"rank 0: cannot record the run's timeline on checkpoint.mirror = {m.url!r} ({type(e).__name__}: {first_line(e)}); nothing was trained; check the mirror and run the same command"
        ) from None


def _fetch(run_dir) -> list[str]:
    if mirror.active() is None:
        return []
    try:
        local, _ = retention.resume_point(run_dir, "auto")
    except UserError:  # every local checkpoint is damaged
        local = None
    step = folder.load_meta(local)["step"] if local is not None else None
    return mirror.fetch_newer(run_dir, step)


def prune(run_dir, newest: int, keep_last: int, keep_every: int) -> list[str]:
    """Local retention; the folder the mirror is uploading is kept until its upload is done."""
    busy = mirror.active().busy if mirror.active() is not None else None
    return retention.prune(run_dir, newest, keep_last, keep_every, protect={busy} - {None})


def wait_mirror() -> list[str]:
    """The end of a run or a preemption stop: the upload in flight (if any) completes. Returns
    the uploads that failed during the run (their remote `latest` stayed where it was)."""
    if mirror.active() is None:
        return []
    mirror.active().wait()
    return mirror.active().errors


class Pending:
    """A checkpoint that is not published yet: `wait()` (collective, once) completes it (every
    rank's files written and hashed, meta.json, the rename into place, `latest`) and returns its
    folder on the main process. Under checkpoint.async the shards are being written meanwhile."""

    def __init__(self, step: int, finish) -> None:
        self.step, self._finish = step, finish

    def wait(self) -> Path | None:
        path = self._finish()
        if path is not None and mirror.active() is not None:  # main: upload in the background
            mirror.active().submit(path)
        return path


def background_saves(requested: bool, cfg: DistConfig, info) -> bool:
    """checkpoint.async, decided once per start: True where this run's checkpoints are sharded
    (DCP, FSDP2 on 2+ processes) and torch has DCP's async_save; False when not requested; else
    one line, before anything is written."""
    import torch
    import torch.distributed.checkpoint as torch_dcp

    if requested and not hasattr(torch_dcp, "async_save"):
        raise UserError(
            f"checkpoint.async = true needs torch.distributed.checkpoint.async_save; this is torch {torch.__version__}: upgrade torch or use checkpoint.async=false"
        )
    if requested and not shards(cfg, info):
        raise UserError(
            f"checkpoint.async = true but this run (dist.mode = {cfg.mode!r}, {info.world_size} process(es)) writes full checkpoints: background saving applies only to the sharded (DCP) checkpoints of FSDP2 runs with 2+ processes; use checkpoint.async=false"
        )
    return requested


def save(
    run_dir, step, model, optimizer, loader, train_state, meta, info, background=False, io_threads=0
):
    """Collective: a checkpoint of every stateful part; sharded (DCP) for an FSDP2 model, else a
    full one, written and hashed by folder.io_threads(io_threads) threads per process. Returns a
    Pending save; call its wait() (every rank) to publish it. background (checkpoint.async,
    sharded only): written from a thread while training goes on."""
    faults.stall_save(step)  # GPTRAIN_FAULT=stall_save@STEP: the write blocks (a stuck disk)
    threads = folder.io_threads(info.local_world_size, io_threads)
    args = (run_dir, step, model, optimizer, loader, train_state, meta, info)
    if is_sharded(model):
        return Pending(step, dcp.save_training(*args, background=background, threads=threads))
    path = full.save_training(*args, threads=threads)
    return Pending(step, lambda: path)


def restore(ckpt_dir, meta: dict, model, optimizer, loader, info) -> dict:
    """Collective: load any checkpoint (full or DCP, written on any world size) into (possibly
    wrapped) parts. Returns the saved train_state."""
    if meta.get("layout") == dcp.LAYOUT:
        return dcp.restore_training(ckpt_dir, meta, model, optimizer, loader, info)
    return full.restore_training(ckpt_dir, model, optimizer, loader, info)


def load_model_state(ckpt_dir: str | Path, device: str = "cpu") -> tuple[dict, dict]:
    """(full model state dict, meta) of any checkpoint folder, every file verified first (a DCP
    one is gathered on this process): what `sample` and `export` read."""
    meta = folder.load_meta(ckpt_dir)
    if meta.get("layout") == dcp.LAYOUT:
        return dcp.load_full_model_state(ckpt_dir, meta, device), meta
    return full.load_model_state(ckpt_dir, device)

"""Fault injection for tests and users' own drills: `GPTRAIN_FAULT=KIND@STEP[/RANK],...`.

    GPTRAIN_FAULT=hang@50             every rank's step 50 sleeps forever (the watchdog's case)
    GPTRAIN_FAULT=crash@51/1          rank 1 exits 1 inside step 51 (no clean-up, like a segfault)
    GPTRAIN_FAULT=spike@60            step 60's loss and gradients x 20 (a finite loss spike)
    GPTRAIN_FAULT=stall_save@100/0    rank 0's checkpoint write of step 100 blocks forever
    GPTRAIN_FAULT=publish_error@8/0   rank 0's publish of step 8's checkpoint fails (ENOSPC)
    GPTRAIN_FAULT=eval_error@20       the evaluation at step 20 raises
    GPTRAIN_FAULT=kill_eval@24/1      rank 1 SIGKILLs itself inside the evaluation at step 24
    GPTRAIN_FAULT=kill_save@8         rank 0 SIGKILLs itself while step 8's checkpoint is written:
                                      every file is in its temporary folder, not yet published
    GPTRAIN_FAULT=perturb@5/1         after step 5's update, rank 1 moves one weight by one ulp (a
                                      replica that drifted: the next checkpoint's replica check)
    GPTRAIN_FAULT=lock_taken@7        at the start of step 7, another host's job takes over the run
                                      folder's lock and the main process's heartbeat notices (as a
                                      requeued job would, after this one's heartbeat was late)
    GPTRAIN_FAULT=step_time@0.25      every step counts as 0.25 s of training time (train.time_budget's
                                      clock made deterministic; step_time@1.5/1: rank 1's only)
    GPTRAIN_FAULT=facts@64/1          rank 1 reports another device to the speed choices: no FP8,
                                      no native bf16, 64 MiB of memory (training/facts.py)

STEP is the optimizer step being trained (1 is the first), for step_time a number of seconds
(> 0); without /RANK a fault fires on every rank. A fault fires the first time its step is trained in a process (a `spike` rolled back past
does not come back), and again in a new process that trains that step (a run resumed from before
it). Unset or empty, nothing here costs anything: `in_step` returns one shared null context and
`stall_save`, `publish_error`, `kill_save`, `eval_error` and `kill_eval` return at once, and
`step_seconds` returns None. An
unknown kind or a malformed entry is one line (UserError, exit 2) before anything starts. `install` is called once per
process by `gptrain train`; the loop, the evaluator and the checkpoint code ask this module at
their spots.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import signal
import sys
import time
from dataclasses import dataclass

import torch

from gptrain.errors import UserError

ENV = "GPTRAIN_FAULT"
KINDS = (
    "hang",
    "crash",
    "spike",
    "stall_save",
    "publish_error",
    "kill_save",
    "eval_error",
    "kill_eval",
    "perturb",
    "lock_taken",
    "step_time",
    "facts",
)
SPIKE_FACTOR = 20.0
_NULL = contextlib.nullcontext()


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int | float  # step_time: seconds
    rank: int | None  # None: every rank


def _number(kind: str, text: str) -> int | float | None:
    """The entry's STEP (an integer >= 1), or for step_time its seconds (> 0, finite); None: bad."""
    if kind != "step_time":
        return int(text) if text.isdigit() and int(text) >= 1 else None
    try:
        seconds = float(text)
    except ValueError:
        return None
    return seconds if 0 < seconds < float("inf") else None


def parse(spec: str) -> list[Fault]:
    """`KIND@STEP[/RANK],...` -> faults; a UserError naming the entry and the fix otherwise."""
    faults = []
    for entry in (e.strip() for e in spec.split(",")):
        if not entry:
            continue
        kind, at, rest = entry.partition("@")
        step, slash, rank = rest.partition("/")
        fix = f"use KIND@STEP[/RANK] with KIND one of {', '.join(KINDS)}, e.g. {ENV}=hang@5/1"
        if kind not in KINDS:
            raise UserError(f"{ENV} = {spec!r}: unknown fault kind {kind!r} in {entry!r}; {fix}")
        number = _number(kind, step) if at else None
        if number is None or (slash and not rank.isdigit()):
            raise UserError(
                f"{ENV} = {spec!r}: malformed entry {entry!r} (STEP >= 1, step_time's seconds > 0, RANK >= 0); {fix}"
            )
        faults.append(Fault(kind, number, int(rank) if slash else None))
    return faults


_active: dict[tuple[str, int], bool] = {}  # (kind, step) -> fires on this rank
_step_time: float | None = None  # step_time: the seconds every step of this rank counts as
_take_lock = None  # lock_taken: how the run folder's lock is taken over (register_lock)


def register_lock(take_over) -> None:
    """lock_taken: `take_over()` has another job take over the run folder's lock, as the main
    process's heartbeat would then see it (checkpoint/lock.py's `drill_take_over`)."""
    global _take_lock
    _take_lock = take_over


def install(rank: int, env=os.environ) -> None:
    """Read GPTRAIN_FAULT for this process (rank); raises UserError when it is malformed."""
    global _step_time
    _active.clear()
    _step_time = None
    for f in parse(env.get(ENV, "")):
        if f.rank is not None and f.rank != rank:
            continue
        if f.kind == "step_time":
            _step_time = f.step
        else:
            _active[(f.kind, f.step)] = True


def step_seconds() -> float | None:
    """step_time: the training time each step of this rank counts as (None: the clock's)."""
    return _step_time


def fires(kind: str, step: int) -> bool:
    return bool(_active) and (kind, step) in _active


def _announce(what: str) -> None:
    print(f"gptrain: fault injection ({ENV}): {what}", file=sys.stderr, flush=True)


def _kill(what: str) -> None:
    """Announce, then SIGKILL this process: no handler, no clean-up, no flush of anything else
    (as the OOM killer or a scheduler's hard kill)."""
    _announce(f"{what}: SIGKILL")
    os.kill(os.getpid(), signal.SIGKILL)


def in_step(step: int, model):
    """The context the loop trains optimizer step `step` in: hang, crash and lock_taken act on
    entry, spike
    multiplies the model's loss (hence every gradient) by SPIKE_FACTOR through a forward hook on
    the plain model (under DDP and FSDP2 too) for this step only, perturb moves the first element
    of the model's first parameter by one ulp on exit (after the step's update)."""
    if not _active:
        return _NULL
    if fires("crash", step):
        _announce(f"crash at step {step}: exit 1")
        os._exit(1)  # as a segfault or an OOM kill: no handler, no clean-up
    if fires("hang", step):
        _announce(f"hang at step {step}: sleeping forever")
        while True:
            time.sleep(3600)
    if fires("lock_taken", step):
        del _active[("lock_taken", step)]
        if _take_lock is not None:  # the process that holds the lock (the main one)
            _announce(f"another job takes over the run folder's lock at step {step}")
            _take_lock()
    if fires("spike", step):
        del _active[("spike", step)]  # once per process: a rollback past it does not meet it again
        return _spiked(model)
    if fires("perturb", step):
        del _active[("perturb", step)]
        return _perturbed(model, step)
    return _NULL


@contextlib.contextmanager
def _perturbed(model, step: int):
    yield
    name, p = next(iter(model.named_parameters()))
    local = p.detach()  # a plain tensor (DDP, one process); FSDP2: this rank's shard
    flat = (local.to_local() if hasattr(local, "to_local") else local).view(-1)
    flat[:1] = torch.nextafter(flat[:1], torch.full_like(flat[:1], math.inf))
    _announce(f"perturb at step {step}: {name}[0] moved by one ulp on this rank")


@contextlib.contextmanager
def _spiked(model):
    def times_factor(module, args, out):
        logits, loss = out
        return logits, None if loss is None else loss * SPIKE_FACTOR

    handle = model.register_forward_hook(times_factor)
    try:
        yield
    finally:
        handle.remove()


def stall_save(step: int) -> None:
    """Called where a checkpoint write begins: `stall_save` blocks it forever (a stuck disk)."""
    if fires("stall_save", step):
        _announce(f"stall_save at step {step}: the checkpoint write blocks forever")
        while True:
            time.sleep(3600)


def publish_error(step: int, path) -> None:
    """Called where this rank's part of publishing checkpoint `step` writes `path` (rank 0: the
    `latest` pointer, after the folder's rename; under FSDP2 every other rank: before hashing its
    shards): `publish_error` raises OSError ENOSPC there, once per process (a full disk)."""
    if fires("publish_error", step):
        del _active[("publish_error", step)]
        _announce(f"publish_error at step {step}: {path} fails with ENOSPC")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def eval_error(step: int) -> None:
    """Called at the start of the evaluation at `step`: `eval_error` raises a RuntimeError there,
    once per process (an evaluation that runs out of memory)."""
    if fires("eval_error", step):
        del _active[("eval_error", step)]
        raise RuntimeError(f"fault injection ({ENV}): eval error at step {step}")


def kill_save(step: int | None) -> None:
    """Called where the folder of checkpoint `step` is published (folder.publish, which rank 0
    runs for full and sharded checkpoints alike: every file is written in its temporary folder,
    not renamed yet) and, in the sharded path, on every other rank once its shards are written.
    `kill_save` SIGKILLs the process there: the previous checkpoint stays named in `latest`, and
    the temporary folder is left behind, invisible to resume. (`step` None: a mirror's
    download, never hit.)"""
    if step is not None and fires("kill_save", step):
        _kill(f"kill_save at step {step}: checkpoint written, not published")


def kill_eval(step: int) -> None:
    """Called at the start of the evaluation at `step`, beside eval_error: `kill_eval` SIGKILLs
    the process there (a process killed during an evaluation)."""
    if fires("kill_eval", step):
        _kill(f"kill_eval at step {step}: killed inside the evaluation")

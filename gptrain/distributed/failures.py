"""When a peer fails: one line naming this rank, the operation and the peers that are gone; and
when replicas differ (`ReplicaMismatch`, exit 5: gptrain/distributed/replicas.py).

dist.init keeps the rendezvous store here (`keep_store`). After a collective fails, `failure()`
asks the store which peers still check in (`alive/RANK` marks) and turns the error into a
`DistFailure`; at a clean exit `leave()` lets the rank hosting the store leave last (`left/RANK`
marks). Under NCCL, `nccl_error_handling` makes a dead or stuck peer a Python exception, as
under gloo. Imported by dist.py (never the other way round).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import time
import traceback

import torch.distributed as dist

from gptrain.errors import first_line

_store: dist.Store | None = None  # the rendezvous store, kept to tell dead peers from live ones
_store_host_is_rank0 = False


def keep_store(store, host_is_rank0: bool) -> None:
    """Remember the (prefixed) rendezvous store of this run for failure() and leave()."""
    global _store, _store_host_is_rank0
    _store, _store_host_is_rank0 = store, host_is_rank0


def nccl_error_handling(env=os.environ) -> None:
    """Make a dead or stuck peer under NCCL end like under gloo: a Python exception within
    dist.timeout_s (then `failure()` prints one line naming the rank and the peer), not a
    watchdog SIGABRT. TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (CleanUpOnly): on a time-out the watchdog
    aborts the NCCL communicators instead of the process; the collective (or the next one) then
    raises DistBackendError in the training thread. Settings the user made are kept. Blocking wait
    (TORCH_NCCL_BLOCKING_WAIT) is not used: it would stall the CPU on every FSDP2 all-gather.
    Not run on a GPU yet (no machine); the choice follows torch's ProcessGroupNCCL.hpp."""
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


@contextlib.contextmanager
def muted_stderr():
    """Silence file descriptor 2 (torch's C++ logging) for a block; our own message follows."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class DistFailure(RuntimeError):
    """A collective failed: a peer died, stopped responding past dist.timeout_s, or diverged."""


EXIT_DIVERGED = 5  # `gptrain train`'s exit code when the replicas differ (ReplicaMismatch)


class ReplicaMismatch(Exception):
    """Ranks that should hold the same state do not (gptrain/distributed/replicas.py): raised on
    every rank with the same line, before the step's checkpoint is written; exit EXIT_DIVERGED."""


def _operation(e: BaseException) -> str:
    """The failed operation: the innermost gptrain source line the error passed through."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the gptrain package
    frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename.startswith(here)]
    if not frames:
        return "a collective"
    f = frames[-1]
    what = f"`{(f.line or '').strip()}` in {f.name} ({os.path.basename(f.filename)}:{f.lineno})"
    if "backward" in (f.line or ""):
        what += " (gradient all-reduce / reduce-scatter)"
    elif "wrapped(" in (f.line or "") or "model(" in (f.line or ""):
        what += " (forward: DDP's start-of-step collectives or FSDP's parameter all-gather)"
    return what


def unresponsive_peers(info, wait_s: float = 3.0) -> list[int] | None:
    """After a failed collective: the ranks that do not check in on the rendezvous store within
    wait_s (dead or stuck), or None when the store itself is gone (its host died)."""
    if _store is None:
        return None
    try:
        with muted_stderr():  # the store client logs C++ stack traces when its host is gone
            return _poll_alive(info, wait_s)
    except (RuntimeError, OSError):
        return None


def _poll_alive(info, wait_s: float) -> list[int]:
    _store.set_timeout(datetime.timedelta(seconds=wait_s))
    _store.set(f"alive/{info.rank}", "1")
    deadline = time.monotonic() + wait_s
    while True:
        others = [r for r in range(info.world_size) if r != info.rank]
        missing = [r for r in others if not _store.check([f"alive/{r}"])]
        if not missing or time.monotonic() > deadline:
            return missing
        time.sleep(0.1)


def failure(e: BaseException, info) -> DistFailure | None:
    """Describe a RuntimeError raised while training with peers: a DistFailure naming this rank,
    the operation and the peers that no longer answer, or None when `e` is not a peer failure
    (every peer still answers and it is not a torch.distributed error: a plain bug, re-raise it)."""
    peers = unresponsive_peers(info)
    if peers == [] and not isinstance(e, dist.DistError):
        return None
    if peers is None:
        host = "rank 0, its host," if _store_host_is_rank0 else "the process or node hosting it"
        who = f"the rendezvous store does not answer ({host} is gone)"
    elif peers:
        who = f"rank {', '.join(map(str, peers))} does not answer (dead or stuck)"
    else:
        who = "every peer still answers (a desynchronised collective?)"
    return DistFailure(
        f"rank {info.rank} of {info.world_size}: {_operation(e)} failed: {who}; {first_line(e)}"
    )


def leave(rank: int, world: int, wait_for_peers: bool, timeout_s: float) -> None:
    """After the process group is destroyed: after a clean run the rank hosting the store (rank 0
    when started without torchrun's agent) waits for every other rank's `left/` mark, so no peer
    loses the store mid-teardown. After a failure (wait_for_peers=False) nobody waits."""
    global _store
    store, _store = _store, None
    if store is None or not wait_for_peers or world == 1:
        return
    with contextlib.suppress(RuntimeError, OSError), muted_stderr():
        if _store_host_is_rank0 and rank == 0:
            store.set_timeout(datetime.timedelta(seconds=timeout_s))
            store.wait([f"left/{r}" for r in range(1, world)])
        else:
            store.set(f"left/{rank}", "1")

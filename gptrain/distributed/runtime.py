"""Everything distributed at run time: who am I (DistInfo), process group, wrap_model, collectives.

torchrun (or `gptrain train --dist.nproc_per_node=N`, which calls torch's own elastic launcher)
starts one process per device and sets RANK / LOCAL_RANK / WORLD_SIZE / LOCAL_WORLD_SIZE.
`DistInfo.from_env()` reads them once; everything else receives the frozen DistInfo. A plain
`python -m gptrain train` is world size 1 and takes the same code path (collectives become no-ops).

Failures never hang: every collective has dist.timeout_s, except those where ranks wait for one
rank's I/O (checkpoints, resume, downloads: `on_main`, `from_main`, `local_main_first`), which
run on the I/O group (`io_group`) within IO_TIMEOUT_S, and end at once on every rank when that I/O
fails. A rendezvous that cannot be reached is a UserError naming the address. A collective that
fails (a peer died, or is stuck past the time-out) becomes a `DistFailure` naming this rank, the
operation, and the peers that no longer answer on the rendezvous store
(gptrain/distributed/failures.py).
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gptrain.config.sections import DistConfig
from gptrain.distributed import failures
from gptrain.errors import UserError, first_line


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: str = "cpu"  # "cpu" or "cuda:LOCAL_RANK"
    launched: bool = False  # True under torchrun (a process group will be initialised)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    @staticmethod
    def from_env(device: str = "auto") -> DistInfo:
        """Read torchrun's environment; device 'auto' means cuda:LOCAL_RANK when CUDA is present."""
        env = os.environ
        launched = "RANK" in env and "WORLD_SIZE" in env
        rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
        local_rank = int(env.get("LOCAL_RANK", 0))
        local_world = int(env.get("LOCAL_WORLD_SIZE", 1))
        use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
        if use_cuda:
            if not torch.cuda.is_available():
                raise UserError(
                    "train.device = 'cuda' but no CUDA device is available; use train.device=auto or cpu"
                )
            if local_rank >= torch.cuda.device_count():
                raise UserError(
                    f"local rank {local_rank} has no GPU: this machine has {torch.cuda.device_count()}; use --nproc_per_node <= {torch.cuda.device_count()}"
                )
            dev = f"cuda:{local_rank}"
        else:
            dev = "cpu"
            if launched and local_world > cpu_cores():
                raise UserError(
                    f"{local_world} processes on this machine (--nproc_per_node) but it has {cpu_cores()} CPU cores and no GPU; use --nproc_per_node <= {cpu_cores()}"
                )
        return DistInfo(rank, local_rank, world, local_world, dev, launched)


def cpu_cores() -> int:
    """CPU cores this process may run on (its affinity mask, e.g. inside a container)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def init(info: DistInfo, backend: str = "auto", timeout_s: int = 300) -> None:
    """Initialise the default process group under torchrun (a no-op for a plain single process).

    The rendezvous store is created here (not by `env://`) so that a failure can be described:
    an unreachable MASTER_ADDR:MASTER_PORT is a UserError, and `failure()` can ask it which peers
    are still alive. Under torchrun the store is the agent's (TORCHELASTIC_USE_AGENT_STORE); with
    plain RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT variables rank 0 hosts it.
    """
    if not info.launched or dist.is_initialized():
        return
    if backend == "auto":
        backend = "nccl" if info.device_type == "cuda" else "gloo"
    if backend == "nccl" and info.device_type != "cuda":
        raise UserError(
            "dist.backend = 'nccl' needs CUDA devices; use dist.backend=gloo (or auto) on CPU"
        )
    if info.device_type == "cuda":
        torch.cuda.set_device(info.device)
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = int(os.environ.get("MASTER_PORT", "29500"))
    hosts = info.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        with (
            failures.muted_stderr()
        ):  # retries and time-outs are logged in C++; the UserError says it all
            store = dist.TCPStore(addr, port, info.world_size, is_master=hosts, timeout=timeout)
    except (RuntimeError, OSError) as e:  # DistStoreError / DistNetworkError
        why = first_line(e)
        if hosts:
            raise UserError(
                f"rank 0: not all {info.world_size} processes reached the rendezvous at {addr}:{port} within dist.timeout_s = {timeout_s} s ({why}); start every node with the same --nnodes/--rdzv_endpoint, or raise dist.timeout_s"
            ) from None
        raise UserError(
            f"rank {info.rank}: cannot reach the rendezvous at {addr}:{port} within dist.timeout_s = {timeout_s} s ({why}); check --rdzv_endpoint / MASTER_ADDR:MASTER_PORT, the network, and that the first node is running"
        ) from None
    store = dist.PrefixStore(attempt_prefix(), store)  # a restarted attempt reads no stale keys
    kwargs = {"device_id": torch.device(info.device)} if backend == "nccl" else {}
    if backend == "nccl":
        failures.nccl_error_handling()
    dist.init_process_group(  # with nccl, small CPU-side agreements (flags, hashes) go over gloo
        backend="cpu:gloo,cuda:nccl" if backend == "nccl" else backend,
        store=store,
        rank=info.rank,
        world_size=info.world_size,
        timeout=timeout,
        **kwargs,
    )
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    failures.keep_store(dist.PrefixStore("peers/", store), host_is_rank0=not agent_store)


FRESH_STORE = "GPTRAIN_FRESH_STORE_PER_ROUND"  # set by launch.py for the workers of an elastic job


def attempt_prefix(env=os.environ) -> str:
    """The store prefix of this launch attempt. torchrun's agent keeps one store across restarts
    (--max-restarts; the static rendezvous reuses it), so keys of a failed attempt (rendezvous,
    NCCL unique ids, our alive/left marks) would still be there: each attempt gets its own
    namespace, as torch's env:// rendezvous once did with TORCHELASTIC_RESTART_COUNT. An elastic
    job (FRESH_STORE) gets a new store every round, and its agents, which joined at different
    times, count restarts differently: there every worker uses one namespace."""
    attempt = "0" if env.get(FRESH_STORE) == "1" else env.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"gptrain/attempt_{attempt}/"


def teardown(wait_for_peers: bool = True, timeout_s: float = 60.0) -> None:
    """Destroy the process group; after a clean run, the rank hosting the rendezvous store (rank 0
    when started without torchrun's agent) leaves last, so no peer loses the store mid-teardown.
    After a failure (wait_for_peers=False) nobody waits for peers that may be gone."""
    global _io_group
    _io_group = None
    if not dist.is_initialized():
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    gc.collect()  # DDP/FSDP objects in reference cycles still hold the process group: free them
    dist.destroy_process_group()
    failures.leave(rank, world, wait_for_peers, timeout_s)


# the I/O budget: how long ranks wait for one rank's I/O (a checkpoint's write and hash on a slow
# filesystem, a mirror download); a failure of that I/O ends the wait at once
IO_TIMEOUT_S = 3 * 3600
_io_group = None


def io_group():
    """A gloo process group for the collectives where ranks wait for I/O (checkpoint saves and
    loads, on_main), with its own generous time-out (IO_TIMEOUT_S): writing 19 GB of shards to a
    slow filesystem must not trip dist.timeout_s. Collective on first use (every rank reaches the
    same on_main or checkpoint step); None when no process group is running. Gloo carries only
    small objects (file hashes, DCP plans, error lines)."""
    global _io_group
    if _io_group is None and active():
        timeout = datetime.timedelta(seconds=IO_TIMEOUT_S)
        _io_group = dist.new_group(backend="gloo", timeout=timeout)
    return _io_group


def active() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    """Processes in the default group (1 without one)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce_mean(t: torch.Tensor) -> torch.Tensor:
    """Mean of `t` over all ranks (in place; identity for world size 1)."""
    if active():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        t /= dist.get_world_size()
    return t


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if active():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def any_rank(flag: bool) -> bool:
    """Collective: True when `flag` is set on any rank. One all-reduce of a one-element CPU
    tensor (gloo; under nccl the "cpu:gloo,cuda:nccl" group sends it over gloo): no device sync."""
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    if active():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def barrier() -> None:
    if active():
        dist.barrier()


def local_main_first(info: DistInfo, fn):
    """Run fn on each node's local rank 0 first (e.g. a download into the machine's cache), then
    on the other ranks; an error on any rank is raised on every rank instead of a hang (the
    others wait on the I/O group, see on_main)."""
    result = None
    for turn in (True, False):
        error = None
        if (info.local_rank == 0) == turn:
            result, error = _attempt(fn, info.rank)
        raise_on_every_rank(error)
    return result


def on_main(info: DistInfo, fn, default=None):
    """fn() on the main process only (default elsewhere). The other ranks wait on the I/O group,
    within IO_TIMEOUT_S (main-process I/O: a checkpoint's write and hash, resume verification, a
    mirror download, a restore's read), never dist.timeout_s. What fn raises reaches every rank at
    once: a UserError as a UserError, an OSError or IOFailure as an IOFailure (one line naming the
    rank, the path and the error); any other exception is re-raised where it happened."""
    result, error = _attempt(fn, info.rank) if info.is_main else (default, None)
    raise_on_every_rank(error)
    return result


def from_main(info: DistInfo, fn):
    """fn() on the main process, its (picklable) result sent to every rank: decisions that read
    the run directory, which only the main process is sure to have (no shared filesystem needed)."""
    return broadcast_from_main(on_main(info, fn))


def broadcast_from_main(obj):
    """The main process's `obj` on every rank (identity for world size 1), over the I/O group."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=io_group())
    return box[0]


class IOFailure(RuntimeError):
    """I/O that one rank did failed (a checkpoint's write or publish, a restore's read): every
    rank raises it with the same line, naming the rank, the path and the OS error (exit 1)."""


def _attempt(fn, rank: int) -> tuple:
    """(fn(), None), or (None, (kind, message, exception)) with kind "user" (a UserError), "io"
    (an IOFailure or OSError) or "bug" (anything else, re-raised where it happened)."""
    try:
        return fn(), None
    except UserError as e:
        return None, ("user", str(e), e)
    except IOFailure as e:
        return None, ("io", str(e), e)
    except OSError as e:
        return None, ("io", f"rank {rank}: {type(e).__name__}: {first_line(e)}", e)
    except Exception as e:  # noqa: BLE001 the peers stop too; this rank keeps its traceback
        why = f"{type(e).__name__}: {first_line(e)}"
        return None, ("bug", f"rank {rank} failed ({why}; its traceback is in its stderr)", e)


def raise_on_every_rank(error: tuple | None) -> None:
    """Collective on the I/O group: when any rank has an error (from _attempt), every rank
    raises. The failing rank raises its own exception (an OSError as an IOFailure); the others
    `peer_error` of the first failing rank's."""
    mine = None if error is None else (*error[:2], getattr(error[2], "exit_code", 2))
    errors = [mine]
    if active():
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, mine, group=io_group())
    first = next(((r, e) for r, e in enumerate(errors) if e is not None), None)
    if first is None:
        return
    if error is not None:
        if isinstance(error[2], OSError):
            raise IOFailure(error[1]) from error[2]
        raise error[2]
    raise peer_error(first[0], *first[1])


def peer_error(rank: int, kind: str, message: str, exit_code: int = 2) -> Exception:
    """What a rank raises for another rank's error: its bad input as a UserError with its exit
    code ("another rank failed (rank R): ..."), anything else as an IOFailure with its line."""
    if kind != "user":
        return IOFailure(message)
    e = UserError(f"another rank failed (rank {rank}): {message}")
    e.exit_code = exit_code
    return e


def check_same_config(config_text: str, info: DistInfo) -> None:
    """Every rank (and so every node) must run the same config: compare hashes at start-up."""
    if not active():
        return
    mine = hashlib.sha256(config_text.encode()).hexdigest()[:16]
    hashes: list[str] = [""] * info.world_size
    dist.all_gather_object(hashes, mine)
    if len(set(hashes)) > 1:
        odd = [r for r, h in enumerate(hashes) if h != hashes[0]]
        raise UserError(
            f"config differs between ranks (rank 0 hash {hashes[0]}, rank {odd[0]} hash {hashes[odd[0]]}); give every node the same config file and overrides"
        )


def check_options(cfg_dist: DistConfig, accum: int, info: DistInfo, trial: bool = False) -> None:
    """Refuse [dist] settings that torch cannot run correctly (on every rank, before training).
    `trial`: micro-batch trial steps will run (train.micro_batch_size = auto on a GPU); DDP runs
    them in no_sync()."""
    if not (cfg_dist.mode == "ddp" and cfg_dist.static_graph and info.world_size > 1):
        return
    bug = "hits a PyTorch DDP bug (static_graph + no_sync(): pytorch/pytorch#143580, crashes or stops syncing gradients)"
    if trial:
        raise UserError(
            f"dist.static_graph = true with train.micro_batch_size = auto on a GPU {bug}: its trial steps run in no_sync(); "
            "give train.micro_batch_size a number, or use dist.static_graph=false"
        )
    if accum > 1:
        raise UserError(
            f"dist.static_graph = true with gradient accumulation ({accum} micro-steps) {bug}; "
            "use dist.static_graph=false, or a total_batch_size with accumulation 1"
        )

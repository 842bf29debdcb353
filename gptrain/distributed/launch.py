"""Starting the workers: `gptrain train --dist.nproc_per_node=N|auto [--dist.nnodes=M ...]`.

Outside torchrun, gptrain re-runs itself as N workers per machine through torch's own elastic
launcher, `torch.distributed.run` (never a home-made spawn): standalone on one machine, or one of
dist.nnodes machines meeting at a c10d rendezvous (the same command runs on every node). With
dist.nnodes = MIN:MAX the job is elastic: torch's agent re-forms the worker group when a node is
lost or joins, and the workers resume from the last checkpoint on the new world size. Bad
input (more processes than devices, an endpoint that cannot be resolved or reached) is a one-line
UserError before anything starts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time

import torch

from gptrain.config.sections import DistConfig
from gptrain.distributed import store as rdzv_store
from gptrain.distributed.runtime import FRESH_STORE, cpu_cores
from gptrain.distributed.store import Host
from gptrain.errors import UserError, first_line

FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1")  # torchrun's defaults + USR1
# the workers' exit codes: watchdog.EXIT_CODE, attempts.EXIT_CRASH_LOOP, failures.EXIT_DIVERGED
HUNG, CRASH_LOOP, DIVERGED = 3, 4, 5
ELASTIC_RESTARTS = 100  # an elastic job's worker-group restarts (a lost node costs one; the
# restart ledger's crash-loop stop, exit 4, ends a real crash loop long before)


def node_range(spec: int | str) -> tuple[int, int]:
    """dist.nnodes (N or MIN:MAX, checked by DistConfig.check) -> (MIN, MAX)."""
    low, _, high = str(spec).partition(":")
    return int(low), int(high or low)


SHUTDOWN_S = 120  # seconds the workers get to save after a forwarded signal
TORCH_SHUTDOWN_S = 30  # what they get where torch.distributed.run has no --shutdown-timeout


def supported(options: list[str]) -> list[str]:
    """The options this torch's torch.distributed.run accepts: older releases lack some (torch
    2.11 has no --shutdown-timeout), and an unknown one stops the launcher with a usage message."""
    from torch.distributed import run as torch_run

    _, unknown = torch_run.get_args_parser().parse_known_args([*options, "script.py"])
    return [o for o in options if o not in unknown]


def nproc_for(spec: str) -> int:
    """dist.nproc_per_node → a number: 'auto' (the default) is every GPU of this machine, or 1
    without CUDA; a number is checked against the GPUs, or the CPU cores without CUDA."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if spec == "auto":
        return max(gpus, 1)
    n = int(spec)
    if gpus and n > gpus:
        raise UserError(
            f"dist.nproc_per_node = {n} but this machine has {gpus} GPUs; use at most {gpus} or auto"
        )
    if not gpus and n > cpu_cores():
        raise UserError(
            f"dist.nproc_per_node = {n} but this machine has {cpu_cores()} CPU cores and no GPU; use at most {cpu_cores()} or auto"
        )
    return n


def _is_this_machine(host: str) -> bool:
    """Whether the rendezvous host is this machine (then its agent hosts the c10d store)."""
    if host == "localhost" or host == socket.gethostname():
        return True
    try:
        addrs = {a[4][0] for a in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return False
    local = {"127.0.0.1", "::1"}
    with contextlib.suppress(OSError):
        local |= {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
    return any(a.startswith("127.") for a in addrs) or bool(addrs & local)


def check_endpoint(endpoint: str, timeout_s: float) -> None:
    """Before launching a multi-node job: the rendezvous host must resolve and, unless it is this
    machine, accept a TCP connection within timeout_s (it may start a little after us)."""
    host, _, port = endpoint.rpartition(":")
    try:
        socket.getaddrinfo(host, int(port), proto=socket.IPPROTO_TCP)
    except OSError as e:
        raise UserError(
            f"dist.rdzv_endpoint = {endpoint!r}: cannot resolve host {host!r} ({e.strerror or e}); use a hostname or IP of the first node"
        ) from None
    if _is_this_machine(host):
        return
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=min(5.0, timeout_s)):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise UserError(
                    f"dist.rdzv_endpoint = {endpoint!r}: nothing answers there after dist.timeout_s = {timeout_s} s ({e.strerror or e}); start the first node, check the address and the firewall"
                ) from None
            time.sleep(1.0)


JOB_ENV = "GPTRAIN_JOB"  # read by checkpoint/lock.py (which stays free of torch: its own copy)
MARK_WAIT_S = 10.0  # how long an agent waits for the store's host mark once the store answers


def _rendezvous_args(cfg: DistConfig, low: int, high: int) -> tuple[list[str], Host | None, object]:
    """torch.distributed.run's options for a multi-node job, who hosts its rendezvous store, and
    the store server when this agent hosts it (kept alive for the whole launch).

    The store lives where dist.rdzv_endpoint points: in a `gptrain store` process (the agents
    connect as clients: torch's is_host=false), or else in the agent of the endpoint's node,
    which this agent becomes when the endpoint is this machine and its port is free."""
    check_endpoint(cfg.rdzv_endpoint, cfg.timeout_s)
    host, port = rdzv_store.split(cfg.rdzv_endpoint)
    kept = (
        rdzv_store.host_here(cfg.rdzv_endpoint, cfg.timeout_s) if _is_this_machine(host) else None
    )
    hosted_by = rdzv_store.who_hosts(cfg.rdzv_endpoint, MARK_WAIT_S)
    conf = [c for c in cfg.rdzv_conf.replace(" ", "").split(",") if c]
    if hosted_by is not None and hosted_by.kind == rdzv_store.EXTERNAL:
        conf.append("is_host=false")
    elif low < high:  # elastic, yet one node cannot be lost: say which, and how to avoid it
        who = hosted_by.text if hosted_by else f"the agent of the node at {host}"
        print(
            f"gptrain: note: the rendezvous store at {cfg.rdzv_endpoint} is hosted by {who}: losing that node ends the job on every node; to lose any node safely, run `gptrain store --port {port}` on a stable host and point dist.rdzv_endpoint at it (docs/distributed.md)",
            file=sys.stderr,
            flush=True,
        )
    # the job's identity for the run folder's lock (checkpoint/lock.py): a round re-formed with
    # rank 0 on another node takes over the lock of the round before
    os.environ[JOB_ENV] = f"{cfg.rdzv_id}@{cfg.rdzv_endpoint}"
    args = [
        f"--nnodes={low}:{high}" if low < high else f"--nnodes={low}",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint={cfg.rdzv_endpoint}",
        f"--rdzv_id={cfg.rdzv_id}",
    ]
    if conf:
        args += [f"--rdzv_conf={','.join(conf)}"]
    if low < high:  # elastic: survivors re-form (a restart of the worker group each time)
        args += [f"--max-restarts={ELASTIC_RESTARTS}"]
        # a node that joins a running job waits forever for the round's MASTER_ADDR when the
        # agents share the rendezvous TCPStore (torch 2.13: rank 0 of an earlier round keeps
        # its cached address and never writes it again): each round's rank 0 worker hosts a
        # new store instead, so the workers need no per-restart namespace (FRESH_STORE)
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        os.environ[FRESH_STORE] = "1"
    return args, hosted_by, kept


def _store_lost(endpoint: str, hosted_by: Host | None, e: BaseException) -> UserError | None:
    """After the rendezvous failed: when its store no longer answers, the one-line error naming
    the process and node that hosted it (exit code 1: the job, not its input, failed); None when
    the store still answers (the failure is something else)."""
    if rdzv_store.answers(endpoint):
        return None
    host, port = rdzv_store.split(endpoint)
    if hosted_by is not None and hosted_by.kind == rdzv_store.EXTERNAL:
        who, fix = (
            hosted_by.text,
            f"start `gptrain store --port {port}` on {hosted_by.node} again, then the job",
        )
    else:
        who = f"{hosted_by.text if hosted_by else f'the agent of the node at {host}'}, the node that started it"
        fix = f"the job cannot go on without it: run it again, and to lose any node safely run `gptrain store --port {port}` on a stable host and point dist.rdzv_endpoint at it (docs/distributed.md)"
    error = UserError(
        f"the rendezvous store at {endpoint}, hosted by {who}, is gone ({first_line(e)}); {fix}"
    )
    error.exit_code = 1
    return error


def _closed(cfg: DistConfig, hosted_by: Host | None) -> UserError:
    """The rendezvous of dist.rdzv_id is closed: torch's agents close it when their job ends (done
    or failed), and it stays closed as long as its store lives. One line naming that store and
    the fix (another id per job, or a fresh store)."""
    rid, port = cfg.rdzv_id, rdzv_store.split(cfg.rdzv_endpoint)[1]
    head = f"the rendezvous {rid!r} at {cfg.rdzv_endpoint} is closed: a job with dist.rdzv_id = {rid!r} already ended there"
    fix = 'give each job a dist.rdzv_id of its own (e.g. --dist.rdzv_id="$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}", the same on every node of that job)'
    if hosted_by is not None and hosted_by.kind == rdzv_store.EXTERNAL:
        return UserError(
            f"{head}, and {hosted_by.text} keeps a closed rendezvous as long as it runs; {fix}, or restart `gptrain store --port {port}` between jobs"
        )
    who = hosted_by.text if hosted_by else f"the process listening at {cfg.rdzv_endpoint}"
    return UserError(
        f"{head} or is ending, and {who} still serves its store; {fix}, or wait until that job's agents have exited"
    )


def launch(nproc: int, argv: list[str], cfg: DistConfig) -> int:
    """Re-run `gptrain train ARGV` as `nproc` workers on this machine through torch's own
    launcher, torch.distributed.run: standalone, or one of cfg.nnodes machines meeting at a c10d
    rendezvous (the same command runs on every node).

    Returns 0; 4 when the workers refused to start in a crash loop; 3 when one hung (watchdog);
    2 for bad input (every failed worker exited with 2 after printing one line, or the rendezvous
    could not be reached); else 1."""
    from torch.distributed import run as torch_run
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousError

    low, high = node_range(cfg.nnodes)
    # who hosts the rendezvous store; the server when this agent does (a local: alive until the end)
    hosted_by, kept = None, None
    if high > 1:
        args, hosted_by, kept = _rendezvous_args(cfg, low, high)
    else:
        args = ["--standalone"]
    # SIGTERM and SIGUSR1 (preemption, see guard.py) are forwarded to the workers, which save at
    # their next step; they get SHUTDOWN_S seconds before the launcher kills them (where this
    # torch has the options; else SIGTERM only, and torch's own 30 s)
    shutdown = f"--shutdown-timeout={SHUTDOWN_S}"
    handling = supported([f"--signals-to-handle={','.join(FORWARDED)}", shutdown])
    grace = SHUTDOWN_S if shutdown in handling else TORCH_SHUTDOWN_S
    args += handling
    args += [f"--nproc_per_node={nproc}", "-m", "gptrain", "train", *argv]
    try:
        torch_run.main(args)
    except SignalException as e:
        if e.sigval not in (signal.SIGTERM, signal.SIGUSR1):
            raise KeyboardInterrupt from None
        print(
            f"gptrain: stopped by {e.sigval.name}: the workers were given up to {grace} s to save a checkpoint at their next step; run the same command to resume",
            file=sys.stderr,
        )
        return 0
    except ChildFailedError as e:  # the workers printed their own errors already
        codes = sorted({f.exitcode for f in e.failures.values()})
        ranks = ", ".join(map(str, sorted(e.failures)))
        print(
            f"gptrain: error: worker rank {ranks} failed (exit code {', '.join(map(str, codes))})",
            file=sys.stderr,
        )
        for code in (CRASH_LOOP, DIVERGED, HUNG):  # the others were stopped by the launcher
            if code in codes:
                return code
        return 2 if codes == [2] else 1
    except (RendezvousError, RuntimeError) as e:  # a lost store reaches the agent as either
        lost = _store_lost(cfg.rdzv_endpoint, hosted_by, e) if high > 1 else None
        if lost is not None:
            raise lost from None
        if not isinstance(e, RendezvousError):
            raise
        if isinstance(e, RendezvousClosedError):
            raise _closed(cfg, hosted_by) from None
        raise UserError(
            f"rendezvous at {cfg.rdzv_endpoint} failed ({first_line(e)}); start the same command on all dist.nnodes = {cfg.nnodes} nodes"
        ) from None
    return 0

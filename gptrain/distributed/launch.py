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
from gptrain.distributed.runtime import FRESH_STORE, cpu_cores
from gptrain.errors import UserError, first_line

FORWARDED = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1")  # torchrun's defaults + USR1
HUNG, CRASH_LOOP = 3, 4  # the workers' exit codes: watchdog.EXIT_CODE, attempts.EXIT_CRASH_LOOP
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
    from torch.distributed.elastic.rendezvous import RendezvousError

    low, high = node_range(cfg.nnodes)
    if high > 1:
        check_endpoint(cfg.rdzv_endpoint, cfg.timeout_s)
        args = [
            f"--nnodes={low}:{high}" if low < high else f"--nnodes={low}",
            "--rdzv_backend=c10d",
        ]
        args += [f"--rdzv_endpoint={cfg.rdzv_endpoint}", f"--rdzv_id={cfg.rdzv_id}"]
        if cfg.rdzv_conf:
            args += [f"--rdzv_conf={cfg.rdzv_conf.replace(' ', '')}"]
        if low < high:  # elastic: survivors re-form (a restart of the worker group each time)
            args += [f"--max-restarts={ELASTIC_RESTARTS}"]
            # a node that joins a running job waits forever for the round's MASTER_ADDR when the
            # agents share the rendezvous TCPStore (torch 2.13: rank 0 of an earlier round keeps
            # its cached address and never writes it again): each round's rank 0 worker hosts a
            # new store instead, so the workers need no per-restart namespace (FRESH_STORE)
            os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
            os.environ[FRESH_STORE] = "1"
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
        for code in (CRASH_LOOP, HUNG):  # the others were stopped by the launcher: any code
            if code in codes:
                return code
        return 2 if codes == [2] else 1
    except RendezvousError as e:
        raise UserError(
            f"rendezvous at {cfg.rdzv_endpoint} failed ({first_line(e)}); start the same command on all dist.nnodes = {cfg.nnodes} nodes"
        ) from None
    return 0

"""Who hosts the rendezvous store of a multi-node job, and a store that no training node hosts.

torch's c10d rendezvous keeps its state in a TCPStore at dist.rdzv_endpoint. By default the agent
on the endpoint's machine hosts it inside its own process, so losing that node ends the job on
every node: the one node an elastic job cannot lose. `gptrain store --port P` (serve()) runs the
store as a process of its own on a stable host; the agents find it there and connect as clients
(torch's `is_host=false`), and then any training node may go.

Whoever hosts the store writes a mark (MARK: its kind, node name and pid). Each agent reads it
before launching (who_hosts()), so a survivor can name the node whose loss ended the job.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
from dataclasses import dataclass

import torch.distributed as dist

from gptrain.distributed.failures import muted_stderr

MARK = "gptrain.rdzv_store"  # kind|node|pid of the process hosting the rendezvous store
EXTERNAL, NODE = "store", "node"  # a `gptrain store` process; a training node's agent


@dataclass(frozen=True)
class Host:
    """The process hosting the rendezvous store."""

    kind: str  # EXTERNAL or NODE
    node: str  # its machine's name
    pid: int

    @property
    def text(self) -> str:
        what = "the gptrain store" if self.kind == EXTERNAL else "the agent of node"
        return f"{what} {self.node} (pid {self.pid})"


def _mark(store: dist.Store, kind: str) -> None:
    store.set(MARK, f"{kind}|{socket.gethostname()}|{os.getpid()}")


def split(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host, int(port)


def serve(port: int, timeout_s: float = 300.0) -> dist.TCPStore:
    """Host a rendezvous store on `port` (0: any free port) in this process, marked EXTERNAL.
    OSError or RuntimeError when the port is taken."""
    store = dist.TCPStore(
        "0.0.0.0",
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    _mark(store, EXTERNAL)
    return store


def host_here(endpoint: str, timeout_s: float) -> dist.TCPStore | None:
    """On the endpoint's machine: host the store in this agent's process before torch does, and
    mark it with this node's name. The server is multi-tenant, as torch's c10d backend makes it,
    so the backend's own TCPStore on the same port in this process shares it. None when the port
    is taken (another agent or a `gptrain store` hosts it)."""
    host, port = split(endpoint)
    try:
        with muted_stderr():  # the C++ side logs the failed bind before raising
            store = dist.TCPStore(
                host,
                port,
                is_master=True,
                multi_tenant=True,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
    except (RuntimeError, OSError):
        return None
    _mark(store, NODE)
    return store


def who_hosts(endpoint: str, timeout_s: float) -> Host | None:
    """The host mark of the store at `endpoint`, waiting up to timeout_s for it; None when
    nothing answers there or the store carries no mark (not started by gptrain)."""
    host, port = split(endpoint)
    deadline = time.monotonic() + timeout_s
    try:
        with muted_stderr():
            client = dist.TCPStore(
                host,
                port,
                is_master=False,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=max(1.0, timeout_s)),
            )
            while not client.check([MARK]):
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.05)
            kind, node, pid = client.get(MARK).decode().split("|")
    except (RuntimeError, OSError, ValueError):
        return None
    return Host(kind, node, int(pid))


def answers(endpoint: str, timeout_s: float = 3.0) -> bool:
    """Whether anything accepts a TCP connection at endpoint within timeout_s."""
    host, port = split(endpoint)
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(OSError):
            with socket.create_connection((host, port), timeout=1.0):
                return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)

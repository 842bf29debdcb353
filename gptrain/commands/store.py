"""`gptrain store`: the rendezvous store of an elastic job, on a host that is not a training node.

gptrain store --port 29400            # on a stable host (a login or service node)
gptrain train ... --dist.nnodes=1:4 --dist.rdzv_endpoint=STOREHOST:29400   # on each node

Every node's agent then connects to this store as a client, so losing any training node leaves
the others running. torch's agents close a job's rendezvous when the job ends (done or failed), and
the store keeps it closed: each job (and each requeue of one) needs a dist.rdzv_id of its own,
e.g. "$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}"; a job reusing an ended job's id stops with one
line saying so. It prints `gptrain store: serving ... at HOST:PORT` once listening, and ends
with exit code 0 on SIGTERM or SIGINT (the job's state in it is gone then: stop it after the job).
"""

from __future__ import annotations

import signal
import socket
import sys
import threading

from gptrain.distributed import store as rdzv_store
from gptrain.errors import ArgParser, UserError, first_line


def main(argv: list[str]) -> int:
    parser = ArgParser(prog="gptrain store", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--port", type=int, required=True, help="TCP port to listen on (0: any free port)"
    )
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        raise UserError(f"gptrain store: --port {args.port} is not a TCP port (0 to 65535)")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        store = rdzv_store.serve(args.port)
    except (RuntimeError, OSError) as e:
        raise UserError(
            f"gptrain store: cannot listen on port {args.port} ({first_line(e)}); pick a free port"
        ) from None
    where = f"{socket.gethostname()}:{store.port}"
    print(
        f"gptrain store: serving the rendezvous store at {where}; start each node with --dist.rdzv_endpoint={where} and each job with a --dist.rdzv_id of its own (a job's rendezvous stays closed here once it ends); SIGTERM ends it",
        flush=True,
    )
    while not stop.wait(1.0):
        pass
    print(f"gptrain store: stopped ({where})", file=sys.stderr, flush=True)
    return 0

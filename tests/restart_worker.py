"""Worker for test_fsdp.py's restart test, under `torchrun --max-restarts=1`: in attempt 0 every
rank leaves a mark in the rendezvous store and rank 1 dies; attempt 1 prints whether it can see
attempt 0's marks (it must not: each attempt has its own store prefix)."""

import os
import sys
import time

import torch

from gptrain.distributed import failures
from gptrain.distributed import runtime as dist

info = dist.DistInfo.from_env("cpu")
dist.init(info, "gloo", 60)
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
if attempt == "0":
    failures._store.set(f"mark/{info.rank}", "attempt0")
    torch.distributed.barrier()
    if info.rank == 1:
        os._exit(3)  # the agent restarts both workers
    time.sleep(60)
    sys.exit(0)
stale = failures._store.check([f"mark/{1 - info.rank}"])
line = f"rank {info.rank} attempt {attempt} stale={stale}\n"
os.write(1, line.encode())  # one write: two ranks' lines never interleave
dist.teardown()

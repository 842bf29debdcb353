"""host.keep_freed_memory: freed activations' pages are reused by the next step, not faulted in again."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import bf16_matmul_slowdown

from gptrain.distributed import host
from gptrain.training.choices import MARGIN

PROBE = """
import resource, sys, torch
from gptrain.distributed.host import keep_freed_memory
from gptrain.model.gpt import GPT, GPTConfig
torch.manual_seed(0)
model = GPT(GPTConfig(block_size=256, vocab_size=256, n_layer=2, n_head=4, n_embd=256))
bf16 = sys.argv[1] == "bfloat16"
model.set_attention("matmul" if bf16 else "sdpa")
x = torch.randint(0, 256, (8 if bf16 else 4, 256))  # bf16's activations are half the size
def step():  # forward and backward: the same activations allocated and freed every step
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        _, loss = model(x, x)
    loss.backward()
    model.zero_grad(set_to_none=True)
def faults_per_step():
    for _ in range(2):  # the heap grows to its working size
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        step()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 4
default = faults_per_step()  # glibc's starting thresholds first, then the same process kept
assert keep_freed_memory()
print(default, faults_per_step())
"""


# a stand-in for what train.dtype = auto picks here (auto times a whole block): bf16 where its
# matmuls are faster than float32's by more than auto's MARGIN; float32 elsewhere, as where bf16
# is emulated (a bf16 probe took 993 s on an AVX2-only CPU) or converted (AVX512 without its bf16
# instructions: 48 s, against 27 s for float32)
DTYPE = "bfloat16" if bf16_matmul_slowdown() < 1 - MARGIN else "float32"


# glibc's starting thresholds, pinned: left to themselves they adapt as memory is freed (a freed
# mmapped block raises the mmap threshold to its size), so "the defaults" faulted a number of
# times a step that varied across processes and thread counts, and a comparison with them failed
# now and then. Pinned (which turns the adapting off), the same step faults ~23,400 times.
GLIBC_START = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}


def _page_faults_per_step() -> tuple[float, float]:
    """(faults per step with glibc's starting thresholds, after keep_freed_memory()) in one
    process."""
    env = {**os.environ, **GLIBC_START}
    out = subprocess.run([sys.executable, "-c", PROBE, DTYPE], env=env, capture_output=True, text=True, check=True)  # fmt: skip
    default, kept = out.stdout.strip().splitlines()[-1].split()
    return float(default), float(kept)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt (Linux)")
def test_freed_tensor_memory_is_reused_without_page_faults():
    """Minor page faults per training step (bf16, or float32 where bf16 is emulated) of a small
    model (2 layers, width 256, 4 x 256 tokens, 8 x 256 in bf16; 2 warm-up steps, 4 measured),
    in one process: first with glibc's starting thresholds (128 KiB, pinned), which hand the
    activations' pages back and fault them in again (23,400-24,000 a step in float32 on a 2-core
    AVX2 EPYC, 1 or 2 threads), then, after keep_freed_memory(), kept (180-470)."""
    default, kept = _page_faults_per_step()
    assert kept * 4 < default, (default, kept)


def test_without_mallopt_nothing_changes(monkeypatch):
    monkeypatch.setattr(host.ctypes.util, "find_library", lambda name: "/nonexistent/libc.so")
    assert host.keep_freed_memory() is False

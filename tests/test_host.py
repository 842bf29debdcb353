"""host.keep_freed_memory: freed activations' pages are reused by the next step, not faulted in again."""

from __future__ import annotations

import statistics
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
x = torch.randint(0, 256, (16 if bf16 else 8, 256))  # bf16's activations are half the size
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
default = faults_per_step()  # glibc's defaults first, then the same process with them changed
assert keep_freed_memory()
print(default, faults_per_step())
"""


# a stand-in for what train.dtype = auto picks here (auto times a whole block): bf16 where its
# matmuls are faster than float32's by more than auto's MARGIN; float32 elsewhere, as where bf16
# is emulated (a bf16 probe took 993 s on an AVX2-only CPU) or converted (AVX512 without its bf16
# instructions: 48 s, against 27 s for float32)
DTYPE = "bfloat16" if bf16_matmul_slowdown() < 1 - MARGIN else "float32"


def _page_faults_per_step() -> tuple[float, float]:
    """(faults per step with glibc's defaults, after keep_freed_memory()) in one process."""
    out = subprocess.run([sys.executable, "-c", PROBE, DTYPE], capture_output=True, text=True, check=True)  # fmt: skip
    default, kept = out.stdout.strip().splitlines()[-1].split()
    return float(default), float(kept)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt (Linux)")
def test_freed_tensor_memory_is_reused_without_page_faults():
    """Minor page faults per training step (bf16, or float32 where bf16 is emulated) of a small
    model (2 layers, width 256, 8 x 256 tokens, 16 x 256 in bf16; 2 warm-up steps, 4 measured): glibc's defaults
    hand the activations' pages back and fault them in again (2,300 to 4,300 per step in float32
    on a 2-core AVX2 EPYC, varying as glibc adapts its thresholds); kept, 0-16. Each side is the
    median of three processes (single probes failed once in a full-suite run), each measuring
    the defaults first and then, in the same process, the pages kept."""
    probes = [_page_faults_per_step() for _ in range(3)]
    default = statistics.median(d for d, _ in probes)
    kept = statistics.median(k for _, k in probes)
    assert kept * 4 < default, probes


def test_without_mallopt_nothing_changes(monkeypatch):
    monkeypatch.setattr(host.ctypes.util, "find_library", lambda name: "/nonexistent/libc.so")
    assert host.keep_freed_memory() is False

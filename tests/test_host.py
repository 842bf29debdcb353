"""host.keep_freed_memory: freed activations' pages are reused by the next step, not faulted in again."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gptrain import host

PROBE = """
import resource, sys, torch
from gptrain.host import keep_freed_memory
from gptrain.model import GPT, GPTConfig
if sys.argv[1] == "keep":
    assert keep_freed_memory()
torch.manual_seed(0)
model = GPT(GPTConfig(block_size=256, vocab_size=256, n_layer=2, n_head=4, n_embd=256))
model.set_attention("matmul")  # what a CPU bf16 run at these shapes uses
x = torch.randint(0, 256, (16, 256))
def step():  # forward and backward: the same activations allocated and freed every step
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(x, x)
    loss.backward()
    model.zero_grad(set_to_none=True)
step()
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(6):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 6)
"""


def _page_faults_per_step(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt (Linux)")
def test_freed_tensor_memory_is_reused_without_page_faults():
    """Minor page faults per bf16 training step of a small model (2 layers, width 256, 16 x 256
    tokens): glibc's defaults hand the activations' pages back and fault them in again (7,000 to
    14,000 per step here, varying as glibc adapts its thresholds); kept, 300-1,200."""
    default, kept = _page_faults_per_step("default"), _page_faults_per_step("keep")
    assert kept * 4 < default, (kept, default)


def test_without_mallopt_nothing_changes(monkeypatch):
    monkeypatch.setattr(host.ctypes.util, "find_library", lambda name: "/nonexistent/libc.so")
    assert host.keep_freed_memory() is False

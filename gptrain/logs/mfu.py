"""True metrics: the measured device peak for MFU, and time formatting. (Where metrics are
written: gptrain/logs/loggers.py.)

MFU = achieved model FLOP/s / peak FLOP/s, where the peak is MEASURED in the same run on this
device with a large matmul in the training dtype, never looked up by GPU name.
"""

from __future__ import annotations

import math
import time

import torch


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


# (M, K, N) shapes timed for the peak: a large square matmul and the tall, thin shapes of a
# transformer's projections (tokens x width); some devices are fastest on the latter.
PEAK_SHAPES = {
    "cuda": [(8192, 8192, 8192), (16384, 4096, 4096), (16384, 1024, 4096)],
    "cpu": [(2048, 2048, 2048), (4096, 1024, 1024), (4096, 256, 1024)],
}


def measure_peak_flops(device: str, dtype: torch.dtype, seconds_per_shape: float = 0.25) -> float:
    """Peak FLOP/s of this device in `dtype`: the fastest of several large matmuls (each the
    best of repeated timed runs). MFU divides by this measured number, never a datasheet's."""
    gen = torch.Generator(device=device).manual_seed(0)  # never touch the global RNG (exact resume)
    peak = 0.0
    for m, k, n in PEAK_SHAPES["cuda" if device.startswith("cuda") else "cpu"]:
        a = torch.randn(m, k, device=device, dtype=dtype, generator=gen)
        b = torch.randn(k, n, device=device, dtype=dtype, generator=gen)
        for _ in range(2):  # warm-up (kernel selection, allocator, AMX tile config)
            a @ b
        synchronize(device)
        best, spent = math.inf, 0.0
        while spent < seconds_per_shape or best == math.inf:
            t0 = time.perf_counter()
            a @ b
            synchronize(device)
            dt = time.perf_counter() - t0
            best, spent = min(best, dt), spent + dt
        peak = max(peak, 2 * m * k * n / best)
    return peak


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    return tokens_per_s * flops_per_token / peak_flops


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"

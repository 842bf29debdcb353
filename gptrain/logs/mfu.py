"""True metrics: the measured device peak for MFU, and time formatting. (Where metrics are
written: gptrain/logs/loggers.py.)

MFU = achieved model FLOP/s / peak FLOP/s, where the peak is MEASURED in the same run on this
device with matmuls in the training dtype, never looked up by GPU name. MFU never exceeds 100%:
an interval that achieves more than the measured peak reports 1.0 and says so (checked_mfu); the
peak is never moved, so every report divides by the number the run printed.
"""

from __future__ import annotations

import math
import time

import torch


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


# (M, K, N) shapes timed for the peak, smallest first: squares and the tall, thin shapes of a
# transformer's projections (tokens x width); some devices are fastest on the latter, and where a
# dtype is emulated (bf16 on AVX2-only CPUs, float16 on most CPUs) the small ones are its fastest.
PEAK_SHAPES = {
    "cuda": [(4096, 4096, 4096), (16384, 1024, 4096), (8192, 8192, 8192), (16384, 4096, 4096)],
    "cpu": [
        (512, 512, 512),
        (4096, 128, 512),
        (4096, 256, 1024),
        (1024, 1024, 1024),
        (4096, 1024, 1024),
        (2048, 2048, 2048),
    ],
}


def measure_peak_flops(
    device: str,
    dtype: torch.dtype,
    runs: int = 3,
    max_run_s: float = 0.5,
    min_run_s: float | None = None,
) -> float:
    """Peak FLOP/s of this device in `dtype`: the fastest of PEAK_SHAPES, each timed the same way
    for every dtype: one warm-up product, then `runs` complete timed runs, the best kept. The
    shapes go smallest first; a shape whose product would take longer than `max_run_s` at the
    best rate seen so far ends the list, so a slow dtype is measured on the shapes it completes
    (never a fraction of a run, never a number that rounds to 0): ~1 s on 2 cores for any dtype.
    On a GPU one product takes ~1 ms and the clocks start low: the products are first repeated
    for GPU_RAMP_S, and each timed run repeats its product for at least `min_run_s` (GPU 0.02 s;
    CPU 0, one product: 1 ms and more, no clocks to raise). MFU divides by this measured number,
    never a datasheet's."""
    cuda = device.startswith("cuda")
    min_run_s = (0.02 if cuda else 0.0) if min_run_s is None else min_run_s
    gen = torch.Generator(device=device).manual_seed(0)  # never touch the global RNG (exact resume)
    peak, started = 0.0, time.perf_counter()
    for m, k, n in PEAK_SHAPES["cuda" if cuda else "cpu"]:
        flops = 2 * m * k * n
        if peak and flops / peak > max_run_s:
            break
        a = torch.randn(m, k, device=device, generator=gen).to(dtype)
        b = torch.randn(k, n, device=device, generator=gen).to(dtype)
        one = _products(a, b, 1, device)  # warm-up (kernel selection, allocator, AMX tile config)
        while cuda and time.perf_counter() - started < GPU_RAMP_S:  # the GPU's clocks up
            one = _products(a, b, 1, device)
        reps = max(1, math.ceil(min_run_s / max(one, 1e-9)))
        best = min(_products(a, b, reps, device) for _ in range(runs)) / reps
        peak = max(peak, flops / best)
    return peak


GPU_RAMP_S = 0.2  # seconds of products before the first timed run on a GPU (idle clocks ramp up)


def _products(a: torch.Tensor, b: torch.Tensor, reps: int, device: str) -> float:
    """Seconds for `reps` products a @ b, to the end of the last."""
    t0 = time.perf_counter()
    for _ in range(reps):
        torch.mm(a, b)
    synchronize(device)
    return time.perf_counter() - t0


def format_flops(flops_per_s: float) -> str:
    """A rate in the unit that keeps 3 significant digits: 75.3 GFLOP/s, 1.21 TFLOP/s."""
    for unit, scale in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9), ("MFLOP/s", 1e6)):
        if flops_per_s >= scale:
            return f"{flops_per_s / scale:.3g} {unit}"
    return f"{flops_per_s:.3g} FLOP/s"


def checked_mfu(
    tokens_per_s: float, flops_per_token: float, peak_flops: float, world_size: int = 1
) -> tuple[float, float, str]:
    """(MFU, the peak, a warning or ""). Achieved FLOP/s per process above the measured peak
    means the peak missed this device's fastest case (or the interval was timed short): this
    report's MFU is 1.0, never more, and the warning says so. The peak comes back unchanged:
    one report never moves the number later ones divide by."""
    achieved = tokens_per_s * flops_per_token / world_size
    if achieved <= peak_flops:
        return mfu(tokens_per_s, flops_per_token, peak_flops * world_size), peak_flops, ""
    warning = f"achieved {format_flops(achieved)} per process exceeds the measured peak {format_flops(peak_flops)}: MFU reported as 100%, the peak kept (it missed this device's fastest case)"
    return 1.0, peak_flops, warning


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    return tokens_per_s * flops_per_token / peak_flops


def format_duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"

"""Numeric precision: which dtype a run computes in, and the autocast / GradScaler that go with it.

`train.dtype = auto` picks bf16 where the device computes it natively: GPUs of compute capability
8.0 or newer (Ampere, Hopper, ...; `torch.cuda.is_bf16_supported()` is also True on V100 and T4,
where bf16 is emulated: slow, and torch.compile skips it), and CPUs with AVX512-BF16 or AMX. Older
GPUs get float16 with a GradScaler, except under FSDP (no sharded float16 scaler): float32 there.
Everything else computes in float32. FSDP2 runs under the same autocast as DDP (its
MixedPrecisionPolicy only lowers the blocks' parameters, see dist.wrap_model). On CUDA, float32
matmuls use TensorFloat-32 unless `train.tf32 = false`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from gptrain.errors import UserError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cpu_supports_bf16() -> bool:
    """bf16 autocast pays off on CPUs with native bf16 matmul (AVX512-BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def cuda_supports_bf16() -> bool:
    """Native bf16 tensor cores: compute capability >= 8.0 (not merely bf16 that torch emulates)."""
    return torch.cuda.get_device_capability() >= (8, 0)


def resolve_dtype(name: str, device_type: str, fsdp: bool = False) -> torch.dtype:
    """train.dtype (auto | float32 | bfloat16 | float16) → the compute dtype on this device."""
    if name != "auto":
        if name == "float16" and device_type != "cuda":
            raise UserError(
                "train.dtype = 'float16' needs a CUDA device; use auto, bfloat16 or float32"
            )
        return DTYPES[name]
    if device_type == "cuda":
        if cuda_supports_bf16():
            return torch.bfloat16
        return torch.float32 if fsdp else torch.float16
    return torch.bfloat16 if cpu_supports_bf16() else torch.float32


def mixed_precision(
    dtype: torch.dtype, device_type: str
) -> tuple[AbstractContextManager, torch.amp.GradScaler]:
    """(autocast context, GradScaler) for a compute dtype, the same for one process, DDP and FSDP2
    (whose MixedPrecisionPolicy only lowers the blocks' parameters, see dist.wrap_model); the
    scaler is active only for float16."""
    use_autocast = dtype != torch.float32
    autocast = torch.autocast(device_type, dtype=dtype) if use_autocast else nullcontext()
    return autocast, torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)


def set_matmul_precision(device_type: str, tf32: bool) -> None:
    """On CUDA, let float32 matmuls (all of a float32 run; the few outside autocast otherwise) use
    TF32 tensor cores, or not. A process-wide setting; CPU runs are left at full float32."""
    if device_type == "cuda":
        torch.set_float32_matmul_precision("high" if tf32 else "highest")

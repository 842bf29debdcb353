"""Numeric precision: which dtype a run computes in, and the autocast / GradScaler that go with it.

`train.dtype = auto` is MEASURED (gptrain/training/choices.py times one block of the run's
shapes in float32 and in the device's fast dtype and hands the faster one to resolve_dtype);
nothing here reads CPU flags. On a GPU the fast dtype is a rule (auto_cuda_dtype): bf16 where its
tensor cores compute it natively (compute capability 8.0 or newer: Ampere, Hopper, ...;
`torch.cuda.is_bf16_supported()` is also True on V100 and T4, where bf16 is emulated: slow, and
torch.compile skips it), else float16 with a GradScaler, except under FSDP (no sharded float16
scaler): float32 there; a caller that measured nothing gets it. FSDP2 runs under the same
autocast as DDP (its MixedPrecisionPolicy only lowers the blocks' parameters, see
parallelize.wrap_model). On CUDA, float32 matmuls use TensorFloat-32 unless `train.tf32 = false`.
`train.deterministic = true` asks torch for deterministic kernels everywhere (set_determinism).
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager, nullcontext

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cuda_supports_bf16() -> bool:
    """Native bf16 tensor cores: compute capability >= 8.0 (not merely bf16 that torch emulates)."""
    return torch.cuda.get_device_capability() >= (8, 0)


def auto_cuda_dtype(fsdp: bool = False) -> str:
    """train.dtype = auto on a GPU: bfloat16 where native, else float16 (float32 under FSDP)."""
    if cuda_supports_bf16():
        return "bfloat16"
    return "float32" if fsdp else "float16"


def resolve_dtype(
    name: str, device_type: str, fsdp: bool = False, measured: str | None = None
) -> torch.dtype:
    """train.dtype (auto | float32 | bfloat16 | float16) -> the compute dtype on this device.
    auto: on CUDA auto_cuda_dtype; elsewhere `measured` (choices.py's decision), float32 for a
    caller that measured nothing (never slow: where bf16 is emulated it is ~20x slower)."""
    if name != "auto":
        return DTYPES[name]
    if measured:
        return DTYPES[measured]
    return DTYPES[auto_cuda_dtype(fsdp) if device_type == "cuda" else "float32"]


def mixed_precision(
    dtype: torch.dtype, device_type: str
) -> tuple[AbstractContextManager, torch.amp.GradScaler]:
    """(autocast context, GradScaler) for a compute dtype, the same for one process, DDP and FSDP2
    (whose MixedPrecisionPolicy only lowers the blocks' parameters, see parallelize.wrap_model); the
    scaler is active only for float16."""
    use_autocast = dtype != torch.float32
    autocast = torch.autocast(device_type, dtype=dtype) if use_autocast else nullcontext()
    return autocast, torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)


def set_matmul_precision(device_type: str, tf32: bool) -> None:
    """On CUDA, let float32 matmuls (all of a float32 run; the few outside autocast otherwise) use
    TF32 tensor cores, or not. A process-wide setting; CPU runs are left at full float32."""
    if device_type == "cuda":
        torch.set_float32_matmul_precision("high" if tf32 else "highest")


def set_determinism(on: bool) -> None:
    """train.deterministic: torch's deterministic kernels (an op that has none raises, naming
    itself), or its default, fastest ones. A process-wide setting, set by every run. cuBLAS needs
    a fixed workspace configuration for deterministic results; it reads CUBLAS_WORKSPACE_CONFIG
    when its first handle is made, so this runs before the run's first matmul (a value already
    in the environment wins). cuDNN's autotuner picks kernels by timing: off."""
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(on)
    torch.backends.cudnn.deterministic = on
    if on:
        torch.backends.cudnn.benchmark = False


def nondeterministic_op(e: BaseException) -> str | None:
    """The one line for torch's error when train.deterministic = true meets an op that has no
    deterministic kernel on this device ("<op> does not have a deterministic implementation, but
    you set 'torch.use_deterministic_algorithms(True)'..."); None for any other error."""
    text = str(e)
    if "use_deterministic_algorithms" not in text:
        return None
    what = "an operation has no deterministic kernel on this device"  # e.g. cuBLAS's own check
    if (phrase := " does not have a deterministic implementation") in text:
        what = f"{text.split(phrase)[0].strip().splitlines()[-1]} has no deterministic kernel on this device"
    return f"train.deterministic = true, but {what}; use train.deterministic=false (resumes are then exact up to the kernels' run-to-run noise)"

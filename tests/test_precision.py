"""Precision: the dtype `auto` gives per device (measured on CPUs, a rule on GPUs), autocast /
GradScaler per dtype, TF32 on CUDA only."""

import os

import pytest
import torch

from gptrain.training import precision
from gptrain.training.precision import (
    mixed_precision,
    nondeterministic_op,
    resolve_dtype,
    set_determinism,
    set_matmul_precision,
)


@pytest.mark.parametrize("measured", ["bfloat16", "float32"])
def test_auto_on_cpu_is_the_measured_choice_never_cpu_flags(monkeypatch, measured):
    """auto on a CPU is what choices.py measured; without a measurement float32 (never slow).
    /proc/cpuinfo is not read: a CPU's flags say nothing of what oneDNN may use (the AVX2 tier
    is emulated on AVX512-BF16 CPUs with ONEDNN_MAX_CPU_ISA=AVX2)."""
    import builtins

    real_open = builtins.open

    def no_cpuinfo(path, *a, **k):
        assert "cpuinfo" not in str(path), "resolve_dtype read the CPU flags"
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", no_cpuinfo)
    assert resolve_dtype("auto", "cpu", measured=measured) == precision.DTYPES[measured]
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("float32", "cpu", measured="bfloat16") == torch.float32  # explicit wins


@pytest.mark.parametrize(
    "capability, expected, expected_fsdp",
    [
        ((9, 0), torch.bfloat16, torch.bfloat16),  # H100
        ((8, 0), torch.bfloat16, torch.bfloat16),  # A100
        ((7, 5), torch.float16, torch.float32),  # T4: bf16 only emulated
        ((7, 0), torch.float16, torch.float32),  # V100: bf16 only emulated
    ],
)
def test_auto_on_cuda_is_bf16_only_with_native_support(
    monkeypatch, capability, expected, expected_fsdp
):
    # torch says bf16 is "supported" on V100/T4 too (emulated): auto must not trust that
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, **k: capability)
    assert resolve_dtype("auto", "cuda") == expected
    assert resolve_dtype("auto", "cuda", fsdp=True) == expected_fsdp  # no float16 with FSDP


def test_explicit_dtypes_are_kept_on_every_device():
    """float16 on a CPU too (emulated, slow): it serves to test the float16 path there."""
    for device in ("cpu", "cuda"):
        assert resolve_dtype("float32", device) == torch.float32
        assert resolve_dtype("bfloat16", device) == torch.bfloat16
        assert resolve_dtype("float16", device) == torch.float16


def test_autocast_and_scaler_per_dtype():
    x = torch.randn(4, 8)
    w = torch.randn(8, 8)
    autocast, scaler = mixed_precision(torch.bfloat16, "cpu")
    with autocast:
        assert (x @ w).dtype == torch.bfloat16
    assert not scaler.is_enabled()
    autocast, scaler = mixed_precision(torch.float32, "cpu")
    with autocast:
        assert (x @ w).dtype == torch.float32


def test_tf32_is_set_on_cuda_and_never_on_cpu():
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        set_matmul_precision("cpu", tf32=True)
        assert torch.get_float32_matmul_precision() == "highest"
        set_matmul_precision("cuda", tf32=True)  # a process-wide flag: settable without a GPU
        assert torch.get_float32_matmul_precision() == "high"
        set_matmul_precision("cuda", tf32=False)
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)


def test_determinism_is_set_and_unset_and_keeps_a_given_cublas_config(monkeypatch):
    before = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)  # fmt: skip
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        set_determinism(True)
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert not torch.backends.cudnn.benchmark
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        set_determinism(False)
        assert not torch.are_deterministic_algorithms_enabled()
        assert not torch.backends.cudnn.deterministic
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # the user's own value wins
        set_determinism(True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[1:]


def test_nondeterministic_op_names_the_op_or_says_one_line_and_ignores_other_errors():
    cublas = RuntimeError(
        "Deterministic behavior was enabled with either `torch.use_deterministic_algorithms(True)` or "
        "`at::Context::setDeterministicAlgorithms(true)`, but this operation is not deterministic because "
        "it uses CuBLAS and you have CUDA >= 10.2.\nTo enable deterministic behavior in this case, you must "
        "set an environment variable before running your PyTorch application: CUBLAS_WORKSPACE_CONFIG=:4096:8"
    )
    line = nondeterministic_op(cublas)
    assert line and "\n" not in line and "an operation has no deterministic kernel" in line
    op = RuntimeError("context line\nscatter_add_cuda_kernel does not have a deterministic implementation, but you set 'torch.use_deterministic_algorithms(True)'.")  # fmt: skip
    assert "scatter_add_cuda_kernel has no deterministic kernel" in nondeterministic_op(op)
    assert nondeterministic_op(RuntimeError("CUDA out of memory")) is None

"""Metrics: the measured peak and the MFU arithmetic."""

import pytest
import torch

from gptrain.logs.mfu import format_duration, measure_peak_flops, mfu


def test_measured_peak_is_a_real_matmul_rate_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    peak = measure_peak_flops("cpu", torch.float32, seconds_per_shape=0.05)
    assert torch.equal(state, torch.get_rng_state())
    # no faster than a timed matmul of one of the shapes could possibly be (sanity bounds)
    assert 1e8 < peak < 1e15
    assert mfu(tokens_per_s=1000, flops_per_token=peak / 2000, peak_flops=peak) == pytest.approx(
        0.5
    )


def test_format_duration():
    assert format_duration(59) == "00:59" and format_duration(3661) == "1:01:01"

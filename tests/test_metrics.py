"""Metrics: the measured peak, MFU (never above 100%, the peak never moved), throughput
intervals that exclude saves and evaluations, and how a rate is printed."""

import json
import math
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from train_helpers import DEBUG, run

import gptrain.training.meter as meter_module
from gptrain.config.load import load_config
from gptrain.distributed.runtime import DistInfo
from gptrain.logs.mfu import (
    PEAK_SHAPES,
    checked_mfu,
    format_duration,
    format_flops,
    measure_peak_flops,
    mfu,
)
from gptrain.training import run as phases
from gptrain.training.evaluator import Evaluator
from gptrain.training.meter import Meter
from gptrain.training.saving import Checkpointer


def test_measured_peak_is_a_real_matmul_rate_and_leaves_global_rng_alone():
    state = torch.get_rng_state()
    peak = measure_peak_flops("cpu", torch.float32, runs=1)
    assert torch.equal(state, torch.get_rng_state())
    # no faster than a timed matmul of one of the shapes could possibly be (sanity bounds)
    assert 1e8 < peak < 1e15
    assert mfu(tokens_per_s=1000, flops_per_token=peak / 2000, peak_flops=peak) == pytest.approx(
        0.5
    )


def _count_matmuls(monkeypatch) -> list:
    calls = []
    real = torch.mm

    def counted(a, b):
        calls.append((a.shape[0], a.shape[1], b.shape[1]))
        return real(a, b)

    monkeypatch.setattr(torch, "mm", counted)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # float16: ~1 GFLOP/s here
def test_every_dtype_is_timed_the_same_way_in_complete_runs(monkeypatch, dtype):
    """Each shape: one warm-up and `runs` complete timed runs, for a slow dtype too; a slow
    dtype stops at a smaller shape (never a fraction of a run), in bounded time, and its peak
    is a positive number printed in a unit that does not round to 0."""
    calls = _count_matmuls(monkeypatch)
    t0 = time.perf_counter()
    peak = measure_peak_flops("cpu", dtype, runs=2, max_run_s=0.2)
    assert time.perf_counter() - t0 < 6.0
    shapes = list(dict.fromkeys(calls))
    assert shapes == PEAK_SHAPES["cpu"][: len(shapes)] and shapes  # smallest first, a prefix
    assert calls == [s for s in shapes for _ in range(3)]  # warm-up + 2 runs, every shape
    assert peak > 0 and not format_flops(peak).startswith("0")
    m, k, n = PEAK_SHAPES["cpu"][-1]
    if 2 * m * k * n / peak > 0.2:  # too slow for the largest shape (float16 without AVX512-FP16
        assert len(shapes) < len(PEAK_SHAPES["cpu"])  # or AMX-FP16): the list stopped before it


def test_each_timed_run_repeats_its_product_for_min_run_s(monkeypatch):
    """What a GPU gets (min_run_s 0.02 there: one product takes ~1 ms): each timed run repeats
    its product for at least min_run_s, the same count in every run of a shape, and the peak is
    per product: on a clock where every product takes its FLOPs at 50 GFLOP/s, both ways of
    timing measure 50 GFLOP/s exactly."""
    from gptrain.logs import mfu

    calls, rate, now = _count_matmuls(monkeypatch), 50e9, [0.0]
    counted = torch.mm

    def timed(a, b):  # each product advances the clock by its FLOPs at `rate`
        now[0] += 2 * a.shape[0] * a.shape[1] * b.shape[1] / rate
        return counted(a, b)

    monkeypatch.setattr(torch, "mm", timed)
    monkeypatch.setattr(mfu, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    one = measure_peak_flops("cpu", torch.float32, runs=2, max_run_s=0.05)
    assert len(calls) == 3 * len(set(calls))  # CPU default: a warm-up and 2 single products
    calls.clear()
    repeated = measure_peak_flops("cpu", torch.float32, runs=2, max_run_s=0.05, min_run_s=0.05)
    per_shape = [calls.count(shape) for shape in dict.fromkeys(calls)]
    assert all(c % 2 == 1 for c in per_shape), per_shape  # a warm-up + 2 runs of reps products
    m, k, n = PEAK_SHAPES["cpu"][0]
    reps = math.ceil(0.05 / (2 * m * k * n / rate))
    assert per_shape[0] == 1 + 2 * reps and reps >= 2, per_shape
    assert one == pytest.approx(rate) and repeated == pytest.approx(rate)


def test_emulated_bf16_peak_on_the_avx2_tier_is_measured_and_printed():
    """The issue's case: on the AVX2 tier (bf16 emulated; emulated here with torch's and
    oneDNN's ISA limits) bench printed a bf16 peak of "0.00 TFLOP/s" and MFU 267%."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    code = (
        "import time, torch\n"
        "from gptrain.logs.mfu import measure_peak_flops, format_flops\n"
        "t0 = time.perf_counter()\n"
        "bf16, f32 = (measure_peak_flops('cpu', d) for d in (torch.bfloat16, torch.float32))\n"
        "print(torch.backends.cpu.get_cpu_capability(), bf16, f32, time.perf_counter() - t0, format_flops(bf16))\n"  # fmt: skip
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    capability, bf16, f32, seconds, unit = out.stdout.split(maxsplit=4)
    assert capability == "AVX2", out.stderr
    assert 0 < float(bf16) < float(f32) / 2  # emulated: much slower than float32, yet measured
    assert float(seconds) < 10 and unit.strip().endswith(("GFLOP/s", "MFLOP/s"))
    assert not unit.startswith("0")


def test_format_flops_keeps_three_digits_in_a_unit_that_fits():
    assert format_flops(2.41e9) == "2.41 GFLOP/s"
    assert format_flops(75.34e9) == "75.3 GFLOP/s"
    assert format_flops(1.21e12) == "1.21 TFLOP/s"
    assert format_flops(989e12) == "989 TFLOP/s"
    assert format_flops(3.5e6) == "3.5 MFLOP/s"


def test_mfu_never_exceeds_one_and_the_peak_is_never_moved():
    peak = measure_peak_flops("cpu", torch.float16, runs=1, max_run_s=0.1)  # a slow dtype here
    fpt = 1e6
    # below the peak: plain MFU, peak kept, no warning; per process under DDP
    m, kept, warning = checked_mfu(0.25 * peak / fpt, fpt, peak)
    assert m == pytest.approx(0.25) and kept == peak and warning == ""
    m, kept, warning = checked_mfu(0.5 * peak / fpt, fpt, peak, world_size=2)
    assert m == pytest.approx(0.25) and kept == peak and warning == ""
    # achieved 2.67x the measured peak (the 267%): MFU 100%, a warning, the peak kept
    m, kept, warning = checked_mfu(2.67 * peak / fpt, fpt, peak)
    assert m == 1.0 and kept == peak
    assert "exceeds the measured peak" in warning and format_flops(peak) in warning


class _State(SimpleNamespace):
    nonfinite = SimpleNamespace(count=lambda: 0)


def test_the_meter_divides_every_report_by_the_start_up_peak(monkeypatch):
    """Three logged intervals on a fake clock: 2x the peak, then 0.5x, then 0.25x. The first
    reports MFU 1.0 with one warning; the later ones 0.5 and 0.25 of the peak printed at
    start-up (a peak raised to the first interval's rate would make them 0.25 and 0.125)."""
    now = [0.0]
    monkeypatch.setattr(meter_module, "clock", lambda: now[0])
    t = load_config(DEBUG, []).train
    fpt, peak = 1e6, 4e9  # 4000 tok/s at the peak
    meter = Meter(1, t, fpt, DistInfo())
    meter.peak, lines = peak, []
    meter.logger = SimpleNamespace(text=lambda line, echo=True: lines.append(line), log=print)
    got = []
    for step, rate in enumerate([2.0, 0.5, 0.25], start=1):
        meter.tick()
        now[0] += t.total_batch_size / (rate * peak / fpt)  # one step at `rate` x the peak
        m = meter.measure(_State(step=step, tokens=step * 1024, train_s=0.0), torch.tensor(1.0), torch.tensor(1.0), 1e-3)  # fmt: skip
        meter.report(step, m)
        got.append(m["mfu"])
    assert got == [1.0, pytest.approx(0.5), pytest.approx(0.25)]
    assert meter.peak == peak
    assert len([x for x in lines if "exceeds the measured peak" in x]) == 1, lines


def test_logged_throughput_excludes_saves_and_evaluations(byte_data, tmp_path, monkeypatch):
    """On a fake throughput clock where each training step takes 1 s and each save or
    evaluation 1000 s, every logged interval is exactly total_batch_size tokens/s: saves at
    2, 4, 6 and evaluations at 4, 6 (and step 0) end intervals instead of counting in them."""
    now = [0.0]
    monkeypatch.setattr(meter_module, "clock", lambda: now[0])

    def taking(seconds, real):
        def timed(*args, **kwargs):
            out = real(*args, **kwargs)
            now[0] += seconds
            return out

        return timed

    monkeypatch.setattr(phases.Run, "train_step", taking(1.0, phases.Run.train_step))
    monkeypatch.setattr(Checkpointer, "save", taking(1000.0, Checkpointer.save))
    monkeypatch.setattr(Evaluator, "run", taking(1000.0, Evaluator.run))
    run_dir = tmp_path / "r"
    args = ["train.max_steps=6", "log.every=3", "checkpoint.every=2", "eval.every=4"]
    run(byte_data, run_dir, *args, "eval.tokens=512", "eval.sample_tokens=1")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "tok_per_s" in r]
    assert [r["tok_per_s"] for r in logged] == [1024.0] * len(logged)
    assert [r["step"] for r in logged] == [2, 3, 4, 6]  # log.every, saves, evaluations


def test_bench_table_prints_the_peak_in_a_unit_that_fits():
    from gptrain.commands.bench import format_table

    row = dict(dtype="bfloat16", compile=False, world_size=1, micro_batch=16, accum=1)
    row |= dict(step_ms=28_000.0, tok_per_s=146.0, peak_tflops=0.0024, mfu=1.0)
    header, _, line = format_table([row]).splitlines()
    cells = dict(zip(header.split("|"), line.split("|"), strict=True))
    assert cells[" peak "].strip() == "2.4 GFLOP/s" and cells[" mfu "].strip() == "100.0%"
    assert "peak_mem_mib" not in header  # a CPU row has no GPU memory to report


def test_bench_table_shows_gpu_memory_only_where_a_row_measured_it():
    from gptrain.commands.bench import format_table

    row = dict(dtype="bfloat16", compile=True, world_size=1, micro_batch=64, accum=2)
    row |= dict(step_ms=250.0, tok_per_s=524_288.0, peak_tflops=762.0, mfu=0.5)
    header, _, gpu, cpu = format_table([{**row, "peak_mem_mib": 31027.4}, row]).splitlines()
    cols = [c.strip() for c in header.strip("|").split("|")]
    assert cols[-1] == "peak_mem_mib"
    assert gpu.strip("|").split("|")[-1].strip() == "31,027"
    assert cpu.strip("|").split("|")[-1].strip() == ""


def test_format_duration():
    assert format_duration(59) == "00:59" and format_duration(3661) == "1:01:01"

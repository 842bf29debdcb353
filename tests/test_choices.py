"""Measured speed choices (gptrain/training/choices.py): the choice follows the timings, a cache
hit times nothing, a damaged cache is ignored with a warning, explicit values win untimed, bad
values are one line with exit code 2, and the real measurement stays within its bounds."""

import json
import os
import sys
import time
from pathlib import Path

import forked
import pytest
import torch

from gptrain.__main__ import main as cli
from gptrain.errors import UserError
from gptrain.training.choices import KERNEL_MARGIN, MARGIN, Shapes, decide
from gptrain.training.timing import CACHE_VERSION

REPO = Path(__file__).resolve().parents[1]
DEBUG = str(REPO / "configs" / "debug.toml")
# configs/debug.toml's shapes (micro-batch 8, seq_len 64, 2 layers of width 64, 2 heads) with Muon
DEBUG_SHAPES = Shapes(8, 64, 2, 64, 2, muon=((64, 64), (64, 256), (192, 64), (256, 64)))
TINY = Shapes(2, 8, 1, 16, 2, muon=((16, 16), (48, 16)))


class FakeTimer:
    """Seconds per label ("block/bfloat16/matmul", "muon/float32", "bf16-probe/bfloat16"); records
    each call and never runs the candidate."""

    def __init__(self, **times):
        self.times = {k.replace("__", "/").replace("_probe", "-probe"): v for k, v in times.items()}
        self.calls = []

    def __call__(self, label, fn, rival):
        self.calls.append(label)
        return self.times.get(label, 1.0)


def twice(labels: list) -> list:
    """The timer's calls for candidates timed in two rounds: in order, then in reverse."""
    return labels + labels[::-1]


def native(**block_and_muon):  # bf16 at 0.4x float32's matmul time
    return FakeTimer(bf16_probe__float32=1.0, bf16_probe__bfloat16=0.4, **block_and_muon)


def test_the_choice_follows_the_fake_timer(tmp_path):
    fast_bf16 = native(block__bfloat16__matmul=0.2, muon__float32=0.5, muon__bfloat16=1.0)
    c = decide("cpu", TINY, "auto", "auto", "auto", timer=fast_bf16, cache_path=None)
    assert (c.dtype, c.attention, c.muon_dtype) == ("bfloat16", "matmul", "float32")
    assert c.how == {"dtype": "measured", "attention": "measured", "muon_dtype": "measured"}
    assert sorted(c.block_ms) == ["bfloat16/matmul", "bfloat16/sdpa", "float32/matmul", "float32/sdpa"]  # fmt: skip
    assert c.block_ms["bfloat16/matmul"] == 200.0 and c.muon_ms == {"float32": 500.0, "bfloat16": 1000.0}  # fmt: skip
    assert "train.dtype=bfloat16" in c.line() and "bfloat16/matmul 200 ms" in c.line()

    flipped = native(block__float32__sdpa=0.2, muon__float32=1.0, muon__bfloat16=0.3)
    c = decide("cpu", TINY, "auto", "auto", "auto", timer=flipped, cache_path=None)
    assert (c.dtype, c.attention, c.muon_dtype) == ("float32", "sdpa", "bfloat16")

    # within MARGIN of the fastest is noise: the first such candidate in the order
    close = native(block__float32__sdpa=1.0, block__bfloat16__matmul=1.0 - MARGIN / 2)
    c = decide("cpu", TINY, "auto", "auto", None, timer=close, cache_path=None)
    assert (c.dtype, c.attention, c.muon_dtype) == ("float32", "sdpa", None)
    # between the kernels of the chosen dtype the margin is KERNEL_MARGIN (the same accuracy)
    close = native(block__bfloat16__sdpa=0.5, block__bfloat16__matmul=0.5 * (1 - KERNEL_MARGIN / 2))  # fmt: skip
    c = decide("cpu", TINY, "auto", "auto", None, timer=close, cache_path=None)
    assert (c.dtype, c.attention) == ("bfloat16", "sdpa")
    ahead = native(block__bfloat16__sdpa=0.5, block__bfloat16__matmul=0.5 * (1 - MARGIN / 2))
    c = decide("cpu", TINY, "auto", "auto", None, timer=ahead, cache_path=None)
    assert (c.dtype, c.attention) == ("bfloat16", "matmul")
    clear = native(block__bfloat16__sdpa=0.5, block__bfloat16__matmul=0.5 * (1 - 2 * MARGIN))
    c = decide("cpu", TINY, "auto", "auto", None, timer=clear, cache_path=None)
    assert (c.dtype, c.attention) == ("bfloat16", "matmul")


class BurstyTimer(FakeTimer):
    """A FakeTimer under a burst of load from elsewhere: its call number `burst` takes 3x."""

    def __init__(self, burst: int, **times):
        super().__init__(**times)
        self.burst = burst

    def __call__(self, label, fn, rival):
        return super().__call__(label, fn, rival) * (3.0 if len(self.calls) == self.burst else 1.0)


def test_a_burst_of_load_during_one_timing_does_not_decide():
    """The block candidates are timed twice, in order and in reverse, each keeping its better
    timing: a burst that slows the faster candidate's first timing (the matmul kernel's, 20%
    faster) would have picked sdpa with one round."""
    times = dict(bf16_probe__float32=1.0, bf16_probe__bfloat16=25.0, block__float32__matmul=0.8)
    bursty = BurstyTimer(burst=4, **times)  # the probe's 2 calls, sdpa's, then matmul's first
    c = decide("cpu", TINY, "auto", "auto", None, timer=bursty, cache_path=None)
    assert bursty.calls[2:] == twice(["block/float32/sdpa", "block/float32/matmul"])
    assert c.attention == "matmul" and c.block_ms == {"float32/sdpa": 1000.0, "float32/matmul": 800.0}  # fmt: skip


def test_emulated_bf16_is_never_timed(tmp_path):
    emulated = FakeTimer(bf16_probe__float32=1.0, bf16_probe__bfloat16=25.0, block__float32__matmul=0.5)  # fmt: skip
    c = decide("cpu", TINY, "auto", "auto", "auto", timer=emulated, cache_path=None)
    assert (c.dtype, c.attention, c.muon_dtype) == ("float32", "matmul", "float32")
    assert c.bf16_ratio == 25.0 and c.how["dtype"] == c.how["muon_dtype"] == "measured: bf16 emulated"  # fmt: skip
    timed = [label for label in emulated.calls if not label.startswith("bf16-probe")]
    assert timed == twice(["block/float32/sdpa", "block/float32/matmul"])  # no bf16, no Muon timing


def test_a_cache_hit_does_no_timing(tmp_path):
    path = tmp_path / "speed_choices.json"
    first = native(block__bfloat16__sdpa=0.3, muon__bfloat16=0.2)
    a = decide("cpu", TINY, "auto", "auto", "auto", timer=first, cache_path=path)
    assert len(first.calls) == 2 + 2 * 4 + 2 * 2 and path.is_file()

    def no_timing(label, fn, rival):
        raise AssertionError(f"timed {label} despite the cache")

    t0 = time.perf_counter()
    b = decide("cpu", TINY, "auto", "auto", "auto", timer=no_timing, cache_path=path)
    assert time.perf_counter() - t0 < 0.1
    assert (b.dtype, b.attention, b.muon_dtype) == (a.dtype, a.attention, a.muon_dtype) == ("bfloat16", "sdpa", "bfloat16")  # fmt: skip
    assert b.block_ms == a.block_ms and b.muon_ms == a.muon_ms and not b.warnings
    assert b.how == {"dtype": "cached", "attention": "cached", "muon_dtype": "cached"}
    # other shapes are another key: timed again (only the block; the probe is the machine's)
    other = native()
    decide("cpu", Shapes(4, 8, 1, 16, 2), "auto", "auto", None, timer=other, cache_path=path)
    assert other.calls == twice(["block/float32/sdpa", "block/float32/matmul", "block/bfloat16/sdpa", "block/bfloat16/matmul"])  # fmt: skip


# an older version's file holds timings of kernels since changed: measured again, like damage
@pytest.mark.parametrize("damage", ["{not json", json.dumps({"version": CACHE_VERSION - 1, "entries": {}}), "[1, 2]"])  # fmt: skip
def test_a_damaged_cache_file_is_ignored_with_a_warning(tmp_path, damage):
    path = tmp_path / "speed_choices.json"
    path.write_text(damage)
    timer = native(block__float32__matmul=0.5)
    c = decide("cpu", TINY, "auto", "auto", None, timer=timer, cache_path=path)
    assert (c.dtype, c.attention) == ("float32", "matmul") and len(timer.calls) == 2 + 2 * 4
    assert len(c.warnings) == 1 and "ignoring the damaged speed-choice cache" in c.warnings[0]
    assert json.loads(path.read_text())["version"] == CACHE_VERSION  # rewritten whole
    assert not decide("cpu", TINY, "auto", "auto", None, timer=None, cache_path=path).warnings


def test_a_damaged_entry_is_ignored_with_a_warning_and_timed_again(tmp_path):
    path = tmp_path / "speed_choices.json"
    decide("cpu", TINY, "auto", "auto", None, timer=native(), cache_path=path)
    data = json.loads(path.read_text())
    key = next(k for k in data["entries"] if k.startswith("block|"))
    data["entries"][key]["float32/sdpa"] = "fast"  # a value no timing gives
    path.write_text(json.dumps(data))
    timer = native(block__bfloat16__sdpa=0.1)
    c = decide("cpu", TINY, "auto", "auto", None, timer=timer, cache_path=path)
    assert len(c.warnings) == 1 and "stale or damaged entry" in c.warnings[0] and key in c.warnings[0]  # fmt: skip
    assert [x for x in timer.calls if x.startswith("block/")] == twice(["block/float32/sdpa", "block/float32/matmul", "block/bfloat16/sdpa", "block/bfloat16/matmul"])  # fmt: skip
    assert (c.dtype, c.attention) == ("bfloat16", "sdpa")


def test_explicit_values_win_without_timing():
    def no_timing(label, fn, rival):
        raise AssertionError(f"timed {label} for an explicit value")

    c = decide("cpu", TINY, "float32", "sdpa", "float32", timer=no_timing, cache_path=None)
    assert (c.dtype, c.attention, c.muon_dtype) == ("float32", "sdpa", "float32")
    assert c.how == {"dtype": "config", "attention": "config", "muon_dtype": "config"}
    c = decide("cpu", TINY, "bfloat16", "matmul", None, timer=no_timing, cache_path=None)
    assert (c.dtype, c.attention, c.muon_dtype, c.bf16_ratio) == ("bfloat16", "matmul", None, None)
    # one key explicit, the others timed: only the candidates the config leaves open
    timer = native(block__float32__matmul=0.1)
    c = decide("cpu", TINY, "float32", "auto", "float32", timer=timer, cache_path=None)
    assert timer.calls == twice(["block/float32/sdpa", "block/float32/matmul"]) and c.attention == "matmul"  # fmt: skip


def test_muon_bfloat16_is_refused_where_bf16_is_emulated():
    emulated = FakeTimer(bf16_probe__float32=1.0, bf16_probe__bfloat16=25.0)
    with pytest.raises(UserError) as e:
        decide("cpu", TINY, "float32", "sdpa", "bfloat16", timer=emulated, cache_path=None)
    msg = str(e.value)
    assert "optim.muon_dtype = 'bfloat16'" in msg and "25.0x" in msg and "optim.muon_dtype=float32" in msg  # fmt: skip
    assert "\n" not in msg
    c = decide("cpu", TINY, "float32", "sdpa", "bfloat16", timer=native(), cache_path=None)
    assert c.muon_dtype == "bfloat16"  # native: as asked


@pytest.mark.parametrize("key", ["train.dtype", "train.attention", "optim.muon_dtype"])
def test_unknown_values_of_the_auto_keys_are_one_line_exit_2(byte_data, tmp_path, capsys, key):
    run_dir = tmp_path / "r"
    args = ["train", "--config", DEBUG, f"--data.dir={byte_data}", f"--run.dir={run_dir}"]
    assert cli([*args, f"--{key}=fastest"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{key} = 'fastest'; allowed: auto" in err[0]
    assert not run_dir.exists()


def test_muon_bfloat16_on_an_avx2_cpu_is_one_line_exit_2(byte_data, tmp_path):
    """The real thing: torch and oneDNN limited to AVX2 (bf16 emulated, see the issue), a fresh
    cache; the probe measures bf16 and the run stops before writing anything."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    env["GPTRAIN_CACHE"] = str(tmp_path / "cache")
    run_dir = tmp_path / "r"
    args = ["--config", DEBUG, f"--data.dir={byte_data}", f"--run.dir={run_dir}"]
    args += ["--optim.name=muon", "--optim.muon_dtype=bfloat16", "--log.progress=false", "--log.plot=false"]  # fmt: skip
    p = forked.run([sys.executable, "-m", "gptrain", "train", *args], env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(err) == 1, p.stderr
    assert "optim.muon_dtype = 'bfloat16'" in err[0] and "use optim.muon_dtype=float32" in err[0]
    assert not run_dir.exists() and not (tmp_path / "cache" / "speed_choices.json").exists()


def test_real_measurement_is_bounded_and_leaves_the_global_rng_alone(tmp_path):
    """configs/debug.toml's shapes, everything auto, with Muon: <= 3 s the first time (2 cores),
    <= 0.1 s from the cache, and the global RNG untouched (exact resume depends on it)."""
    path = tmp_path / "speed_choices.json"
    state = torch.get_rng_state()
    first = decide("cpu", DEBUG_SHAPES, "auto", "auto", "auto", cache_path=path)
    if any("CPU cores from this one" in w for w in first.warnings):  # another job's threads
        pytest.skip(f"other processes crowded this CPU while it timed: {first.warnings[0]}")
    assert first.seconds <= 3.0, first.line()
    assert torch.equal(state, torch.get_rng_state())
    assert len(first.block_ms) in (2, 4) and all(v > 0 for v in first.block_ms.values())
    second = decide("cpu", DEBUG_SHAPES, "auto", "auto", "auto", cache_path=path)
    assert second.seconds <= 0.1 and set(second.how.values()) <= {"cached", "cached: bf16 emulated"}  # fmt: skip
    assert (second.dtype, second.attention, second.muon_dtype) == (first.dtype, first.attention, first.muon_dtype)  # fmt: skip


def test_a_run_shows_its_choices_in_the_first_line_and_summary(byte_data, tmp_path, monkeypatch):
    monkeypatch.setenv("GPTRAIN_CACHE", str(tmp_path / "cache"))
    run_dir = tmp_path / "run"
    args = ["train", "--config", DEBUG, f"--data.dir={byte_data}", f"--run.dir={run_dir}", "--log.progress=false", "--log.plot=false"]  # fmt: skip
    args += ["--train.max_steps=2", "--eval.every=0", "--eval.tokens=512", "--checkpoint.every=0"]
    args += ["--optim.name=muon", "--optim.warmup_steps=1", "--eval.sample_every=0", "--train.attention=auto", "--train.loss=auto"]  # fmt: skip
    assert cli(args) == 0
    first = (run_dir / "train.log").read_text().splitlines()[0]
    assert "speed choices in" in first and "train.dtype=float32 (config)" in first
    assert "train.attention=" in first and "float32/sdpa" in first and "optim.muon_dtype=" in first
    assert "train.loss=" in first and "the head's loss fwd+bwd of 512 rows" in first
    choices = json.loads((run_dir / "summary.json").read_text())["speed_choices"]
    assert choices["dtype"] == "float32" and choices["attention"] in ("sdpa", "matmul")
    assert choices["how"]["attention"] == "measured" and set(choices["block_ms"]) == {"float32/sdpa", "float32/matmul"}  # fmt: skip
    assert choices["muon_dtype"] in ("float32", "bfloat16") and choices["loss"] in (
        "chunked",
        "full",
    )


def test_the_clock_keeps_each_candidate_within_its_share():
    """Clock: warm-up + timed runs while the candidate's share lasts (at most MAX_RUNS); one
    timed run when it is already STOP_FACTOR x slower than its rival; the warm-up alone when it
    took the whole share or the budget is spent. Sleeps are lower bounds, so counts are exact."""
    from gptrain.training.timing import MAX_RUNS, Clock

    def sleeper(seconds):
        calls = []

        def fn():
            calls.append(1)
            time.sleep(seconds)

        return fn, calls

    clock = Clock(candidate_s=0.2, budget_s=10.0)
    fn, calls = sleeper(0.001)
    assert clock("fast", fn) >= 0.001 and len(calls) == 1 + MAX_RUNS
    fn, calls = sleeper(0.06)  # warm-up + runs until 0.2 s are spent: 0.06, 0.12, 0.18, 0.24
    clock("steady", fn)
    assert len(calls) == 4
    fn, calls = sleeper(0.03)
    assert clock("slower", fn, rival=0.01) >= 0.03 and len(calls) == 2
    fn, calls = sleeper(0.25)
    assert clock("slow", fn) >= 0.25 and len(calls) == 1
    spent = Clock(candidate_s=0.2, budget_s=0.05)
    spent("first", sleeper(0.03)[0])  # 0.12 s in all: over this clock's budget
    fn, calls = sleeper(0.001)
    spent("late", fn)
    assert len(calls) == 1


def test_timings_on_a_crowded_cpu_are_used_but_not_cached(tmp_path, monkeypatch):
    """Other processes taking this one's cores while it times (read from /proc/stat): the
    choice stands for this run, the cache is not written (it would outlive the load), a warning."""
    from gptrain.training import timing

    path = tmp_path / "speed_choices.json"
    crowded = native(block__float32__matmul=0.5)
    crowded.crowding = lambda: 1.4
    c = decide("cpu", TINY, "auto", "auto", None, timer=crowded, cache_path=path)
    assert (c.dtype, c.attention) == ("float32", "matmul") and not path.exists()
    assert len(c.warnings) == 1 and "took 1.4 CPU cores" in c.warnings[0]
    calm = native()
    calm.crowding = lambda: 0.2
    decide("cpu", TINY, "auto", "auto", None, timer=calm, cache_path=path)
    assert path.exists()
    # the rule: on 4 CPUs with 2 threads timing, others may use 2 cores before they crowd it
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    start = (100.0, 10.0, 50.0)  # (CPU busy s, this process s, wall clock)
    monkeypatch.setattr(timing, "cpu_now", lambda: (104.0, 11.0, 51.0))  # others: 3 cores
    assert timing.crowding_since(start) == pytest.approx(1.0 - 4 / os.sysconf("SC_CLK_TCK"))
    monkeypatch.setattr(timing, "cpu_now", lambda: (102.5, 11.0, 51.0))  # others: 1.5 cores
    assert timing.crowding_since(start) == 0.0


def test_a_resumed_run_keeps_its_checkpoints_choices_untimed(monkeypatch, tmp_path):
    """speed_choices (training/build.py) with the decisions a checkpoint recorded: every key
    still auto takes them (how: "checkpoint"), the loss path included, and nothing is timed,
    whatever the cache holds; an explicit value still wins; a checkpoint from before train.loss
    was recorded has the loss decided afresh."""
    from gptrain.config.load import load_config
    from gptrain.distributed.runtime import DistInfo
    from gptrain.training import timing
    from gptrain.training.build import build_model, speed_choices

    monkeypatch.setenv("GPTRAIN_CACHE", str(tmp_path))

    def no_timing(*args, **kwargs):
        raise AssertionError("a resumed run timed a candidate")

    monkeypatch.setattr(timing.Clock, "__call__", no_timing)
    cfg = load_config(None, ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "optim.name=muon", "train.dtype=auto", "train.seq_len=32", "train.micro_batch_size=4", "train.total_batch_size=128"])  # fmt: skip
    model = build_model(cfg, 257)
    saved = {"dtype": "float32", "attention": "matmul", "muon_dtype": "float32"}
    saved.update(muon_split="split", loss="full")
    got = speed_choices(cfg, DistInfo(), model, "auto", saved=saved)
    assert got.decisions() == saved and set(got.how.values()) == {"checkpoint"}
    got = speed_choices(cfg, DistInfo(), model, "float32", saved={**saved, "dtype": "bfloat16"})
    assert got.dtype == "float32" and got.how["dtype"] == "config"
    monkeypatch.setattr(timing.Clock, "__call__", lambda self, label, fn, rival: 1.0)
    older = {k: v for k, v in saved.items() if k != "loss"}
    got = speed_choices(cfg, DistInfo(), model, "auto", saved=older)
    assert got.loss == "chunked" and got.how["loss"] == "measured"  # a tie keeps chunked


def test_the_peak_is_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    """cached_peak: the first call measures (measure_peak_flops), a second reads the cache and
    measures nothing; a damaged cache is ignored with a warning and measured again; a peak
    measured on a crowded CPU is used but not cached."""
    from gptrain.training import timing

    calls = []

    def fake_peak(device, dtype):
        calls.append(dtype)
        return 1.5e11

    monkeypatch.setattr(timing, "measure_peak_flops", fake_peak)
    monkeypatch.setattr(timing.Clock, "crowding", lambda self: 0.0)
    path = tmp_path / "speed_choices.json"
    assert timing.cached_peak("cpu", torch.float32, path) == (1.5e11, False, [])
    assert timing.cached_peak("cpu", torch.float32, path) == (1.5e11, True, [])
    assert calls == [torch.float32]  # the second call measured nothing
    assert timing.cached_peak("cpu", torch.bfloat16, path)[:2] == (1.5e11, False)  # per dtype
    path.write_text("{not json")
    peak, hit, warnings = timing.cached_peak("cpu", torch.float32, path)
    assert (peak, hit) == (1.5e11, False) and "damaged speed-choice cache" in warnings[0]
    crowded = tmp_path / "crowded.json"
    monkeypatch.setattr(timing.Clock, "crowding", lambda self: 1.4)
    assert timing.cached_peak("cpu", torch.float32, crowded)[:2] == (1.5e11, False)
    assert not crowded.exists()


def _fake_gpu(monkeypatch, native_bf16: bool = True):
    """decide("cuda", ...) on a CPU: a named GPU, bf16 native or not, blocks never built."""
    from gptrain.training import choices, precision

    monkeypatch.setattr(choices, "machine", lambda device: "a fake GPU")
    monkeypatch.setattr(choices, "block_run", lambda *args: lambda: None)  # no CUDA block here
    monkeypatch.setattr(choices, "cuda_supports_bf16", lambda: native_bf16)
    monkeypatch.setattr(precision, "cuda_supports_bf16", lambda: native_bf16)


@pytest.mark.parametrize("native_bf16", [True, False])
@pytest.mark.parametrize("fsdp", [False, True])
def test_a_gpu_times_float32_against_its_fast_dtype(monkeypatch, native_bf16, fsdp):
    """On CUDA, dtype auto times float32 (TF32 as set) against bf16, or float16 where bf16 is not
    native (not under FSDP: no sharded float16 scaler, so float32 alone), and keeps the faster."""
    from gptrain.training import precision

    _fake_gpu(monkeypatch, native_bf16)
    low = "bfloat16" if native_bf16 else "float16"
    for low_time, expected in ((0.3, low), (1 - MARGIN / 2, "float32")):
        timer = FakeTimer(**{f"block__{low}__sdpa": low_time, f"block__{low}__matmul": low_time})
        c = decide("cuda", TINY, "auto", "auto", None, fsdp=fsdp, timer=timer, cache_path=None)
        timed = sorted({label.split("/")[1] for label in timer.calls})
        if fsdp and not native_bf16:
            assert (c.dtype, timed, c.how["dtype"]) == ("float32", ["float32"], "rule: bf16 not native")  # fmt: skip
            continue
        assert (c.dtype, timed, c.how["dtype"]) == (expected, sorted(["float32", low]), "measured")
        assert precision.resolve_dtype("auto", "cuda", fsdp, measured=c.dtype) == getattr(torch, expected)  # fmt: skip
    assert precision.resolve_dtype("auto", "cuda", fsdp) == getattr(torch, "float32" if fsdp and not native_bf16 else low)  # fmt: skip


def test_a_gpu_times_at_most_gpu_block_flops_of_sequences(monkeypatch):
    """GPT-2 124M at micro-batch 64 x 1024: 37 sequences are timed (2e12 FLOPs of block), not
    64 (~7 GB of float32 activations); a micro-batch under the bound is timed whole."""
    from gptrain.training.choices import GPU_BLOCK_FLOPS
    from gptrain.training.timing import block_flops

    _fake_gpu(monkeypatch)
    gpt2 = Shapes(64, 1024, 12, 768, 12)
    c = decide("cuda", gpt2, "auto", "auto", None, timer=FakeTimer(), cache_path=None)
    assert c.block_tokens == (37, 1024) and 37 * block_flops(gpt2) <= GPU_BLOCK_FLOPS < 38 * block_flops(gpt2)  # fmt: skip
    c = decide("cuda", TINY, "auto", "auto", None, timer=FakeTimer(), cache_path=None)
    assert c.block_tokens == (TINY.micro_batch, TINY.seq_len)


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_a_gpu_too_small_for_the_timing_falls_back_to_the_rule(monkeypatch, dtype):
    """The block timing runs out of GPU memory: no crash; what was auto follows the rule
    (bf16 where native, sdpa) and says so, an explicit value stays, with one warning."""
    _fake_gpu(monkeypatch)

    def oom(label, fn, rival):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 7.00 GiB")

    c = decide("cuda", TINY, dtype, "auto", None, timer=oom, cache_path=None)
    assert (c.dtype, c.attention) == ("bfloat16" if dtype == "auto" else "float32", "sdpa")
    rule = "rule: its timing ran out of memory"
    assert c.how == {"dtype": rule if dtype == "auto" else "config", "attention": rule}
    assert c.block_ms == {} and len(c.warnings) == 1 and "did not fit" in c.warnings[0]
    with pytest.raises(torch.cuda.OutOfMemoryError):  # on a CPU, running out of memory is no choice
        decide("cpu", TINY, "float32", "auto", None, timer=oom, cache_path=None)


def _split_setup(**optim):
    """A tiny Muon model's config, its Muon matrices and a Choices with its Muon dtype."""
    from gptrain.config.load import load_config
    from gptrain.training.build import build_model
    from gptrain.training.choices import Choices
    from gptrain.training.optim import muon_split

    model_keys = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "optim.name=muon"]
    train_keys = ["train.seq_len=32", "train.micro_batch_size=4", "train.total_batch_size=256"]
    extra = [f"optim.{k}={v}" for k, v in optim.items()]
    cfg = load_config(None, model_keys + train_keys + extra)
    model = build_model(cfg, 257)
    out = Choices(dtype="float32", attention="sdpa", muon_dtype="float32")
    return cfg, model, muon_split(model, 0.0)[0], out


def _no_timing(*args, **kwargs):
    raise AssertionError("timed a candidate")


@pytest.mark.parametrize(
    "split_s, redundant_s, want",
    [(1.0, 0.5, "redundant"), (1.0, 1.0 - MARGIN / 2, "split"), (0.5, 1.0, "split")],
)
def test_muon_split_follows_the_timer_at_two_ranks(tmp_path, split_s, redundant_s, want):
    """DDP at 2 ranks: the Muon step timed split vs redundant in two rounds; split unless
    redundant is clearly faster (a tie keeps split); shown in the speed-choice line."""
    from gptrain.distributed.runtime import DistInfo
    from gptrain.training.choices import decide_muon_split

    cfg, _, matrices, out = _split_setup()
    timer = FakeTimer()
    timer.times = {"muon-split/split": split_s, "muon-split/redundant": redundant_s}
    info, cache = DistInfo(world_size=2), tmp_path / "c.json"
    got = decide_muon_split(
        info, matrices, cfg.optim, out, False, None, timer=timer, cache_path=cache
    )
    assert got[:2] == (want, "measured")
    assert timer.calls == twice(["muon-split/split", "muon-split/redundant"])
    out.muon_split, out.how["muon_split"], out.split_ms = got
    out.how.update(dtype="config", attention="config", muon_dtype="config")
    assert f"optim.muon_split={want} (measured) [a Muon step's orthogonalisations" in out.line()


def test_the_muon_split_cache_key_includes_the_world_size(tmp_path):
    """A second start at the same world size reads the cache (times nothing); another world size
    times again, under its own key."""
    from gptrain.distributed.runtime import DistInfo
    from gptrain.training.choices import decide_muon_split

    cfg, _, matrices, out = _split_setup()
    cache = tmp_path / "c.json"
    timer = FakeTimer()
    timer.times = {"muon-split/split": 1.0, "muon-split/redundant": 0.5}
    args = (matrices, cfg.optim, out, False, None)
    decide_muon_split(DistInfo(world_size=2), *args, timer=timer, cache_path=cache)
    got = decide_muon_split(DistInfo(world_size=2), *args, timer=_no_timing, cache_path=cache)
    assert got[:2] == ("redundant", "cached") and got[2]["redundant"] == 500.0
    timer.calls.clear()
    got = decide_muon_split(DistInfo(world_size=3), *args, timer=timer, cache_path=cache)
    assert got[1] == "measured" and len(timer.calls) == 4
    keys = [k for k in json.loads(cache.read_text())["entries"] if k.startswith("muon-split|")]
    assert sorted(json.loads(k.rsplit("|", 1)[1])[0] for k in keys) == [2, 3]


def test_muon_split_untimed_at_one_process_under_fsdp_explicit_or_resumed(monkeypatch, tmp_path):
    """speed_choices (training/build.py) times no Muon step at 1 process (split, by rule), under
    FSDP2 (split) or with an explicit value; a resumed run keeps its recorded choice (how:
    checkpoint) and records it."""
    from gptrain.distributed.runtime import DistInfo
    from gptrain.training import timing
    from gptrain.training.build import speed_choices

    monkeypatch.setenv("GPTRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(timing.Lockstep, "__call__", _no_timing)
    cfg, model, _, _ = _split_setup(muon_dtype="float32")
    saved = {"dtype": "float32", "attention": "sdpa", "muon_dtype": "float32", "loss": "chunked"}
    got = speed_choices(cfg, DistInfo(), model, "auto", saved=saved)
    assert got.muon_split == "split" and got.how["muon_split"].startswith("rule: one process")
    got = speed_choices(cfg, DistInfo(world_size=2), model, "auto", fsdp=True, saved=saved)
    assert got.muon_split == "split" and got.how["muon_split"].startswith("rule: FSDP2")
    resumed = {**saved, "muon_split": "redundant"}
    got = speed_choices(cfg, DistInfo(world_size=2), model, "auto", saved=resumed)
    assert got.decisions() == resumed and got.how["muon_split"] == "checkpoint"
    cfg, model, _, _ = _split_setup(muon_dtype="float32", muon_split="redundant")
    got = speed_choices(cfg, DistInfo(world_size=2), model, "auto", saved=saved)
    assert got.muon_split == "redundant" and got.how["muon_split"] == "config"


# GPT-2 124M's head: width 768, vocabulary 50257 (padded 50304), micro-batch 16 x 1024
GPT2_HEAD = Shapes(16, 1024, 12, 768, 12, vocab=50257, padded_vocab=50304)


def test_the_loss_path_follows_the_fake_timer():
    """train.loss = auto: the head's loss timed chunked vs full in two rounds on at least one
    chunk's rows (GPT-2 on a CPU: one chunk of 667, not the 34 rows BLOCK_FLOPS allows); full
    only when clearly faster; shown in the line. An explicit path and no loss time nothing."""
    for full_s, want in ((0.5, "full"), (1 - MARGIN / 2, "chunked"), (2.0, "chunked")):
        timer = FakeTimer(loss__chunked=1.0, loss__full=full_s)
        c = decide("cpu", GPT2_HEAD, "float32", "sdpa", None, "auto", timer=timer, cache_path=None)
        assert (c.loss, c.how["loss"], c.loss_rows) == (want, "measured", 667)
        assert timer.calls == twice(["loss/chunked", "loss/full"])
        assert c.loss_ms == {"chunked": 1000.0, "full": full_s * 1e3}
        assert f"train.loss={want} (measured) [the head's loss fwd+bwd of 667 rows" in c.line()
    for loss in ("chunked", "full", None):
        c = decide("cpu", GPT2_HEAD, "float32", "sdpa", None, loss, timer=_no_timing, cache_path=None)  # fmt: skip
        assert c.loss == loss and c.decisions()["loss"] == loss
        assert ("train.loss=" in c.line()) == (loss is not None)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_gpu_times_the_full_loss_only_where_its_logits_fit(monkeypatch, compiled):
    """On CUDA the full logits (16 x 1024 rows x 50304 x FULL_LOGITS_BYTES = 9.2 GiB for GPT-2)
    must stay under LOGITS_MEMORY_SHARE of the free memory: with 30 GiB free chunked by rule,
    untimed; with 40 GiB both are timed on GPU_BLOCK_FLOPS' rows (8628), or the compiled loss's
    larger chunk when that is more; a timing out of memory keeps chunked, with a warning."""
    from gptrain.training import choices

    _fake_gpu(monkeypatch)
    monkeypatch.setattr(choices, "loss_run", lambda *args: lambda: None)
    need = 16 * 1024 * 50304 * choices.FULL_LOGITS_BYTES
    for free_gib, timed in ((30, False), (40, True)):
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d, f=free_gib: (f * 2**30, 80 * 2**30))  # fmt: skip
        timer = FakeTimer(loss__full=0.5)
        c = decide("cuda", GPT2_HEAD, "float32", "sdpa", None, "auto", compiled=compiled, timer=timer, cache_path=None)  # fmt: skip
        assert (need > choices.LOGITS_MEMORY_SHARE * free_gib * 2**30) != timed
        assert (c.loss, bool(timer.calls)) == (("full", True) if timed else ("chunked", False))
        if not timed:
            assert c.how["loss"] == f"rule: the full logits need {need / 2**30:.1f} GiB, over 25% of free memory"  # fmt: skip
    assert c.loss_rows == int(2e12 / (6 * 768 * 50304)) == 8628  # compiled chunk: 16384 / 8

    def oom(label, fn, rival):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    c = decide("cuda", GPT2_HEAD, "float32", "sdpa", None, "auto", timer=oom, cache_path=None)
    assert (c.loss, c.how["loss"]) == ("chunked", "rule: its timing ran out of memory")
    assert len(c.warnings) == 1 and "ran out of GPU memory" in c.warnings[0]


def test_the_real_loss_timing_runs_both_paths_and_is_cached(tmp_path, monkeypatch):
    """The real Clock on a small head (512 rows, width 64, vocab 257): both paths timed, the
    choice one of them; a second decision reads the cache and times nothing. A run that compiles
    its loss has both paths compiled before they are timed (here by the aot_eager backend)."""
    small = Shapes(8, 64, 2, 64, 2, vocab=257, padded_vocab=320)
    path = tmp_path / "speed_choices.json"
    compiled, real = [], torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compiled.append(kw) or real(fn, backend="aot_eager", **kw))  # fmt: skip
    c = decide("cpu", small, "float32", "sdpa", None, "auto", compiled=True, cache_path=None)
    assert compiled == [{"dynamic": False}] * 2 and set(c.loss_ms) == {"chunked", "full"}
    first = decide("cpu", small, "float32", "sdpa", None, "auto", cache_path=path)
    assert first.loss in ("chunked", "full") and first.loss_rows == 512 and len(compiled) == 2
    assert set(first.loss_ms) == {"chunked", "full"} and all(v > 0 for v in first.loss_ms.values())
    if any("CPU cores from this one" in w for w in first.warnings):  # another job's threads
        pytest.skip(f"other processes crowded this CPU while it timed: {first.warnings[0]}")
    again = decide("cpu", small, "float32", "sdpa", None, "auto", timer=_no_timing, cache_path=path)  # fmt: skip
    assert (again.loss, again.how["loss"], again.loss_ms) == (first.loss, "cached", first.loss_ms)


def test_the_run_trains_with_the_loss_path_its_choices_name(byte_data):
    """build_training sets the model's loss path from train.loss (or auto's measured choice) and
    records it in the decisions a checkpoint keeps."""
    from gptrain.config.load import load_config
    from gptrain.distributed.runtime import DistInfo
    from gptrain.training.build import build_training

    for loss in ("full", "chunked"):
        cfg = load_config(DEBUG, [f"data.dir={byte_data}", f"train.loss={loss}", "train.dtype=float32", "train.attention=sdpa"])  # fmt: skip
        built = build_training(cfg, DistInfo(), 257, "float32", False)
        assert built[0].loss == loss and built.choices.decisions()["loss"] == loss

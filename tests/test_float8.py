"""train.float8 (gptrain/training/float8.py, parallelize.convert_float8): the layers it may convert,
its refusals (one line, exit 2, nothing written), auto untimed and unseen where there is no FP8,
the measured choice per layer shape on a (faked) FP8 GPU, kept by a resumed run, and checkpoints
that stay plain after the conversion (torchao on the CPU: module swapping and emulated float8)."""

import sys
from pathlib import Path

import pytest
import torch

from gptrain.__main__ import main as cli
from gptrain.config.load import load_config
from gptrain.distributed import parallelize
from gptrain.distributed.runtime import DistInfo
from gptrain.errors import UserError
from gptrain.training import choices
from gptrain.training import float8 as fp8
from gptrain.training.build import build_model, materialise, speed_choices
from gptrain.training.choices import MARGIN, Choices, Shapes, decide

REPO = Path(__file__).resolve().parents[1]
DEBUG = str(REPO / "configs" / "debug.toml")
# GPT-2 124M's blocks: c_attn 768 -> 2304, attn.c_proj 768 -> 768, c_fc 768 -> 3072, mlp.c_proj
# 3072 -> 768; micro-batch 16 x 1024
LINEARS = ((768, 768), (768, 2304), (768, 3072), (3072, 768))
GPT2 = Shapes(16, 1024, 12, 768, 12, linears=LINEARS)
REAL_TORCHAO_VERSION = fp8.torchao_version
# a string condition: evaluated when a marked test starts, so collecting this file (in every
# pytest worker) does not import torchao (seconds on a CPU)
needs_torchao = pytest.mark.skipif(
    "REAL_TORCHAO_VERSION() is None", reason="torchao is not installed (pip install 'gptrain[fp8]')"
)


def _no_timing(*args, **kwargs):
    raise AssertionError("timed a candidate")


def _fake_gpu(monkeypatch, capability=(9, 0), name="NVIDIA H100 80GB HBM3", torchao="0.18.0"):
    """decide("cuda", ...) on a CPU: a GPU of this name and compute capability with native bf16;
    torchao's version as given (None: not installed; "real": as this machine has it)."""
    from gptrain.training import precision

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(choices, "machine", lambda device: f"{name} (fake)")
    monkeypatch.setattr(choices, "cuda_supports_bf16", lambda: True)
    monkeypatch.setattr(precision, "cuda_supports_bf16", lambda: True)
    version = REAL_TORCHAO_VERSION if torchao == "real" else lambda: torchao
    monkeypatch.setattr(fp8, "torchao_version", version)


class ShapeTimer:
    """Seconds per "INxOUT/candidate" of the float8 timings (1 ms where not given): linear_run is
    replaced by runs that name their shape and candidate. Records the runs made and timed."""

    def __init__(self, monkeypatch, **times):
        self.times, self.calls, self.runs = times, [], []

        def linear_run(device, shape, rows, candidate, compiled, weights):
            self.runs.append((shape, rows, candidate, compiled, weights))
            return lambda: f"{shape[0]}x{shape[1]}/{candidate}"

        monkeypatch.setattr(fp8, "linear_run", linear_run)

    def __call__(self, label, fn, rival):
        assert label.startswith("float8/"), label
        self.calls.append(fn())
        return self.times.get(fn(), 1e-3)


def test_the_layers_float8_may_convert():
    """In the blocks only (not the tied head, whose 64 x 320 would pass the size rule), both
    dimensions multiples of 16: configs/debug.toml's and GPT-2's, listed by hand; a width that is
    no multiple of 16 has none."""
    debug = build_model(load_config(DEBUG, []), 257, meta=True)
    want = {}
    for i in range(2):
        h = f"transformer.h.{i}."
        want |= {h + "attn.c_attn": (64, 192), h + "attn.c_proj": (64, 64)}
        want |= {h + "mlp.c_fc": (64, 256), h + "mlp.c_proj": (256, 64)}
    assert parallelize.float8_layers(debug) == want
    gpt2 = build_model(load_config(None, ["model.preset=gpt2"]), 50257, meta=True)
    layers = parallelize.float8_layers(gpt2)
    assert len(layers) == 4 * 12 and set(layers.values()) == set(LINEARS)
    odd = build_model(load_config(None, ["model.n_embd=24", "model.n_head=2"]), 257, meta=True)
    assert parallelize.float8_layers(odd) == {}


def test_the_nanochat_layers_float8_may_convert():
    """nanochat: c_q, c_k, c_v, c_proj, c_fc, c_proj of each block, listed by hand (GQA: k and v
    narrower than q); not the untied head, nor the embedding."""
    cfg = load_config(DEBUG, ["model.arch=nanochat", "model.n_head=4", "model.n_kv_head=2"])
    model = build_model(cfg, 257, meta=True)
    want = {}
    for i in range(2):
        h = f"transformer.h.{i}."
        want |= {h + "attn.c_q": (64, 64), h + "attn.c_k": (64, 32), h + "attn.c_v": (64, 32)}
        want |= {h + "attn.c_proj": (64, 64), h + "mlp.c_fc": (64, 256), h + "mlp.c_proj": (256, 64)}  # fmt: skip
    assert parallelize.float8_layers(model) == want


def test_on_is_refused_with_one_line_where_it_cannot_run(monkeypatch):
    """train.float8 = on: a CPU, a GPU under compute capability 8.9 (named, with its capability),
    torchao missing (its import fails), another dtype than bf16: one line, nothing timed."""

    def refused(device, dtype="bfloat16") -> str:
        with pytest.raises(UserError) as e:
            decide(device, GPT2, dtype, "sdpa", float8="on", timer=_no_timing, cache_path=None)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert refused("cpu").startswith("train.float8 = on needs a GPU with FP8 matmuls (CUDA compute capability >= 8.9), but this run's device is cpu")  # fmt: skip
    _fake_gpu(monkeypatch, capability=(8, 0), name="NVIDIA A100-SXM4-80GB")
    assert "but NVIDIA A100-SXM4-80GB (cuda:0) has compute capability 8.0" in refused("cuda:0")
    _fake_gpu(monkeypatch, capability=(9, 0), torchao="real")
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao fails
    assert refused("cuda") == "train.float8 = on needs torchao: pip install 'gptrain[fp8]'"
    _fake_gpu(monkeypatch)
    for dtype in ("float32", "float16"):
        assert f"but train.dtype = '{dtype}'; set --train.dtype=bfloat16" in refused("cuda", dtype)
    with pytest.raises(UserError, match="train.float8 = 'on' computes under bf16"):
        load_config(DEBUG, ["train.float8=on", "train.dtype=float32"])


def test_on_is_refused_before_anything_is_written(byte_data, tmp_path, capsys):
    """`gptrain train` with train.float8 = on on this CPU, or with a value it does not know:
    exit code 2, one line, no run directory."""
    run_dir = tmp_path / "r"
    args = ["train", "--config", DEBUG, f"--data.dir={byte_data}", f"--run.dir={run_dir}"]
    args += ["--log.progress=false", "--log.plot=false", "--train.dtype=bfloat16"]
    for value, said in (("on", "this run's device is cpu"), ("fast", "allowed: auto, on, off")):
        assert cli([*args, f"--train.float8={value}"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0] and "train.float8" in err[0]
        assert not run_dir.exists()


@pytest.mark.parametrize("capability", [None, (8, 0), (8, 6)])
def test_auto_is_off_untimed_and_unseen_without_fp8(monkeypatch, capability):
    """train.float8 = auto on a CPU or a GPU under 8.9: nothing timed, torchao never imported,
    nothing recorded, no line, no warning; so is None (a caller that does not decide float8)."""
    if capability:
        _fake_gpu(monkeypatch, capability=capability)
    monkeypatch.setattr(fp8, "torchao_version", _no_timing)
    device = "cuda" if capability else "cpu"
    for float8 in ("auto", None):
        c = decide(device, GPT2, "bfloat16", "sdpa", float8=float8, timer=_no_timing, cache_path=None)  # fmt: skip
        assert c.float8 is None and "float8" not in c.how and "float8" not in c.decisions()
        assert "float8" not in c.line() and not c.warnings


def test_auto_converts_the_shapes_where_float8_is_clearly_faster(monkeypatch, tmp_path):
    """A faked H100: each shape timed bf16 vs float8 in two rounds on the run's 16 x 1024 rows,
    compiled as the run is, float32 weights (bf16 under FSDP2); float8 only where faster by
    MARGIN (768x2304 is within it); shown in the line, recorded; a second start reads the cache."""
    _fake_gpu(monkeypatch)
    times = {"768x768/float8": 1.5e-3, "768x2304/float8": (1 - MARGIN / 2) * 1e-3}
    times |= {"768x3072/float8": 0.7e-3, "3072x768/float8": 0.8e-3}
    timer = ShapeTimer(monkeypatch, **times)
    cache = tmp_path / "speed_choices.json"
    args = ("cuda", GPT2, "bfloat16", "sdpa")
    c = decide(*args, float8="auto", compiled=True, timer=timer, cache_path=cache)
    assert (c.float8.layers, c.how["float8"], c.float8.rows) == ("768x3072,3072x768", "measured", 16384)  # fmt: skip
    assert c.decisions()["float8"] == "768x3072,3072x768"
    assert fp8.parse(c.float8.layers) == ((768, 3072), (3072, 768))
    pairs = [[f"{i}x{o}/bfloat16", f"{i}x{o}/float8"] for i, o in LINEARS]
    assert timer.calls == [t for p in pairs for t in p + p[::-1]]
    assert {r[1:] for r in timer.runs} == {(16384, "bfloat16", True, "float32"), (16384, "float8", True, "float32")}  # fmt: skip
    assert c.float8.ms["768x3072"] == pytest.approx({"bfloat16": 1.0, "float8": 0.7})
    line = "train.float8=768x3072,3072x768 (measured) [one Linear fwd+bwd of 16384 rows, bf16 vs float8: 768x768 1 vs 1.5 ms, 768x2304 1 vs 0.95 ms"  # fmt: skip
    assert line in c.line()
    again = decide(*args, float8="auto", compiled=True, timer=_no_timing, cache_path=cache)
    assert (again.float8, again.how["float8"]) == (c.float8, "cached")
    fsdp = ShapeTimer(monkeypatch)
    c = decide(*args, float8="auto", fsdp=True, timer=fsdp, cache_path=None)
    assert c.float8.layers == "off" and {r[3:] for r in fsdp.runs} == {(False, "bfloat16")}


def test_auto_is_off_by_rule_on_an_fp8_gpu(monkeypatch):
    """A faked H100, auto: float32 compute, no eligible layer or torchao missing (one warning
    naming the extra): off untimed; a timing that runs out of memory: off with a warning."""
    _fake_gpu(monkeypatch)
    c = decide("cuda", GPT2, "float32", "sdpa", float8="auto", timer=_no_timing, cache_path=None)
    assert (c.float8.layers, c.how["float8"]) == ("off", "rule: train.dtype = float32, float8 training runs under bf16")  # fmt: skip
    bare = Shapes(16, 1024, 12, 768, 12)
    c = decide("cuda", bare, "bfloat16", "sdpa", float8="auto", timer=_no_timing, cache_path=None)
    assert c.float8.layers == "off" and "multiples of 16" in c.how["float8"] and not c.warnings
    _fake_gpu(monkeypatch, torchao=None)
    c = decide("cuda", GPT2, "bfloat16", "sdpa", float8="auto", timer=_no_timing, cache_path=None)
    assert (c.float8.layers, c.how["float8"]) == ("off", "rule: torchao is not installed")
    assert len(c.warnings) == 1 and "pip install 'gptrain[fp8]'" in c.warnings[0]
    _fake_gpu(monkeypatch)
    ShapeTimer(monkeypatch)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def oom(label, fn, rival):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    c = decide("cuda", GPT2, "bfloat16", "sdpa", float8="auto", timer=oom, cache_path=None)
    assert (c.float8.layers, c.how["float8"]) == ("off", "rule: its timing ran out of memory")
    assert len(c.warnings) == 1 and "ran out of GPU memory" in c.warnings[0]


def test_on_and_off_are_untimed_and_auto_bf16_follows_on(monkeypatch):
    """On a faked H100: on converts every eligible shape, off none, untimed (how: config); with
    train.dtype = auto, on makes the dtype bf16 by rule, float32 is not timed."""
    _fake_gpu(monkeypatch)
    for value, want in (("on", "768x768,768x2304,768x3072,3072x768"), ("off", "off")):
        c = decide("cuda", GPT2, "bfloat16", "sdpa", float8=value, timer=_no_timing, cache_path=None)  # fmt: skip
        assert (c.float8.layers, c.how["float8"]) == (want, "config")
    monkeypatch.setattr(choices, "block_run", lambda *args: lambda: None)
    timed = []
    tiny = Shapes(2, 8, 1, 16, 2, linears=((16, 16), (16, 48), (16, 64), (64, 16)))
    c = decide("cuda", tiny, "auto", "auto", float8="on", timer=lambda label, fn, rival: timed.append(label) or 1.0, cache_path=None)  # fmt: skip
    assert (c.dtype, c.how["dtype"], c.float8.layers) == ("bfloat16", "rule: train.float8 = on", "16x16,16x48,16x64,64x16")  # fmt: skip
    kernels = ["block/bfloat16/sdpa", "block/bfloat16/matmul"]
    assert timed == kernels + kernels[::-1]  # float32 is no candidate


def test_a_resumed_run_keeps_its_float8_layers(monkeypatch, tmp_path):
    """speed_choices with a checkpoint's decisions: its float8 layers kept untimed on an FP8 GPU
    (how: checkpoint), "off" kept too; on a CPU they cannot run: decided again, with a warning."""
    monkeypatch.setenv("GPTRAIN_CACHE", str(tmp_path))
    cfg = load_config(DEBUG, ["train.dtype=auto", "train.attention=auto", "train.loss=auto"])
    model = build_model(cfg, 257, meta=True)
    saved = {"dtype": "bfloat16", "attention": "sdpa", "muon_dtype": None, "muon_split": None}
    saved |= {"loss": "chunked", "float8": "64x256,256x64"}
    _fake_gpu(monkeypatch)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * 2**30, 80 * 2**30))
    cuda = DistInfo(device="cuda:0")
    got = speed_choices(cfg, cuda, model, "auto", saved=saved)
    assert got.decisions() == saved and set(got.how.values()) == {"checkpoint"}
    got = speed_choices(cfg, cuda, model, "auto", saved={**saved, "float8": "off"})
    assert (got.float8.layers, got.how["float8"]) == ("off", "checkpoint")
    monkeypatch.undo()
    monkeypatch.setenv("GPTRAIN_CACHE", str(tmp_path))
    got = speed_choices(cfg, DistInfo(), model, "auto", saved=saved)
    assert got.float8 is None and "decided again" in got.warnings[-1]


def test_the_recorded_text_parses_back():
    """The recorded choice back to shapes (parse(None) and parse("off"): none; damaged text, as a
    checkpoint's meta.json may hold: a UserError); decisions() records it where decided."""
    assert fp8.parse("64x256,256x64") == ((64, 256), (256, 64)) and fp8.parse("off") == ()
    for bad in ("64x", "x", "64x256,", "0x16", "64x256x3"):
        with pytest.raises(UserError):
            fp8.parse(bad)
    assert Choices("float32", "sdpa", None, float8=fp8.Float8("64x64")).decisions()["float8"] == "64x64"  # fmt: skip


@needs_torchao
def test_conversion_keeps_the_state_dict_and_the_head():
    """wrap_model with float8 shapes (torchao on the CPU: the module swap needs no FP8): the
    chosen layers become Float8Linear holding the same Parameters, the others and the tied head
    stay nn.Linear; state-dict keys and values are the unconverted model's, loadable into a plain
    model. On `meta` (FSDP2's build) the converted model then initialises exactly as a plain one."""
    from gptrain.config.sections import DistConfig

    cfg = load_config(DEBUG, [])
    model = build_model(cfg, 257)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    wrapped = parallelize.wrap_model(model, DistConfig(), info=DistInfo(), compile=False, param_dtype=torch.float32, float8=((64, 256), (256, 64)))  # fmt: skip
    kinds = {n: type(m).__name__ for n, m in wrapped.named_modules() if isinstance(m, torch.nn.Linear)}  # fmt: skip
    mlp = {n for n in kinds if ".mlp." in n}
    assert {n for n, k in kinds.items() if k == "Float8Linear"} == mlp and len(mlp) == 4
    assert kinds["lm_head"] == "Linear" and kinds["transformer.h.0.attn.c_attn"] == "Linear"
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    assert all(p is params[n] for n, p in model.named_parameters(remove_duplicate=False) if n in params)  # fmt: skip
    plain = build_model(cfg, 257)
    plain.load_state_dict(after)
    torch.manual_seed(cfg.train.seed)
    meta = build_model(cfg, 257, meta=True)
    assert parallelize.convert_float8(meta, ((64, 192),)) == ["transformer.h.0.attn.c_attn", "transformer.h.1.attn.c_attn"]  # fmt: skip
    torch.manual_seed(cfg.train.seed)
    fresh = build_model(cfg, 257)
    torch.manual_seed(cfg.train.seed)
    materialise(meta, "cpu")
    meta.init_weights()
    assert all(torch.equal(a, b) for a, b in zip(meta.state_dict().values(), fresh.state_dict().values(), strict=True))  # fmt: skip


@needs_torchao
def test_converted_layers_compute_in_float8():
    """Emulated float8 on the CPU: the converted model's loss is close to the plain model's
    (within float8's rounding) but not equal (so the layers do round to float8), and every
    converted weight gets a gradient close to the plain one; the timing run of a Linear runs
    both candidates and leaves the global RNG alone."""
    cfg = load_config(DEBUG, [])
    plain, converted = build_model(cfg, 257), build_model(cfg, 257)
    converted.load_state_dict(plain.state_dict())
    assert len(parallelize.convert_float8(converted, ((64, 256), (256, 64), (64, 192), (64, 64)), emulate=True)) == 8  # fmt: skip
    x = torch.randint(0, 257, (4, 64), generator=torch.Generator().manual_seed(0))
    losses = []
    for m in (plain, converted):
        _, loss = m(x, x)
        loss.backward()
        losses.append(loss.item())
    assert losses[0] != losses[1] and losses[1] == pytest.approx(losses[0], rel=2e-2)
    for (name, a), b in zip(plain.named_parameters(), converted.parameters(), strict=True):
        cos = torch.nn.functional.cosine_similarity(a.grad.flatten(), b.grad.flatten(), dim=0)
        assert cos > 0.98, name
    state = torch.get_rng_state()
    for candidate in fp8.CANDIDATES:
        run = fp8.linear_run("cpu", (64, 256), 32, candidate, False, "float32", emulate=True)
        run()
    assert torch.equal(state, torch.get_rng_state())


def _gpu_check():
    sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))
    import gpu_check

    return gpu_check


@pytest.mark.parametrize("dry", [False, True])
def test_the_gpu_check_float8_row(monkeypatch, dry):
    """benchmarks/gpu/gpu_check.py --float8: row 0's bench with train.float8 off, on and auto (a
    dry run: off and auto), tokens/s against off, auto's choice; OK unless auto is over 3% slower
    than off on a GPU. Fake benches: nothing runs."""
    gpu_check = _gpu_check()
    check = gpu_check.Check.__new__(gpu_check.Check)
    check.dry, check.gpus, check.device, check.rows = dry, 1, "cpu" if dry else "cuda", []
    for auto, verdict in ((505_000, "OK"), (480_000, "auto SLOWER than off")):
        tok = {"off": 500_000, "on": 450_000, "auto": auto}
        benched = []

        def bench(name, *extra, tok=tok, benched=benched):
            benched.append(extra)
            return {"tok_per_s": tok[extra[-1].removeprefix("--train.float8=")]}

        monkeypatch.setattr(check, "bench", bench)
        monkeypatch.setattr(check, "float8_choice", lambda: "768x3072,3072x768 (measured)")
        check.rows = []
        check.run(set(), float8=True)
        ((name, result, got, _),) = check.rows
        modes = ["off", "auto"] if dry else ["off", "on", "auto"]
        assert benched == [(f"--train.float8={m}",) for m in modes] and "train.float8" in name
        assert got.startswith("OK" if dry else verdict)
        assert result.startswith("off 500,000 tok/s, " + ("" if dry else "on 450,000 (0.90x), "))
        assert f"auto {auto:,} ({auto / 500_000:.2f}x); auto: 768x3072,3072x768 (measured)" in result  # fmt: skip


@pytest.mark.parametrize(
    "argv, rows, float8",
    [
        ([], {0, 1, 2, 3, 4, 5}, False),
        (["--float8"], set(), True),
        (["--float8", "--rows", "0"], {0}, True),
    ],  # fmt: skip
)
def test_the_gpu_check_runs_the_float8_row_when_asked(monkeypatch, capsys, argv, rows, float8):
    """--float8 alone: only the float8 row; with --rows: those rows too; without: as before."""
    gpu_check = _gpu_check()
    ran = []

    class Check:
        def __init__(self, dry, work):
            self.failed = False

        def run(self, rows, float8=False):
            ran.append((rows, float8))

        def table(self):
            return "table"

    monkeypatch.setattr(gpu_check, "Check", Check)
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--dry-run", *argv])
    assert gpu_check.main() == 0 and ran == [(rows, float8)]

"""Speed choices that hold on every rank (gptrain/training/facts.py, choices.py, recorded.py,
batch.py): every rank's facts gathered in one all-gather, the choice taken from them by one pure
function (faked facts here), recorded choices reused on resume and decided again one by one, an
explicit value that differs is one line, and an FSDP2 trial that runs out of memory on one rank
stops every rank with the same line."""

import json
from pathlib import Path

import pytest
import torch
from dist_helpers import spawn, wait_all

from gptrain.config.load import load_config
from gptrain.distributed.runtime import DistInfo
from gptrain.errors import UserError
from gptrain.training import batch, facts
from gptrain.training import float8 as fp8
from gptrain.training.choices import Choices, Shapes, decide, decide_muon_split
from gptrain.training.recorded import overridden, record

GIB = 2**30
H100 = facts.Facts("NVIDIA H100 80GB HBM3 (cc 9.0)", "9.0", True, True, 70 * GIB)
A100 = facts.Facts("NVIDIA A100-SXM4-80GB (cc 8.0)", "8.0", False, True, 20 * GIB)
V100 = facts.Facts("Tesla V100-SXM2-32GB (cc 7.0)", "7.0", False, False, 30 * GIB)
SAPPHIRE = facts.Facts("Xeon 8480 (family 6 model 143)", "amx_bf16 avx2 avx512_bf16 avx512f", False, True, 24 * GIB)  # fmt: skip
EPYC = facts.Facts("EPYC 7763 (family 25 model 1)", "avx2", False, False, 24 * GIB)
TINY = Shapes(2, 8, 1, 16, 2, muon=((16, 16), (48, 16)), vocab=257, padded_vocab=320)


class Timer:
    """Seconds per label ("block/bfloat16/sdpa", "loss/full"); never runs a candidate."""

    def __init__(self, **times):
        self.times, self.calls = times, []

    def __call__(self, label, fn, rival):
        self.calls.append(label)
        return self.times.get(label, 1.0)


def no_timing(*args, **kwargs):
    raise AssertionError("timed a candidate")


def test_agree_keeps_only_what_every_rank_can_run():
    """The pure function: FP8 only where every rank has it, native bf16 only where every rank
    has it, the least free memory, alike only for one device name and capability; a cache key
    that names the devices where ranks differ, and nothing where they are alike."""
    same = facts.agree([H100, H100])
    assert (same.fp8, same.bf16, same.free, same.alike, same.cache_key()) == (True, True, 70 * GIB, True, "")  # fmt: skip
    mixed = facts.agree([H100, A100, H100])
    assert (mixed.fp8, mixed.bf16, mixed.free, mixed.alike, mixed.no_fp8) == (False, True, 20 * GIB, False, (1,))  # fmt: skip
    assert mixed.differ() == f"{H100.name} [9.0] (ranks 0,2); {A100.name} [8.0] (rank 1)"
    assert mixed.cache_key() == f"|ranks {mixed.differ()}"
    cpus = facts.agree([SAPPHIRE, EPYC])
    assert not cpus.bf16 and not cpus.alike and cpus.bf16_native(True) is False
    assert facts.agree([EPYC, EPYC]).bf16_native(True)  # alike: the main process's probe holds
    unknown = facts.agree([facts.Facts("cpu", "", False, None, None)] * 2)
    assert unknown.free is None and unknown.logits_fit(10**15, 0.25) and not unknown.bf16
    assert mixed.logits_fit(5 * GIB, 0.25) and not mixed.logits_fit(5 * GIB + 1, 0.25)


def test_local_facts_read_this_machine_and_the_fault_fakes_one_rank(monkeypatch):
    """A CPU's facts: its name as the timing cache names it, its memory shared by the ranks of
    its host (MemAvailable), bf16 from its flags; GPTRAIN_FAULT=facts@MIB/RANK fakes rank RANK's
    facts only: no FP8, no native bf16, MIB MiB, another name."""
    from gptrain.training.timing import machine

    monkeypatch.setattr(facts, "available_memory", lambda: 8 * GIB)
    mine = facts.local("cpu", rank=0, sharing=2, env={})
    assert (mine.name, mine.fp8, mine.free) == (machine("cpu"), False, 4 * GIB)
    assert mine.bf16 == bool(set(mine.capability.split()) & facts.BF16_FLAGS)
    env = {"GPTRAIN_FAULT": "spike@3,facts@16/1"}
    assert facts.local("cpu", 0, 2, env) == mine
    faked = facts.local("cpu", 1, 2, env)
    assert (faked.fp8, faked.bf16, faked.free) == (False, False, 16 * 2**20)
    assert faked.name != mine.name and not facts.agree([mine, faked]).alike
    assert facts.faked_mib(3, {"GPTRAIN_FAULT": "facts@2"}) == 2  # no rank: every rank
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():  # the reference: the kernel's own count
        kib = next(int(line.split()[1]) for line in meminfo.read_text().splitlines() if line.startswith("MemAvailable:"))  # fmt: skip
        monkeypatch.undo()
        assert abs(facts.available_memory() - kib * 1024) < 2 * GIB


def test_full_logits_and_bf16_follow_the_rank_with_the_least(tmp_path):
    """On CPUs too: the full logits are timed only where they fit in the least free memory of
    any rank (else chunked by rule, untimed); bf16 is no candidate where a peer computes it by
    emulation, even where the main process's probe finds it native; the cache keys the timings
    by the ranks' devices where they differ."""
    need = TINY.micro_batch * TINY.seq_len * TINY.padded_vocab * 12
    roomy = facts.agree([SAPPHIRE, SAPPHIRE])
    small = facts.agree([SAPPHIRE, facts.Facts("small", "avx2", False, True, 4 * need - 1)])
    timer = Timer(**{"bf16-probe/bfloat16": 0.4, "bf16-probe/float32": 1.0, "loss/full": 0.1})
    timer.times.update({"block/bfloat16/sdpa": 0.2, "block/bfloat16/matmul": 0.2})
    c = decide("cpu", TINY, "auto", "auto", None, "auto", timer=timer, cache_path=None, limits=roomy)  # fmt: skip
    assert (c.dtype, c.loss, c.how["loss"]) == ("bfloat16", "full", "measured")
    timer.calls.clear()
    c = decide("cpu", TINY, "auto", "auto", None, "auto", timer=timer, cache_path=None, limits=small)  # fmt: skip
    assert c.loss == "chunked" and c.how["loss"].startswith("rule: the full logits need")
    assert "of the least free memory of any rank" in c.how["loss"] and not any(x.startswith("loss/") for x in timer.calls)  # fmt: skip
    mixed = facts.agree([SAPPHIRE, EPYC])
    cache = tmp_path / "c.json"
    c = decide("cpu", TINY, "auto", "sdpa", None, "chunked", timer=timer, cache_path=cache, limits=mixed)  # fmt: skip
    assert c.dtype == "float32" and c.how["dtype"] == f"rule: bf16 not native on every rank ({mixed.differ()})"  # fmt: skip
    assert all(mixed.cache_key() in k for k in json.loads(cache.read_text())["entries"])


def _fake_gpu(monkeypatch):
    from gptrain.training import choices

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100")
    monkeypatch.setattr(choices, "machine", lambda device: "NVIDIA H100 (fake)")
    monkeypatch.setattr(choices, "cuda_supports_bf16", lambda: True)
    monkeypatch.setattr(fp8, "torchao_version", lambda: "0.18.0")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * GIB, 80 * GIB))
    monkeypatch.setattr(fp8, "linear_run", lambda *args, **kwargs: lambda: None)  # no CUDA here


def test_float8_only_where_every_rank_has_fp8(monkeypatch):
    """The main process on an H100, a peer on an A100: auto is off by rule naming the rank
    without FP8 (untimed), on is one line; alike H100s time it as before."""
    _fake_gpu(monkeypatch)
    gpt = Shapes(4, 64, 1, 768, 12, linears=((768, 3072), (3072, 768)))
    mixed = facts.agree([H100, A100])
    c = decide("cuda:0", gpt, "bfloat16", "sdpa", float8="auto", timer=no_timing, cache_path=None, limits=mixed)  # fmt: skip
    assert (c.float8.layers, c.how["float8"]) == ("off", f"rule: rank(s) 1 have none ({mixed.differ()})")  # fmt: skip
    with pytest.raises(UserError, match=r"train.float8 = on needs a GPU with FP8 matmuls .* but rank\(s\) 1 have none") as e:  # fmt: skip
        decide("cuda:0", gpt, "bfloat16", "sdpa", float8="on", timer=no_timing, cache_path=None, limits=mixed)  # fmt: skip
    assert "\n" not in str(e.value)
    timer = Timer(**{"float8/float8": 0.1, "float8/bfloat16": 1.0})
    c = decide("cuda:0", gpt, "bfloat16", "sdpa", float8="auto", timer=timer, cache_path=None, limits=facts.agree([H100, H100]))  # fmt: skip
    assert c.float8.layers == "768x3072,3072x768" and c.how["float8"] == "measured"


def _split_setup(**optim):
    from gptrain.training.build import build_model
    from gptrain.training.optim import muon_split

    keys = ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "optim.name=muon"]
    keys += ["train.seq_len=32", "train.micro_batch_size=4", "train.total_batch_size=256"]
    cfg = load_config(None, keys + [f"optim.{k}={v}" for k, v in optim.items()])
    model = build_model(cfg, 257)
    return cfg, muon_split(model, 0.0)[0], Choices("float32", "sdpa", "float32")


def test_muon_split_is_redundant_only_on_ranks_that_are_alike(tmp_path):
    """Ranks that differ: auto is split by rule (untimed), a recorded redundant is decided again
    with one line naming both values, an explicit redundant is one line, exit 2; alike ranks
    time it as before, under a cache key that carries no ranks."""
    cfg, matrices, out = _split_setup()
    two, mixed = DistInfo(world_size=2), facts.agree([H100, A100])
    args = (two, matrices, cfg.optim, out, False)
    got = decide_muon_split(*args, None, timer=no_timing, cache_path=None, limits=mixed)
    assert got == ("split", f"rule: ranks differ ({mixed.differ()})", {})
    got = decide_muon_split(*args, {"muon_split": "redundant"}, timer=no_timing, cache_path=None, limits=mixed)  # fmt: skip
    assert got[:2] == ("split", f"rule: ranks differ ({mixed.differ()})")
    assert out.warnings == [f"the checkpoint's optim.muon_split = redundant cannot run here (ranks differ ({mixed.differ()})); decided again: split, so the numerics differ from the uninterrupted run"]  # fmt: skip
    got = decide_muon_split(*args, {"muon_split": "redundant"}, timer=no_timing, cache_path=None, limits=facts.agree([H100, H100]))  # fmt: skip
    assert got[:2] == ("redundant", "checkpoint")
    cfg, matrices, out = _split_setup(muon_split="redundant")
    with pytest.raises(UserError, match="optim.muon_split = 'redundant' .* but ranks differ"):
        decide_muon_split(two, matrices, cfg.optim, out, False, None, timer=no_timing, cache_path=None, limits=mixed)  # fmt: skip


def test_recorded_choices_are_kept_and_only_the_one_that_cannot_run_is_decided_again():
    """decide with a checkpoint's record: every key still auto keeps its value untimed (how:
    checkpoint); on a CPU the recorded float8 layers (no FP8) and, where a rank has too little
    memory, the recorded full logits are decided again, each alone, each with one line naming
    it and both values; explicit values win over the record."""
    record = {"dtype": "bfloat16", "attention": "matmul", "loss": "full", "float8": "16x48"}
    record |= {"muon_dtype": "float32", "muon_split": "split", "compile": False}
    alike = facts.agree([SAPPHIRE, SAPPHIRE])
    c = decide("cpu", TINY, "auto", "auto", "auto", "auto", "auto", timer=no_timing, cache_path=None, limits=alike, recorded={**record, "float8": "off"})  # fmt: skip
    assert (c.dtype, c.attention, c.loss, c.muon_dtype) == ("bfloat16", "matmul", "full", "float32")
    assert set(c.how.values()) == {"checkpoint"} and c.warnings == []
    poor = facts.agree([SAPPHIRE, facts.Facts("small", "avx2", False, False, 2**16)])
    timer = Timer(**{"loss/full": 0.1})
    c = decide("cpu", TINY, "auto", "auto", "auto", "auto", "auto", timer=timer, cache_path=None, limits=poor, recorded=record)  # fmt: skip
    assert timer.calls == []  # nothing timed: the rest kept, the loss chunked by rule
    assert (c.dtype, c.attention, c.muon_dtype, c.loss, c.float8) == ("bfloat16", "matmul", "float32", "chunked", None)  # fmt: skip
    assert {k: v for k, v in c.how.items() if v != "checkpoint"} == {"loss": c.how["loss"]}
    assert len(c.warnings) == 2
    assert c.warnings[0].startswith("the checkpoint's train.loss = full cannot run here (the full logits need ")  # fmt: skip
    assert c.warnings[0].endswith("decided again: chunked, so the numerics differ from the uninterrupted run")  # fmt: skip
    assert c.warnings[1] == "the checkpoint's train.float8 = 16x48 cannot run here (this run's device is cpu); decided again: off, so the numerics differ from the uninterrupted run"  # fmt: skip
    c = decide("cpu", TINY, "float32", "sdpa", "float32", "chunked", None, timer=no_timing, cache_path=None, limits=alike, recorded=record)  # fmt: skip
    assert (c.attention, c.loss, c.how["attention"]) == ("sdpa", "chunked", "config")


def test_a_recorded_bf16_muon_where_bf16_is_emulated_is_decided_again_alone():
    """A checkpoint's optim.muon_dtype = bfloat16 resumed where bf16 is emulated: Muon's dtype
    alone is decided again (float32), with its line; the rest stays as recorded."""
    timer = Timer(**{"bf16-probe/bfloat16": 30.0, "bf16-probe/float32": 1.0})
    record = {"dtype": "float32", "attention": "sdpa", "muon_dtype": "bfloat16"}
    c = decide("cpu", TINY, "auto", "auto", "auto", timer=timer, cache_path=None, recorded=record)
    assert (c.dtype, c.attention, c.muon_dtype) == ("float32", "sdpa", "float32")
    assert (c.how["dtype"], c.how["muon_dtype"]) == ("checkpoint", "measured: bf16 emulated")
    assert c.warnings == ["the checkpoint's optim.muon_dtype = bfloat16 cannot run here (bf16 is emulated: a bf16 matmul measured 30.0x float32's time); decided again: float32, so the numerics differ from the uninterrupted run"]  # fmt: skip
    with pytest.raises(UserError, match="optim.muon_dtype = 'bfloat16' but this device"):
        decide("cpu", TINY, "float32", "sdpa", "bfloat16", timer=timer, cache_path=None, recorded=record)  # fmt: skip


def test_an_explicit_value_that_differs_from_the_record_is_one_line_each():
    """overridden: one line per explicit value (how config, and train.compile) that differs from
    the recorded choice, naming the key and both values; kept or equal values say nothing."""
    out = Choices("float32", "sdpa", "float32", muon_split="split", loss="full")
    out.how = {"dtype": "config", "attention": "checkpoint", "muon_dtype": "config", "loss": "config", "muon_split": "config"}  # fmt: skip
    saved = {"dtype": "bfloat16", "attention": "matmul", "muon_dtype": "float32", "loss": "chunked"}
    saved |= {"muon_split": "redundant", "compile": False, "micro_batch_size": 8}
    lines = overridden(out.decisions() | {"compile": True}, out.how, saved)
    tail = "(explicit) differs from the checkpoint's recorded"
    assert [line.split(" = ")[0] for line in lines] == ["train.dtype", "train.loss", "optim.muon_split", "train.compile"]  # fmt: skip
    assert lines[0] == f"train.dtype = float32 {tail} bfloat16; the explicit value wins, so the numerics differ from the uninterrupted run"  # fmt: skip
    assert lines[3].startswith(f"train.compile = True {tail} False")


def test_the_record_holds_the_decisions_the_micro_batch_and_compile():
    c = Choices("float32", "sdpa", None, loss="chunked")
    got = record(c, False, 4)
    assert got == {"dtype": "float32", "attention": "sdpa", "muon_dtype": None, "muon_split": None, "loss": "chunked", "compile": False, "micro_batch_size": 4}  # fmt: skip


def _train(*overrides):
    return load_config(
        None,
        [
            "train.seq_len=16",
            "train.total_batch_size=256",
            "train.micro_batch_size=auto",
            *overrides,
        ],
    ).train


def test_a_resumed_auto_micro_batch_reuses_the_recorded_one(monkeypatch):
    """resolve with the checkpoint's micro-batch: on a CPU auto takes it (16 sequences per
    process: plan() would take 16), silently; a GPU tries it first and goes below it only where
    it does not fit, with one line; a recorded size that no longer divides (another world size)
    is decided again with one line; an explicit size that differs is one line."""
    t, one = _train(), DistInfo()
    assert batch.resolve(t, one)[0] == 16  # the reference: what a fresh start takes
    warnings: list = []
    assert batch.resolve(t, one, recorded=4, warnings=warnings) == (4, 4) and warnings == []
    gpu = DistInfo(device="cuda:0")
    tried = []
    monkeypatch.setattr(batch, "trial_fits", lambda w, m, a, mb, *rest: tried.append(mb) or mb <= 2)  # fmt: skip
    assert batch.resolve(t, gpu, object(), object(), None, 257, recorded=4, warnings=warnings) == (2, 8)  # fmt: skip
    assert tried == [4, 2] and warnings == ["the checkpoint's train.micro_batch_size = 4 cannot run here (it does not fit in GPU memory here); decided again: 2, so the numerics differ from the uninterrupted run"]  # fmt: skip
    warnings.clear()
    assert batch.resolve(t, DistInfo(world_size=2), recorded=16, warnings=warnings)[0] == 8
    assert warnings == ["the checkpoint's train.micro_batch_size = 16 cannot run here (it does not divide the 8 sequences per process at world size 2); decided again: 8, so the numerics differ from the uninterrupted run"]  # fmt: skip
    warnings.clear()
    assert batch.resolve(_train("train.micro_batch_size=8"), one, recorded=4, warnings=warnings)[0] == 8  # fmt: skip
    assert warnings == ["train.micro_batch_size = 8 (explicit) differs from the checkpoint's recorded 4; the explicit value wins, so the numerics differ from the uninterrupted run"]  # fmt: skip


WORKER = """
import os, sys, json
import torch
from gptrain.distributed import runtime as dist
from gptrain.errors import UserError
from gptrain.training import batch, facts
info = dist.DistInfo.from_env("cpu")
dist.init(info, "gloo", 60)
out = {"facts": [f.name for f in facts.gather(info)]}
try:
    measure = lambda mb: None if (info.rank == 1 and mb == 2) else 1100
    batch.fsdp_fit([8, 4, 2, 1], measure, 1000, 10_000, lambda mb: 0, None, lambda ok: batch.agreed(ok, "cpu"))
except UserError as e:
    out["error"] = str(e)
open(sys.argv[1] + "." + str(info.rank), "w").write(json.dumps(out))
dist.teardown()
"""


def test_two_ranks_gather_their_facts_and_stop_alike_on_a_trial_out_of_memory(tmp_path):
    """Two gloo ranks, rank 1's facts faked (GPTRAIN_FAULT=facts@64/1): every rank gets both
    ranks' facts in rank order; rank 1's second FSDP2 trial runs out of memory: both ranks stop
    with the same line naming rank 1, neither waits for the other."""
    out = tmp_path / "out"
    procs = spawn(["-c", WORKER, str(out)], GPTRAIN_FAULT="facts@64/1")
    results = wait_all(procs, timeout=120)
    for rank, (rc, _, e) in enumerate(results):
        assert rc == 0, (rank, e[-2000:])
    got = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    assert got[0] == got[1]
    names = got[0]["facts"]
    assert names[1] == f"{names[0]} (faked by GPTRAIN_FAULT=facts@64/1)"
    assert got[0]["error"].startswith("train.micro_batch_size = auto: the FSDP2 trial of 2 sequence(s) per process ran out of GPU memory on rank(s) 1, ")  # fmt: skip

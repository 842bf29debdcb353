"""Measured speed choices: `train.dtype = auto`, `train.attention = auto` and `optim.muon_dtype =
auto`, decided by timing this run's own shapes on this device at start-up, cached per machine.

What is timed (only what the config leaves to auto; an explicit value always wins, untimed):

- bf16 probe (CPUs): a 256^3 matmul in float32 and in bf16 on one thread (a property of the
  core, and one thread is not slowed by other processes' threads as a team is). bf16 is native
  when it takes at most 2x float32's time (native, AVX512-BF16 or AMX: ~0.3-0.5x; emulated,
  AVX2-only: 10-35x). Where it is emulated nothing else is timed in bf16 (it would lose by 10x
  and cost seconds) and `optim.muon_dtype = bfloat16` is refused. On a GPU bf16 is native from
  compute capability 8.0.
- block: forward + backward of ONE transformer block at the run's (micro-batch, seq_len, n_embd,
  n_head), in each candidate dtype x attention kernel (float32/bfloat16 x sdpa/matmul on a CPU;
  on a GPU the dtype keeps its rule, see precision.auto_cuda_dtype, and the kernels are timed).
  On a CPU the micro-batch is cut to at most BLOCK_FLOPS per run (default preset: 5 of 16
  sequences); matmul is a candidate only while the probabilities it keeps for backward, for all
  layers, stay under MATMUL_MEMORY.
- muon: one Newton-Schulz orthogonalisation of each distinct Muon matrix shape, bf16 vs float32.

Each candidate: one warm-up run, then timed runs until CANDIDATE_S is spent (at most MAX_RUNS,
at least one), the best kept; a candidate already STOP_FACTOR x slower than the best so far after
its first timed run is not run again; a warm-up longer than CANDIDATE_S, or one after BUDGET_S in
all, is the candidate's timing. With at most 2 + 4 + 2 candidates the start-up stays under ~3 s
on 2 cores. The choice is the first candidate (float32 before bf16, sdpa before matmul) within
MARGIN of the fastest: closer than that is timing noise, and a choice should not flip on noise.

The timings are cached as JSON in cache_dir()/speed_choices.json, keyed by the machine (CPU model
name, torch's CPU capability, ONEDNN_MAX_CPU_ISA and threads; or the GPU's name), the torch
version and the shapes, so a second run times nothing (delete the file to measure again). Timings
taken while other processes took cores from this one's threads (CROWDED, from /proc/stat) are
used but not cached, with a warning: a choice measured on a busy machine would outlive the load.
A damaged file or entry is ignored with a warning and rewritten.
The decision is made on the main process and sent to every rank.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch

from gptrain.errors import UserError
from gptrain.logs.mfu import synchronize
from gptrain.training.muon import orthogonalise
from gptrain.training.precision import (
    DTYPES,
    auto_cuda_dtype,
    cuda_supports_bf16,
    mixed_precision,
    resolve_dtype,
)

CACHE_VERSION = 1
CANDIDATE_S, BUDGET_S, MAX_RUNS, STOP_FACTOR, MARGIN = 0.4, 2.5, 5, 2.0, 0.1
CROWDED = 0.5  # cores other processes may take from this one's threads while it times
BF16_EMULATED_RATIO = 2.0  # bf16 matmul time / float32's above which bf16 counts as emulated
BLOCK_FLOPS = 8e9  # CPU: the most FLOPs one timed block run may take (~60 ms in float32)
MATMUL_MEMORY = 2**30  # bytes of probabilities matmul attention may keep for backward
_DTYPES = ("float32", "bfloat16", "float16")
NAMES = {  # every candidate name a cache entry of each kind may hold
    "bf16-probe": {"float32", "bfloat16"},
    "block": {f"{d}/{k}" for d in _DTYPES for k in ("sdpa", "matmul")},
    "muon": {"float32", "bfloat16"},
}


@dataclass(frozen=True)
class Shapes:
    """What the timings depend on: the run's micro-batch and window, its block, its Muon matrices."""

    micro_batch: int
    seq_len: int
    n_layer: int
    n_embd: int
    n_head: int
    gelu: str = "tanh"
    bias: bool = True
    muon: tuple[tuple[int, int], ...] = ()  # distinct shapes of the Muon matrices
    ns_steps: int = 5


@dataclass
class Choices:
    """The decisions, how each was made (config, rule, measured, cached) and the timings behind them."""

    dtype: str
    attention: str
    muon_dtype: str | None  # None: the run has no Muon
    how: dict = field(default_factory=dict)
    block_ms: dict = field(default_factory=dict)  # "dtype/kernel" -> ms per forward + backward
    block_tokens: tuple = ()  # (sequences, seq_len) of the timed block
    muon_ms: dict = field(default_factory=dict)  # dtype -> ms for one matrix of each shape
    bf16_ratio: float | None = None  # bf16 / float32 matmul time (None: not probed)
    seconds: float = 0.0  # wall time spent deciding
    warnings: list = field(default_factory=list)

    @property
    def muon_torch_dtype(self) -> torch.dtype | None:
        return DTYPES[self.muon_dtype] if self.muon_dtype else None

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "warnings"}

    def line(self) -> str:
        """One line for the run's log: each choice, how it was made and the timings behind it."""

        def ms(times: dict) -> str:
            return ", ".join(f"{k} {v:.3g} ms" for k, v in times.items())

        parts = [f"train.dtype={self.dtype} ({self.how['dtype']})"]
        parts.append(f"train.attention={self.attention} ({self.how['attention']})")
        if self.block_ms:
            n, t = self.block_tokens
            parts[-1] += f" [one block fwd+bwd of {n}x{t} tokens: {ms(self.block_ms)}]"
        if self.muon_dtype:
            parts.append(f"optim.muon_dtype={self.muon_dtype} ({self.how['muon_dtype']})")
            if self.muon_ms:
                parts[-1] += f" [orthogonalising one matrix of each shape: {ms(self.muon_ms)}]"
        if self.bf16_ratio is not None:
            parts.append(f"bf16 matmul {self.bf16_ratio:.2g}x float32's time")
        return f"speed choices in {self.seconds:.2f} s: " + ", ".join(parts)


class Clock:
    """Real timing of one candidate (see the module docstring): seconds of its best run."""

    def __init__(self, candidate_s: float = CANDIDATE_S, budget_s: float = BUDGET_S):
        self.candidate_s, self.budget_s, self.total = candidate_s, budget_s, 0.0
        self.cpu = _cpu_now()

    def crowding(self) -> float:
        """Cores other processes took from this one's threads since the clock started."""
        return _crowding(self.cpu)

    def __call__(self, label: str, fn, rival: float = math.inf) -> float:
        t0 = time.perf_counter()
        fn()  # warm-up: kernel selection, allocator, one-off costs
        spent, best, runs = time.perf_counter() - t0, math.inf, 0
        if spent > self.candidate_s or self.total > self.budget_s:  # no time for more runs
            self.total += spent
            return spent
        while runs == 0 or (runs < MAX_RUNS and spent < self.candidate_s):
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            best, spent, runs = min(best, dt), spent + dt, runs + 1
            if best > STOP_FACTOR * rival:
                break
        self.total += spent
        return best


def machine(device: str) -> str:
    """What a cached timing is valid for: the device, as named by its maker and by torch."""
    if device.startswith("cuda"):
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} (cc {major}.{minor})"
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            info = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line)  # fmt: skip
        info = {k.strip(): v.strip() for k, v in info.items()}
        name = f"{info.get('model name', name)} (family {info.get('cpu family', '?')} model {info.get('model', '?')})"  # fmt: skip
    except OSError:
        pass
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "")
    return f"{name}, {torch.backends.cpu.get_cpu_capability()}{', oneDNN ' + isa if isa else ''}, {torch.get_num_threads()} threads"  # fmt: skip


class Timings:
    """Seconds per candidate: from the JSON cache where it has them ({key: {candidate: seconds}}),
    the rest timed by `timer` and added. Damaged parts of the file are dropped with a warning."""

    def __init__(self, path: Path | None, where: str, timer, warnings: list):
        self.path, self.where, self.timer, self.warnings = path, where, timer, warnings
        self.entries, self.hits, self.dirty = {}, [], False
        if path is None or not path.exists():
            return
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or data.get("version") != CACHE_VERSION:
                raise ValueError(f"not a version-{CACHE_VERSION} speed-choice cache")
            if not isinstance(data.get("entries"), dict):
                raise ValueError("no 'entries' table")
            self.entries = data["entries"]
        except (OSError, ValueError) as e:
            warnings.append(f"ignoring the damaged speed-choice cache {path} ({e}); measuring again")  # fmt: skip

    def __call__(self, kind: str, shape, candidates: dict) -> dict:
        """{name: seconds} for candidates {name: make} (make() -> the run to time)."""
        key = f"{kind}|{self.where}|{json.dumps(shape)}"
        known = self.entries.get(key, {})
        if not (isinstance(known, dict) and all(k in NAMES[kind] and isinstance(v, float) and 0 < v < math.inf for k, v in known.items())):  # fmt: skip
            self.warnings.append(f"ignoring a stale or damaged entry of {self.path}: {key}; measuring again")  # fmt: skip
            known = {}
        missing = [c for c in candidates if c not in known]
        self.hits.append(not missing)
        for name in missing:
            rival = min((known[c] for c in candidates if c in known), default=math.inf)
            known[name] = self.timer(f"{kind}/{name}", candidates[name](), rival)
        if missing:
            self.entries[key], self.dirty = known, True
        return {c: known[c] for c in candidates}

    def save(self) -> None:
        if self.path is None or not self.dirty:
            return
        try:  # merge with what other runs wrote meanwhile; write atomically
            fresh = Timings(self.path, self.where, None, []).entries
            data = {"version": CACHE_VERSION, "entries": {**fresh, **self.entries}}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError as e:
            self.warnings.append(f"cannot write the speed-choice cache {self.path}: {e}")


def default_cache_path() -> Path:
    from gptrain.cache import cache_dir

    return cache_dir() / "speed_choices.json"


def decide(device: str, shapes: Shapes, dtype: str = "auto", attention: str = "auto", muon_dtype: str | None = None, *, fsdp: bool = False, timer=None, cache_path: Path | None | bool = True) -> Choices:  # fmt: skip
    """The run's dtype, attention kernel and (muon_dtype not None) Muon dtype; explicit values are
    kept untimed. `timer(label, fn, rival) -> seconds` times a candidate (default: Clock(); its
    crowding(), when it has one, decides whether the timings may be cached);
    cache_path True: the gptrain cache, None/False: no cache. A UserError for optim.muon_dtype =
    bfloat16 where bf16 is not native."""
    start, timer = time.perf_counter(), timer or Clock()
    if dtype != "auto":
        resolve_dtype(dtype, torch.device(device).type)  # float16 off CUDA: refused before timing
    warnings: list = []
    path = default_cache_path() if cache_path is True else (cache_path or None)
    where = f"{machine(device)}|torch {torch.__version__}"
    measure = Timings(path, where, timer, warnings)

    cuda = device.startswith("cuda")
    no_bf16 = "rule: bf16 not native" if cuda else "measured: bf16 emulated"
    out = Choices(dtype=dtype, attention=attention, muon_dtype=muon_dtype, warnings=warnings)
    wants_bf16 = dtype == "auto" or (dtype == "bfloat16" and attention == "auto") or muon_dtype in ("auto", "bfloat16")  # fmt: skip
    native = True
    if cuda:
        native = cuda_supports_bf16()
    elif wants_bf16:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # a property of one core; threads would time their contention
        try:
            mm = measure("bf16-probe", 256, {d: partial(_matmul, device, d) for d in ("float32", "bfloat16")})  # fmt: skip
        finally:
            torch.set_num_threads(threads)
        out.bf16_ratio = mm["bfloat16"] / mm["float32"]
        native = out.bf16_ratio <= BF16_EMULATED_RATIO
    if muon_dtype == "bfloat16" and not native:
        why = "compute capability < 8.0" if cuda else f"a bf16 matmul measured {out.bf16_ratio:.1f}x float32's time"  # fmt: skip
        raise UserError(
            f"optim.muon_dtype = 'bfloat16' but this device computes bf16 only by emulation ({why}); use optim.muon_dtype=float32 or auto"
        )

    # dtype x attention: one block of the run's shapes
    if dtype != "auto":
        dtypes, out.how["dtype"] = [dtype], "config"
    elif cuda:
        dtypes, out.how["dtype"] = [auto_cuda_dtype(fsdp)], "rule"
    else:
        dtypes, out.how["dtype"] = ["float32"] + ["bfloat16"] * native, "measured"
    s = shapes
    kept = s.n_layer * s.micro_batch * s.n_head * s.seq_len * (s.seq_len + 1) // 2 * 6
    kernels = ["sdpa"] + ["matmul"] * (kept <= MATMUL_MEMORY) if attention == "auto" else [attention]  # fmt: skip
    out.how["attention"] = "config" if attention != "auto" else "measured"
    if kernels == ["sdpa"] and attention == "auto":
        out.how["attention"] = f"rule: matmul would keep {kept / 2**30:.1f} GiB for backward"
    combos = [f"{d}/{k}" for d in dtypes for k in kernels]
    if len(combos) > 1:
        slow = max(1.0, out.bf16_ratio or 1.0) if "bfloat16" in dtypes else 1.0  # emulated bf16
        n = s.micro_batch if cuda else max(1, min(s.micro_batch, int(BLOCK_FLOPS / slow / _block_flops(s))))  # fmt: skip
        shape = [n, s.seq_len, s.n_embd, s.n_head, s.gelu, s.bias]
        makes = {c: partial(_block, device, s, n, c) for c in combos}
        times = measure("block", shape, makes)
        out.block_ms, out.block_tokens = {c: t * 1e3 for c, t in times.items()}, (n, s.seq_len)
        out.dtype, out.attention = _pick(times, combos).split("/")
    else:
        out.dtype, out.attention = combos[0].split("/")
    if len(dtypes) == 1 and out.how["dtype"] == "measured":
        out.how["dtype"] = no_bf16

    # Muon's orthogonalisation
    if muon_dtype == "auto":
        options = ["float32"] + ["bfloat16"] * native
        if len(options) > 1 and s.muon:
            makes = {d: partial(_newton_schulz, device, s, d) for d in options}
            times = measure("muon", [list(m) for m in s.muon] + [s.ns_steps], makes)
            out.muon_ms = {d: t * 1e3 for d, t in times.items()}
            out.muon_dtype = _pick(times, options)
        else:
            out.muon_dtype = options[0]
        out.how["muon_dtype"] = "measured" if native else no_bf16
    elif muon_dtype:
        out.how["muon_dtype"] = "config"
    if measure.hits and all(measure.hits):
        out.how = {k: v.replace("measured", "cached") for k, v in out.how.items()}
    crowding = timer.crowding() if hasattr(timer, "crowding") and not cuda else 0.0
    if measure.dirty and crowding > CROWDED:
        warnings.append(f"other processes took {crowding:.1f} CPU cores from this one while it timed its speed choices: used, not cached")  # fmt: skip
    else:
        measure.save()
    out.seconds = time.perf_counter() - start
    return out


def for_run(cfg, info, model, dtype: str, fsdp: bool = False) -> Choices:
    """decide() for a run: cfg (a config.Config) and its built `model` give the shapes (the
    micro-batch a CPU uses, the model's block, its Muon matrices), `dtype` is train.dtype (bench
    passes its own), `fsdp` whether it shards. Decided on the main process; every rank gets the
    same Choices."""
    from gptrain.distributed import runtime as dist
    from gptrain.training import batch
    from gptrain.training.optim import muon_split

    c, t, o = model.config, cfg.train, cfg.optim
    muon = o.name == "muon"
    matrices = {tuple(p.shape) for p in muon_split(model, 0.0)[0]} if muon else set()
    mb = batch.plan(t, info.world_size)[0]  # what a CPU uses, a GPU tries first
    shapes = Shapes(mb, t.seq_len, c.n_layer, c.n_embd, c.n_head, c.gelu, c.bias, tuple(sorted(matrices)), o.muon_ns_steps)  # fmt: skip
    muon_dtype = o.muon_dtype if muon else None
    return dist.from_main(info, lambda: decide(info.device, shapes, dtype, t.attention, muon_dtype, fsdp=fsdp))  # fmt: skip


def _cpu_now() -> tuple | None:
    """(seconds any CPU was busy, seconds this process ran, wall clock); None without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    t = os.times()
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait
    return busy, t.user + t.system, time.perf_counter()


def _crowding(start: tuple | None) -> float:
    """Cores other processes took, since `start`, beyond those this process's threads leave free."""
    end = _cpu_now()
    if start is None or end is None:
        return 0.0
    busy, own, wall = (b - a for a, b in zip(start, end, strict=True))
    ticks = 4 / os.sysconf("SC_CLK_TCK")  # both counters move in clock ticks (10 ms): their error
    spare = (os.cpu_count() or 1) - torch.get_num_threads()
    return max(0.0, (busy - own - ticks) / max(wall, 1e-6) - spare)


def _pick(times: dict, order: list) -> str:
    """The first candidate of `order` within MARGIN of the fastest: closer is timing noise."""
    fastest = min(times[c] for c in order)
    return next(c for c in order if (1 - MARGIN) * times[c] <= fastest)


def _block_flops(s: Shapes) -> float:
    """Forward + backward FLOPs of one block for one sequence: 3x the forward's matmuls."""
    return 3 * s.seq_len * (24 * s.n_embd**2 + 4 * s.seq_len * s.n_embd)


def _generator(device: str) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(0)  # the global RNG is never touched


def _matmul(device: str, dtype: str):
    """The run of a 256^3 matmul in `dtype`."""
    a = torch.randn(256, 256, device=device, generator=_generator(device)).to(DTYPES[dtype])
    return lambda: (a @ a, synchronize(device))


def _newton_schulz(device: str, s: Shapes, dtype: str):
    """The run of one orthogonalisation in `dtype` of a matrix of each of s.muon's shapes."""
    gen = _generator(device)
    mats = [torch.randn(m, device=device, generator=gen) for m in s.muon]
    return lambda: ([orthogonalise(g, s.ns_steps, DTYPES[dtype]) for g in mats], synchronize(device))  # fmt: skip


def _block(device: str, s: Shapes, n: int, combo: str):
    """The run of one transformer block's forward + backward on `n` sequences under the autocast
    of combo's dtype, with its attention kernel (combo: "bfloat16/matmul")."""
    from gptrain.model.gpt import Block, GPTConfig

    dtype, kernel = combo.split("/")
    cfg = GPTConfig(vocab_size=64, block_size=s.seq_len, n_layer=1, n_head=s.n_head, n_embd=s.n_embd, dropout=0.0, bias=s.bias, gelu=s.gelu)  # fmt: skip
    with torch.device("meta"):
        block = Block(cfg)
    block.to_empty(device=device)
    gen = _generator(device)
    with torch.no_grad():
        for name, p in block.named_parameters():
            ln_weight = name.startswith("ln_") and name.endswith("weight")
            p.normal_(1.0 if ln_weight else 0.0, 0.02, generator=gen)
    block.attn.impl = kernel
    x = torch.randn(n, s.seq_len, s.n_embd, device=device, generator=gen, requires_grad=True)
    autocast, _ = mixed_precision(DTYPES[dtype], torch.device(device).type)

    def run():
        block.zero_grad(set_to_none=True)
        x.grad = None
        with autocast:
            y = block(x)
        y.float().sum().backward()
        synchronize(device)

    return run

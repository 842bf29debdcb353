"""How the speed choices (training/choices.py) time a candidate, and where the timings are cached.

Each candidate: one warm-up run, then timed runs until CANDIDATE_S is spent (at most MAX_RUNS,
at least one), the best kept; a candidate already STOP_FACTOR x slower than the best so far after
its first timed run is not run again; a warm-up longer than CANDIDATE_S, or one after BUDGET_S in
all, is the candidate's timing. The block and Muon candidates are timed in two rounds, in order and
then in reverse, each keeping its better timing, so that a burst of load from a shared machine's
neighbours slows one timing of a candidate rather than decide against it (a one-round timing
once cached sdpa for the bench shapes, where matmul attention is 1.5x faster). With 2 probe
timings and 2 x (4 + 2) candidate timings the start-up stays under ~3 s on 2 cores. The dtype
is the first (float32 before bf16) within choices.MARGIN of the fastest: closer than that is
timing noise, and precision should not be given up for noise; the attention kernel of that dtype
is the first (sdpa before matmul) within the smaller KERNEL_MARGIN, as both are equally accurate.
The Muon step split over DDP ranks communicates, so it is timed by `Lockstep` on every rank at
once (a fixed number of runs, the max over the ranks), in two rounds like the block.

The timings are cached as JSON in cache_dir()/speed_choices.json, keyed by the machine (CPU model
name, torch's CPU capability, ONEDNN_MAX_CPU_ISA and threads; or the GPU's name), the torch
version and the shapes, so a second run times nothing (delete the file to measure again). The
measured peak FLOP/s that MFU divides by (logs/mfu.py) is kept there too, per dtype
(`cached_peak`). Timings taken while other processes took cores from this one's threads (CROWDED, from /proc/stat) are
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
from functools import partial
from pathlib import Path

import torch

from gptrain.cache import cache_dir
from gptrain.logs.mfu import measure_peak_flops, synchronize
from gptrain.training.muon import EPS, NS_COEFFICIENTS, Update, _Plan, orthogonalise
from gptrain.training.precision import DTYPES, mixed_precision

CANDIDATE_S, BUDGET_S, MAX_RUNS, STOP_FACTOR = 0.4, 2.5, 5, 2.0
_DTYPES = ("float32", "bfloat16", "float16")
LOCKSTEP_RUNS = 3  # timed runs of each candidate that communicates (Lockstep)
CROWDED = 0.5  # cores other processes may take from this one's threads while it times
# the workloads below take `s`, the run's choices.Shapes (micro_batch, seq_len, n_embd, n_head,
# gelu, bias, muon matrix shapes, ns_steps), with the model's own config where build.py gives it


# Raised when a timed kernel changes, so that timings of the old one are measured again
# (2: matmul attention writes c_proj's layout and sums dK, dV inside its matmuls).
CACHE_VERSION = 2


NAMES = {  # every candidate name a cache entry of each kind may hold
    "bf16-probe": {"float32", "bfloat16"},
    "block": {f"{d}/{k}" for d in _DTYPES for k in ("sdpa", "matmul")},
    "muon": {"float32", "bfloat16"},
    "muon-split": {"split", "redundant"},
    "loss": {"chunked", "full"},
    "float8": {"bfloat16", "float8"},
    "peak": set(_DTYPES),  # not seconds: the measured peak FLOP/s of that dtype
}


class Clock:
    """Real timing of one candidate (see the module docstring): seconds of its best run."""

    def __init__(self, candidate_s: float = CANDIDATE_S, budget_s: float = BUDGET_S):
        self.candidate_s, self.budget_s, self.total = candidate_s, budget_s, 0.0
        self.cpu = cpu_now()

    def crowding(self) -> float:
        """Cores other processes took from this one's threads since the clock started."""
        return crowding_since(self.cpu)

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


class Lockstep:
    """Timing of a candidate that communicates, the same on every rank of `group`: one warm-up,
    then `runs` timed runs (none where the slowest rank's warm-up took over CANDIDATE_S: then that
    warm-up is the timing), each started together (a one-element all-reduce), the best of each
    rank's runs, then the max over the ranks (the step waits for the slowest). Every rank makes the
    same calls in the same order, so no collective of a candidate waits on a rank that stopped;
    each is bounded by the group's time-out (dist.timeout_s)."""

    def __init__(self, group, runs: int = LOCKSTEP_RUNS, candidate_s: float = CANDIDATE_S):
        self.group, self.runs, self.candidate_s = group, runs, candidate_s
        self.cpu = cpu_now()

    def crowding(self) -> float:
        return crowding_since(self.cpu)

    def _max(self, seconds: float) -> float:
        import torch.distributed as dist

        t = torch.tensor([seconds], dtype=torch.float64)  # CPU: gloo, also beside nccl
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t.item()

    def __call__(self, label: str, fn, rival: float = math.inf) -> float:
        t0 = time.perf_counter()
        fn()
        warm = self._max(time.perf_counter() - t0)
        if warm > self.candidate_s:
            return warm
        best = math.inf
        for _ in range(self.runs):
            self._max(0.0)  # start together
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return self._max(best)


def machine(device: str) -> str:
    """What a cached timing is valid for: the device, as named by its maker and by torch."""
    if device.startswith("cuda"):
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} (cc {major}.{minor})"
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            info = dict(
                line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line
            )
        info = {k.strip(): v.strip() for k, v in info.items()}
        name = f"{info.get('model name', name)} (family {info.get('cpu family', '?')} model {info.get('model', '?')})"
    except OSError:
        pass
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA", "")
    return f"{name}, {torch.backends.cpu.get_cpu_capability()}{', oneDNN ' + isa if isa else ''}, {torch.get_num_threads()} threads"


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
            warnings.append(
                f"ignoring the damaged speed-choice cache {path} ({e}); measuring again"
            )

    def __call__(self, kind: str, shape, candidates: dict, rounds: int = 1) -> dict:
        """{name: seconds} for candidates {name: make} (make() -> the run to time). With rounds=2
        the candidates to time are timed twice, in order and then in reverse, each keeping its
        better timing: a burst of load from elsewhere (a shared machine's neighbours) then slows
        one of each candidate's timings, not the whole of one candidate's."""
        key = self.key(kind, shape)
        known = self.entries.get(key, {})
        if not (
            isinstance(known, dict)
            and all(
                k in NAMES[kind] and isinstance(v, float) and 0 < v < math.inf
                for k, v in known.items()
            )
        ):
            self.warnings.append(
                f"ignoring a stale or damaged entry of {self.path}: {key}; measuring again"
            )
            known = {}
        missing = [c for c in candidates if c not in known]
        self.hits.append(not missing)
        runs = {}
        for r in range(rounds if len(missing) > 1 else 1):
            for name in missing if r % 2 == 0 else missing[::-1]:
                rival = min(
                    (known[c] for c in candidates if c in known and c != name), default=math.inf
                )
                run = runs[name] = runs.get(name) or candidates[name]()
                t = self.timer(f"{kind}/{name}", run, rival)
                known[name] = min(known.get(name, math.inf), t)
        if missing:
            self.entries[key], self.dirty = known, True
        return {c: known[c] for c in candidates}

    def key(self, kind: str, shape) -> str:
        return f"{kind}|{self.where}|{json.dumps(shape)}"

    def lookup(self, kind: str, shape, names) -> dict | None:
        """The cached {name: seconds} of every one of `names`, or None (a missing or damaged entry)."""
        known = self.entries.get(self.key(kind, shape))
        if not isinstance(known, dict):
            return None
        ok = all(isinstance(known.get(n), float) and 0 < known[n] < math.inf for n in names)
        return {n: known[n] for n in names} if ok else None

    def put(self, kind: str, shape, times: dict) -> Timings:
        """Record timings taken elsewhere (save() writes them)."""
        self.entries[self.key(kind, shape)], self.dirty = dict(times), True
        return self

    def save_unless_crowded(self, timer, cuda: bool) -> None:
        """save(), unless other processes took CPU cores from this one while `timer` timed (then
        the timings are used, not cached, with a warning)."""
        crowding = timer.crowding() if hasattr(timer, "crowding") and not cuda else 0.0
        if self.dirty and crowding > CROWDED:
            self.warnings.append(
                f"other processes took {crowding:.1f} CPU cores from this one while it timed its speed choices: used, not cached"
            )
        else:
            self.save()

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


def cached_peak(
    device: str, dtype: torch.dtype, path: Path | None = None
) -> tuple[float, bool, list]:
    """measure_peak_flops through the speed-choice cache: (FLOP/s, from the cache, warnings). As
    with the timings, a peak measured while other processes took cores from this one is used but
    not cached (it would understate the peak, and MFU would overstate, for every later run)."""
    warnings: list = []
    name = str(dtype).removeprefix("torch.")
    cuda = device.startswith("cuda")
    clock = Clock()
    where = f"{machine(device)}|torch {torch.__version__}"
    cache = Timings(
        default_cache_path() if path is None else path,
        where,
        lambda _label, run, _rival: run(),
        warnings,
    )
    shape = [name, bool(cuda and torch.backends.cuda.matmul.allow_tf32)]  # TF32 sets float32's
    if cuda:  # GPU peaks from before its timed runs were ramped and repeated (logs/mfu.py): stale
        shape.append("ramped")
    peak = cache("peak", shape, {name: lambda: partial(measure_peak_flops, device, dtype)})[name]
    if cache.dirty and (cuda or clock.crowding() <= CROWDED):
        cache.save()
    return peak, all(cache.hits), warnings


def default_cache_path() -> Path:

    return cache_dir() / "speed_choices.json"


def cpu_now() -> tuple | None:
    """(seconds any CPU was busy, seconds this process ran, wall clock); None without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    t = os.times()
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait
    return busy, t.user + t.system, time.perf_counter()


def crowding_since(start: tuple | None) -> float:
    """Cores other processes took, since `start`, beyond those this process's threads leave free."""
    end = cpu_now()
    if start is None or end is None:
        return 0.0
    busy, own, wall = (b - a for a, b in zip(start, end, strict=True))
    ticks = 4 / os.sysconf("SC_CLK_TCK")  # both counters move in clock ticks (10 ms): their error
    spare = (os.cpu_count() or 1) - torch.get_num_threads()
    return max(0.0, (busy - own - ticks) / max(wall, 1e-6) - spare)


def timed_model(s) -> torch.nn.Module:
    """A one-block model of the run's block on `meta`: s.model (build.ModelShapes: the run's own
    model config) at one layer, or a GPT-2 block of s.gelu and s.bias for plain choices.Shapes."""
    from gptrain.model.arch import build, config_from_dict

    own = dict(getattr(s, "model", ()) or {"arch": "gpt2", "gelu": s.gelu, "bias": s.bias})
    shape = dict(n_layer=1, n_head=s.n_head, n_embd=s.n_embd, block_size=s.seq_len, dropout=0.0)
    with torch.device("meta"):
        return build(config_from_dict({**own, "vocab_size": 64, **shape}))


def block_flops(s) -> float:
    """Forward + backward FLOPs of one block for one sequence: the block's own count
    (block_flops per token, 3x the forward's matmuls) times s.seq_len."""
    return s.seq_len * timed_model(s).block_flops(s.seq_len)


def _generator(device: str) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(0)  # the global RNG is never touched


def matmul_run(device: str, dtype: str):
    """The run of a 256^3 matmul in `dtype`."""
    a = torch.randn(256, 256, device=device, generator=_generator(device)).to(DTYPES[dtype])
    return lambda: (a @ a, synchronize(device))


def newton_schulz_run(device: str, s, dtype: str):
    """The run of one orthogonalisation in `dtype` of a matrix of each of s.muon's shapes."""
    gen = _generator(device)
    mats = [torch.randn(m, device=device, generator=gen) for m in s.muon]
    return lambda: (
        [orthogonalise(g, s.ns_steps, DTYPES[dtype]) for g in mats],
        synchronize(device),
    )


def muon_step_run(matrices: list, steps: int, dtype: str, split: bool):
    """The run of one Muon step's orthogonalisations of `matrices` (the run's Muon parameters,
    only read: their shapes decide the owners) in `dtype`: each rank all of them (split False), or
    each matrix on its owner rank and broadcast to the others (split True, 2+ processes)."""
    device = str(matrices[0].device)
    plan = _Plan(matrices, [steps] * len(matrices), split)
    gen = _generator(device)
    shapes = sorted({tuple(p.shape) for p in matrices})
    one = {s: torch.randn(s, device=device, generator=gen) for s in shapes}
    group = {"ns_steps": steps, "ns_coefficients": NS_COEFFICIENTS, "eps": EPS}
    work = [(p, group) for p in matrices]
    updates = [Update(t, t, None) for t in (one[tuple(p.shape)] for p in matrices)]  # read only
    return lambda: (plan.orthogonalise(work, updates, DTYPES[dtype]), synchronize(device))


def block_run(device: str, s, n: int, combo: str):
    """The run of one transformer block's forward + backward on `n` sequences under the autocast
    of combo's dtype, with its attention kernel (combo: "bfloat16/matmul"): the block of the
    run's own model class (timed_model); its 1-D weights (norms) 1, the rest N(0, 0.02)."""
    dtype, kernel = combo.split("/")
    model = timed_model(s)
    model.set_attention(kernel)
    block = model.blocks()[0]
    block.to_empty(device=device)
    gen = _generator(device)
    with torch.no_grad():
        for name, p in block.named_parameters():
            norm_weight = p.dim() == 1 and name.endswith("weight")
            p.normal_(1.0 if norm_weight else 0.0, 0.02, generator=gen)
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


def loss_run(device: str, s, rows: int, chunk: int, dtype: str, path: str, compiled: bool):
    """The run of the output head's loss, forward + backward, on `rows` rows of width s.n_embd
    against s.vocab (padded to s.padded_vocab) under `dtype`'s autocast, by `path` (chunked, in
    chunks of `chunk` rows, or full: gptrain/model/losses.py); `compiled`: through torch.compile,
    as a compiled model runs it (compiled here, before the timing)."""
    from gptrain.model.losses import full_cross_entropy, linear_cross_entropy

    gen = _generator(device)
    x = torch.randn(rows, s.n_embd, device=device, generator=gen, requires_grad=True)
    w = torch.randn(s.padded_vocab, s.n_embd, device=device, generator=gen) * 0.02
    w.requires_grad_()
    t = torch.randint(0, s.vocab, (rows,), device=device, generator=gen)
    autocast, _ = mixed_precision(DTYPES[dtype], torch.device(device).type)

    def loss(x, w, t):
        if path == "full":
            return full_cross_entropy(x, w, t, s.vocab)
        return linear_cross_entropy(x, w, t, s.vocab, chunk)

    fn = torch.compile(loss, dynamic=False) if compiled else loss

    def run():
        x.grad = w.grad = None
        with autocast:
            out = fn(x, w, t)
        out.backward()
        synchronize(device)

    if compiled:
        run()  # the compilation, outside the timing
    return run

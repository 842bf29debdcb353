"""Measured speed choices: `train.dtype`, `train.attention`, `train.loss`, `train.float8`,
`optim.muon_dtype` and `optim.muon_split` = auto, decided by timing this run's own shapes on this
device at start-up, cached per machine.

What is timed (only what the config leaves to auto; an explicit value always wins, untimed):

- bf16 probe (CPUs): a 256^3 matmul in float32 and in bf16 on one thread (a property of the
  core, and one thread is not slowed by other processes' threads as a team is). bf16 is native
  when it takes at most 2x float32's time (native, AVX512-BF16 or AMX: ~0.3-0.5x; emulated,
  AVX2-only: 10-35x). Where it is emulated nothing else is timed in bf16 (it would lose by 10x
  and cost seconds) and `optim.muon_dtype = bfloat16` is refused. On a GPU bf16 is native from
  compute capability 8.0.
- block: forward + backward of ONE transformer block at the run's (micro-batch, seq_len, n_embd,
  n_head), in each candidate dtype x attention kernel (float32/bfloat16 x sdpa/matmul on a CPU;
  on a GPU float32, with TF32 as train.tf32 says, against precision.auto_cuda_dtype's bf16 or
  float16: a small model can run as fast in float32 as under autocast's casts).
  On a CPU the micro-batch is cut to at most BLOCK_FLOPS per run (default preset: 5 of 16
  sequences), on a GPU to GPU_BLOCK_FLOPS (GPT-2 124M: 37 of 64), and a GPU that runs out of
  memory even so keeps the rule, with a warning; matmul is a candidate only while the
  probabilities it keeps for backward, for all layers, stay under MATMUL_MEMORY.
- loss: the output head's loss, forward + backward, chunked vs full logits (model/losses.py), in
  the chosen dtype, compiled where the run compiles its loss, on at least one chunk's rows (at
  most BLOCK_FLOPS, GPU_BLOCK_FLOPS beyond it); chunked unless full is clearly faster. Chunked
  by rule where the full logits (FULL_LOGITS_BYTES each) would take over LOGITS_MEMORY_SHARE of a
  GPU's free memory or of the least of any rank's (CPUs too: training/facts.py).
- float8 (GPUs with FP8 only): each eligible Linear shape, bf16 vs float8 (training/float8.py).
- muon: one Newton-Schulz orthogonalisation of each distinct Muon matrix shape, bf16 vs float32.
- muon-split (DDP with 2+ ranks only): one Muon step's orthogonalisations of all the run's Muon
  matrices in the chosen Muon dtype, every rank all of them (redundant) vs each on its owner rank
  and broadcast (split), timed on every rank at once; split unless redundant is clearly faster
  (it keeps the replicas byte-identical). Cached per machine, world size, backend and matrices.
  Split by rule, untimed, where ranks differ. Every choice is one every rank can run
  (training/facts.py); a resumed run reuses its recorded choices (training/recorded.py).
How a candidate is timed and how timings are cached: training/timing.py."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import torch

from gptrain.distributed import parallelize
from gptrain.errors import UserError
from gptrain.model.losses import chunk_rows
from gptrain.training import facts
from gptrain.training import float8 as fp8
from gptrain.training import recorded as recorded_choices
from gptrain.training.precision import DTYPES, auto_cuda_dtype, cuda_supports_bf16, resolve_dtype
from gptrain.training.timing import (
    Clock,
    Lockstep,
    Timings,
    block_flops,
    block_run,
    default_cache_path,
    loss_run,
    machine,
    matmul_run,
    muon_step_run,
    newton_schulz_run,
)

MARGIN = 0.1  # a candidate within this of the fastest counts as as fast (timing noise)
# Between two attention kernels of the chosen dtype (equally accurate; only speed is at stake)
# the margin is the two-round timings' spread: five fresh decisions on the bench shapes spread by
# +-2.5%, and there sdpa, 12-16% slower per block, came within MARGIN in 1 of 6 fresh decisions.
KERNEL_MARGIN = 0.03
BF16_EMULATED_RATIO = 2.0  # bf16 matmul time / float32's above which bf16 counts as emulated
BLOCK_FLOPS = 8e9  # CPU: the most FLOPs one timed block run may take (~60 ms in float32)
# GPU: the same bound (~3-10 ms on an H100 in float32 with TF32), which also bounds the block's
# memory: GPT-2 124M's block at 64 x 1024 tokens would hold ~7 GB of float32 activations
GPU_BLOCK_FLOPS = 2e12
MATMUL_MEMORY = 2**30  # bytes of probabilities matmul attention may keep for backward
# the full loss at its peak: the logits, their float32 log-probabilities (kept for backward), and
# in backward their float32 gradient, 4 bytes each (float32 logits; bf16 ones leave room for its
# copies); a GPU takes it only while that is at most this share of its free memory
FULL_LOGITS_BYTES, LOGITS_MEMORY_SHARE = 12, 0.25
SPLIT = "muon-split"  # the cache's kind of the Muon step's timings, split vs redundant
ALONE = facts.Limits(fp8=True, bf16=True, free=None, alike=True)  # no other rank's facts: no limit


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
    vocab: int = 0  # the output head's real and padded vocabulary (the loss timing needs them)
    padded_vocab: int = 0
    linears: tuple[tuple[int, int], ...] = ()  # distinct (in, out) of float8's eligible layers


@dataclass
class Choices:
    """The decisions, how each was made (config, rule, measured, cached) and the timings behind them."""

    dtype: str
    attention: str
    muon_dtype: str | None  # None: the run has no Muon
    muon_split: str | None = None  # split or redundant; None: the run has no Muon
    loss: str | None = None  # chunked or full; None: not decided here
    float8: fp8.Float8 | None = None  # the float8 layers and their timings; None: not decided
    how: dict = field(default_factory=dict)
    block_ms: dict = field(default_factory=dict)  # "dtype/kernel" -> ms per forward + backward
    block_tokens: tuple = ()  # (sequences, seq_len) of the timed block
    muon_ms: dict = field(default_factory=dict)  # dtype -> ms for one matrix of each shape
    split_ms: dict = field(default_factory=dict)  # split/redundant -> ms of a Muon step's work
    loss_ms: dict = field(default_factory=dict)  # chunked/full -> ms of the head's loss fwd+bwd
    loss_rows: int = 0  # rows of the timed loss
    bf16_ratio: float | None = None  # bf16 / float32 matmul time (None: not probed)
    seconds: float = 0.0  # wall time spent deciding
    warnings: list = field(default_factory=list)

    @property
    def muon_torch_dtype(self) -> torch.dtype | None:
        return DTYPES[self.muon_dtype] if self.muon_dtype else None

    def decisions(self) -> dict:
        """What a checkpoint records, so that a resumed run computes the same way."""
        keys = ("dtype", "attention", "muon_dtype", "muon_split", "loss")
        return {k: getattr(self, k) for k in keys} | fp8.decisions(self.float8)

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "warnings"}

    def line(self) -> str:
        """One line for the run's log: each choice, how it was made and the timings behind it."""
        from gptrain.training.choice_line import line

        return line(self)


def decide(
    device: str,
    shapes: Shapes,
    dtype: str = "auto",
    attention: str = "auto",
    muon_dtype: str | None = None,
    loss: str | None = None,
    float8: str | None = None,
    *,
    fsdp: bool = False,
    compiled: bool = False,
    timer=None,
    cache_path: Path | None | bool = True,
    limits: facts.Limits | None = None,
    recorded: dict | None = None,
) -> Choices:
    """The run's dtype, attention kernel, (muon_dtype not None) Muon dtype, (loss not None) loss
    path and (float8 not None) float8 layers, timed compiled when `compiled` (the run compiles its
    blocks; its loss too unless `fsdp`); explicit values are kept untimed. `timer(label, fn,
    rival) -> seconds` times a candidate (default: Clock(); its crowding(), when it has one,
    decides whether timings are cached); cache_path True: the gptrain cache, None/False: none.
    `limits` (facts.py; None: this process alone) bound every choice; `recorded`: a resumed
    checkpoint's choices, kept for keys still auto unless they cannot run (recorded.py).
    UserErrors: optim.muon_dtype = bfloat16 where bf16 is emulated, float8 = on where it can't run."""
    start, timer, limits = time.perf_counter(), timer or Clock(), limits or ALONE
    asked = dict(dtype=dtype, attention=attention, muon_dtype=muon_dtype, loss=loss, float8=float8)
    need = shapes.micro_batch * shapes.seq_len * shapes.padded_vocab * FULL_LOGITS_BYTES
    no_room = partial(facts.no_room_for_logits, device, need, LOGITS_MEMORY_SHARE, limits)
    kept, again = recorded_choices.keep(device, asked, recorded or {}, limits, no_room)
    dtype, attention, muon_dtype, loss, float8 = ({**asked, **kept}[k] for k in asked)
    if dtype != "auto":
        resolve_dtype(dtype, torch.device(device).type)  # float16 off CUDA: refused before timing
    fp8.refuse(device, float8, dtype, limits)
    ruled = float8 == "on" and dtype == "auto"  # float8 trains under bf16
    warnings: list = []
    path = default_cache_path() if cache_path is True else (cache_path or None)
    where = f"{machine(device)}|torch {torch.__version__}{limits.cache_key()}"
    measure = Timings(path, where, timer, warnings)

    cuda = device.startswith("cuda")
    out = Choices(dtype=dtype, attention=attention, muon_dtype=muon_dtype, warnings=warnings)
    wants_bf16 = (
        dtype == "auto"
        or (dtype == "bfloat16" and attention == "auto")
        or muon_dtype in ("auto", "bfloat16")
    )
    here = _bf16_native(device, cuda, wants_bf16, measure, out)
    native = limits.bf16_native(here)
    no_bf16 = limits.no_bf16(here, cuda)
    if muon_dtype == "bfloat16" and not native:
        why = no_bf16.split(": ", 1)[1] if here else "compute capability < 8.0" if cuda else f"a bf16 matmul measured {out.bf16_ratio:.1f}x float32's time"  # fmt: skip
        if "muon_dtype" not in kept:
            raise UserError(
                f"optim.muon_dtype = 'bfloat16' but this device computes bf16 only by emulation ({why}); use optim.muon_dtype=float32 or auto"
            )
        again["muon_dtype"] = (kept.pop("muon_dtype"), f"bf16 is emulated: {why}")
        muon_dtype = out.muon_dtype = "auto"
    dtypes = _dtype_candidates("bfloat16" if ruled else dtype, cuda, native, fsdp, out)
    kernels = _kernel_candidates(attention, shapes, out)
    _decide_block(device, shapes, dtypes, kernels, measure, out, asked=(dtype, attention))
    out.how["dtype"] = "rule: train.float8 = on" if ruled else out.how["dtype"]
    if len(dtypes) == 1 and out.how["dtype"] == "measured":
        out.how["dtype"] = no_bf16
    _decide_muon(device, shapes, muon_dtype, native, measure, out, no_bf16)
    _decide_loss(device, shapes, loss, compiled and not fsdp, measure, out, no_room)
    fp8.decide(device, shapes, float8, out.dtype, compiled, fsdp, measure, out, _pick, GPU_BLOCK_FLOPS, limits)  # fmt: skip
    if measure.hits and all(measure.hits):
        out.how = {k: v.replace("measured", "cached") for k, v in out.how.items()}
    out.how.update(dict.fromkeys(kept, "checkpoint"))
    out.warnings += recorded_choices.again_lines(out.decisions(), again)
    measure.save_unless_crowded(timer, cuda)
    out.seconds = time.perf_counter() - start
    return out


def _bf16_native(device: str, cuda: bool, wants_bf16: bool, measure, out: Choices) -> bool:
    """Whether bf16 is native here: compute capability on a GPU; on a CPU the bf16 probe (one
    thread, its ratio in out.bf16_ratio) where a choice may use bf16, else True untimed."""
    if cuda:
        return cuda_supports_bf16()
    if not wants_bf16:
        return True
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a property of one core; threads would time their contention
    try:
        mm = measure(
            "bf16-probe",
            256,
            {d: partial(matmul_run, device, d) for d in ("float32", "bfloat16")},
        )
    finally:
        torch.set_num_threads(threads)
    out.bf16_ratio = mm["bfloat16"] / mm["float32"]
    return out.bf16_ratio <= BF16_EMULATED_RATIO


def _dtype_candidates(dtype: str, cuda: bool, native: bool, fsdp: bool, out: Choices) -> list:
    """The dtypes a block is timed in (one: nothing to time), with how train.dtype is decided."""
    if dtype != "auto":
        dtypes, out.how["dtype"] = [dtype], "config"
    elif cuda:  # float32 (TF32 if set) against the GPU's fast dtype, where that is not float32
        low = auto_cuda_dtype(fsdp) if native else ("float32" if fsdp else "float16")
        dtypes, out.how["dtype"] = ["float32"] + [low] * (low != "float32"), "measured"
    else:
        dtypes, out.how["dtype"] = ["float32"] + ["bfloat16"] * native, "measured"
    return dtypes


def _kernel_candidates(attention: str, s: Shapes, out: Choices) -> list:
    """The attention kernels a block is timed with: matmul only while the probabilities it keeps
    for backward stay under MATMUL_MEMORY; with how train.attention is decided."""
    kept = s.n_layer * s.micro_batch * s.n_head * s.seq_len * (s.seq_len + 1) // 2 * 6
    kernels = (
        ["sdpa"] + ["matmul"] * (kept <= MATMUL_MEMORY) if attention == "auto" else [attention]
    )
    out.how["attention"] = "config" if attention != "auto" else "measured"
    if kernels == ["sdpa"] and attention == "auto":
        out.how["attention"] = f"rule: matmul would keep {kept / 2**30:.1f} GiB for backward"
    return kernels


def _decide_block(device, s: Shapes, dtypes, kernels, measure, out: Choices, asked) -> None:
    """out.dtype and out.attention: the fastest dtype/kernel pair, timing one block of the run's
    shapes (float32 unless bf16 is clearly faster), or the only pair there is."""
    combos = [f"{d}/{k}" for d in dtypes for k in kernels]
    if len(combos) > 1:
        combos, times, n = _time_block(device, s, dtypes, kernels, combos, measure, out, asked)
    if len(combos) > 1:
        out.block_ms, out.block_tokens = {c: t * 1e3 for c, t in times.items()}, (n, s.seq_len)
        out.dtype = _pick(times, combos).split("/")[0]  # float32 unless bf16 is clearly faster
        kernels_timed = [c for c in combos if c.startswith(f"{out.dtype}/")]
        out.attention = _pick(times, kernels_timed, KERNEL_MARGIN).split("/")[1]
    else:
        out.dtype, out.attention = combos[0].split("/")


def _time_block(device, s: Shapes, dtypes, kernels, combos, measure, out: Choices, asked):
    """(combos, times, sequences): one block of at most BLOCK_FLOPS (GPU_BLOCK_FLOPS) timed per
    combo. A GPU that runs out of memory leaves one combo, the rule's, with a warning."""
    cuda = device.startswith("cuda")
    slow = max(1.0, out.bf16_ratio or 1.0) if "bfloat16" in dtypes else 1.0  # emulated bf16
    most = GPU_BLOCK_FLOPS if cuda else BLOCK_FLOPS / slow
    n = max(1, min(s.micro_batch, int(most / block_flops(s))))
    shape = [n, s.seq_len, s.n_embd, s.n_head, s.gelu, s.bias]
    if cuda:  # TF32 changes float32's time
        shape.append(bool(torch.backends.cuda.matmul.allow_tf32))
    makes = {c: partial(block_run, device, s, n, c) for c in combos}
    try:
        return combos, measure("block", shape, makes, rounds=2), n
    except torch.cuda.OutOfMemoryError:  # a GPU too small for one block of n sequences
        if not cuda:
            raise
        torch.cuda.empty_cache()
        combos = [f"{dtypes[-1]}/{kernels[0]}"]  # the rule: the fast dtype, sdpa
        for key, value in zip(("dtype", "attention"), asked, strict=True):
            if value == "auto":
                out.how[key] = "rule: its timing ran out of memory"
        out.warnings.append(
            f"one block of {n} x {s.seq_len} tokens did not fit this GPU's memory; train.dtype and train.attention = auto follow the rule ({combos[0]})"
        )
        return combos, None, n


def _decide_muon(device, s: Shapes, muon_dtype, native: bool, measure, out: Choices, no_bf16):
    """out.muon_dtype for auto: bf16 against float32 on one Newton-Schulz orthogonalisation of
    each Muon matrix shape (float32 where bf16 is emulated or there is no matrix)."""
    if muon_dtype == "auto":
        options = ["float32"] + ["bfloat16"] * native
        if len(options) > 1 and s.muon:
            makes = {d: partial(newton_schulz_run, device, s, d) for d in options}
            times = measure("muon", [list(m) for m in s.muon] + [s.ns_steps], makes, rounds=2)
            out.muon_ms = {d: t * 1e3 for d, t in times.items()}
            out.muon_dtype = _pick(times, options)
        else:
            out.muon_dtype = options[0]
        out.how["muon_dtype"] = "measured" if native else no_bf16
    elif muon_dtype:
        out.how["muon_dtype"] = "config"


def _decide_loss(device, s: Shapes, loss, compiled: bool, measure, out: Choices, no_room) -> None:
    """out.loss (loss None: left None): as asked, or for auto chunked unless full is clearly
    faster on the run's head and loss, timed where every rank has the memory for the full logits
    (`no_room()`: why they do not fit, or None)."""
    if loss != "auto":
        out.loss = loss
        out.how.update({"loss": "config"} if loss else {})
        return
    cuda, total = device.startswith("cuda"), s.micro_batch * s.seq_len
    out.loss, why = "chunked", no_room()
    if why:
        out.how["loss"] = f"rule: {why}"
        return
    chunk = chunk_rows(total, s.padded_vocab, None, compiled)
    most = (GPU_BLOCK_FLOPS if cuda else BLOCK_FLOPS) / (6 * s.n_embd * s.padded_vocab)
    rows, paths = min(total, max(chunk, int(most))), ["chunked", "full"]
    makes = {p: partial(loss_run, device, s, rows, chunk, out.dtype, p, compiled) for p in paths}
    shape = [rows, chunk, s.n_embd, s.vocab, s.padded_vocab, out.dtype, compiled]
    if cuda:  # TF32 changes float32's time
        shape.append(bool(torch.backends.cuda.matmul.allow_tf32))
    try:
        times = measure("loss", shape, makes, rounds=2)
    except torch.cuda.OutOfMemoryError:
        if not cuda:
            raise
        torch.cuda.empty_cache()
        out.how["loss"] = "rule: its timing ran out of memory"
        out.warnings.append(f"timing the loss on {rows} rows ran out of GPU memory; train.loss = auto is chunked")  # fmt: skip
        return
    out.loss_ms, out.loss_rows = {p: t * 1e3 for p, t in times.items()}, rows
    out.loss, out.how["loss"] = _pick(times, paths), "measured"


def decide_muon_split(
    info,
    matrices: list,
    o,
    out: Choices,
    fsdp: bool,
    saved: dict | None,
    *,
    timer=None,
    cache_path=True,
    limits: facts.Limits | None = None,
) -> tuple[str, str, dict]:
    """optim.muon_split (o: the OptimConfig) for the Muon `matrices`: (choice, how, {mode: ms}),
    the same on every rank (warnings into out.warnings). Untimed: FSDP2 (always split), ranks that
    differ (`limits`: facts.split_where_unlike), an explicit value, a resumed run's recorded
    choice (`saved`), one process (split). Else, under DDP, one Muon step's orthogonalisations
    (in out.muon_dtype) timed redundant vs split on every rank at once (timing.Lockstep; `timer`
    replaces it), split unless redundant is clearly faster, cached per machine, world size,
    backend and matrices (a hit times nothing); the main process's decision goes to every rank."""
    from gptrain.distributed import runtime as dist

    limits, recorded = limits or ALONE, (saved or {}).get("muon_split")
    if fsdp:
        return "split", "rule: FSDP2 always splits", {}
    rule = facts.split_where_unlike(o.muon_split, recorded, limits, info.world_size)
    if rule:
        out.warnings += rule[3:]
        return rule[:3]
    if o.muon_split != "auto":
        return o.muon_split, "config", {}
    if recorded:
        return recorded, "checkpoint", {}
    if info.world_size == 1:
        return "split", "rule: one process, the same code", {}
    counts = Counter(tuple(p.shape) for p in matrices)
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else "none"
    shape = [info.world_size, backend, sorted([*k, n] for k, n in counts.items())]
    shape += [o.muon_ns_steps, out.muon_dtype]
    path = default_cache_path() if cache_path is True else (cache_path or None)
    where = f"{machine(info.device)}|torch {torch.__version__}{limits.cache_key()}"
    names = ["split", "redundant"]  # split first: it wins a tie
    cached = dist.from_main(
        info, lambda: Timings(path, where, None, []).lookup(SPLIT, shape, names)
    )
    warnings, times = out.warnings, cached
    if times is None:  # every rank times, in lockstep
        timer = timer or Lockstep(parallelize.replica_group())
        run = partial(muon_step_run, matrices, o.muon_ns_steps, out.muon_dtype)
        makes = {m: partial(run, m == "split") for m in names}
        times = Timings(None, where, timer, warnings)(SPLIT, shape, makes, rounds=2)
        cuda = info.device.startswith("cuda")
        cache = partial(Timings, path, where, None, warnings)  # read and written on main only
        dist.on_main(
            info, lambda: cache().put(SPLIT, shape, times).save_unless_crowded(timer, cuda)
        )
    choice = dist.broadcast_from_main(_pick(times, names))
    how = "cached" if cached else "measured"
    return choice, how, {m: t * 1e3 for m, t in times.items()}


def _pick(times: dict, order: list, margin: float = MARGIN) -> str:
    """The first candidate of `order` within `margin` of the fastest: closer is timing noise."""
    fastest = min(times[c] for c in order)
    return next(c for c in order if (1 - margin) * times[c] <= fastest)

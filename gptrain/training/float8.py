"""`train.float8`: torchao's float8 training (`pip install 'gptrain[fp8]'`) for the Linear layers
of the transformer blocks, where this device has FP8 matmuls and they are faster on the run's
shapes. One of the measured speed choices (training/choices.py calls `refuse` and `decide`).

- off: nothing. on: every eligible layer (parallelize.float8_layers: inside the blocks, both
  dimensions multiples of 16), refused with one line where the device has no FP8 matmuls (a
  CUDA GPU of compute capability >= 8.9) or torchao is missing; train.dtype must be bfloat16
  (TrainConfig.check), and auto becomes bfloat16 by rule.
- auto: where the device has no FP8 (CPUs, GPUs under 8.9) nothing is decided, timed, imported or
  shown. Else off by rule where the run computes in another dtype than bf16 (torchao's float8
  training runs under bf16 autocast), off with one warning where torchao is missing; otherwise
  each distinct (in, out) shape of the eligible layers is timed: one Linear's forward + backward
  on the run's micro-batch x seq_len rows (at most the block timing's FLOPs), bf16 autocast
  against float8, compiled where the run compiles (torch.compile fuses torchao's casts and
  scales; eager float8 rarely wins), in two rounds, cached per machine, torch and torchao
  version. A shape is converted only where float8 is faster by choices.MARGIN: torchao's own
  tables find float8 slower than bf16 at small matmuls, so at GPT-2 124M's width only the
  largest (the MLP's 768x3072 and 3072x768) can win. The tied output head stays in bf16.

The choice is text: "off", or the converted shapes as in x out ("768x3072,3072x768"). A
checkpoint records it with the other decisions, so a resumed run converts the same layers; where
some rank cannot run them (no FP8 matmuls, no torchao, another train.dtype) train.float8 alone is
decided again, with a warning naming both values (`cannot_run`). On ranks that differ
(training/facts.py) float8 is a choice only where every rank has FP8 matmuls: auto is off by rule
otherwise, and on is refused. Under FSDP2 the
converted layers all-gather their bf16 weights as every layer does and cast them to float8 in
forward: torchao's float8 all-gather (weights cast before the all-gather, scales precomputed
after each optimizer step) is not used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from gptrain.distributed import parallelize
from gptrain.errors import UserError
from gptrain.logs.mfu import synchronize
from gptrain.training.precision import DTYPES, mixed_precision

FP8_CAPABILITY = (8, 9)  # Ada and Hopper: the first GPUs with FP8 matmuls (torch._scaled_mm)
KIND = "float8"  # the speed-choice cache's kind of these timings
CANDIDATES = ["bfloat16", "float8"]  # bf16 first: it wins a tie
MISSING = "train.float8 = on needs torchao: pip install 'gptrain[fp8]'"


@dataclass
class Float8:
    """train.float8's decision (Choices.float8): the layers converted and the timings behind it."""

    layers: str  # "off", or the converted shapes as in x out: "768x3072,3072x768"
    rows: int = 0  # rows of each timed Linear (0: untimed)
    ms: dict = field(default_factory=dict)  # "INxOUT" -> {"bfloat16": ms, "float8": ms}


def decisions(c: Float8 | None) -> dict:
    """What a checkpoint records of it (nothing where it was not decided)."""
    return {} if c is None else {"float8": c.layers}


def no_fp8(device: str) -> str | None:
    """Why `device` has no FP8 matmuls (naming it and its compute capability), or None."""
    if not device.startswith("cuda"):
        return f"this run's device is {device}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < FP8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return f"{name} ({device}) has compute capability {major}.{minor}"
    return None


def torchao_version() -> str | None:
    """The installed torchao's version where its float8 training imports, else None."""
    try:
        import torchao
        from torchao.float8 import convert_to_float8_training  # noqa: F401
    except ImportError:
        return None
    return str(torchao.__version__)


def text(shapes) -> str:
    """The choice as recorded: "off", or the shapes as in x out, comma-separated."""
    return ",".join(f"{i}x{o}" for i, o in shapes) or "off"


def parse(choice: str | None) -> tuple[tuple[int, int], ...]:
    """The (in, out) shapes a recorded choice converts (none for None or "off"); a UserError for
    text that is not such a choice (a damaged checkpoint record)."""
    if choice in (None, "off"):
        return ()
    try:
        shapes = tuple(tuple(int(d) for d in s.split("x", 1)) for s in choice.split(","))
    except (AttributeError, ValueError):
        shapes = ()
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise UserError(f"train.float8 {choice!r} is not off or shapes such as 768x3072")
    return shapes


def no_fp8_anywhere(device: str, limits=None) -> str | None:
    """Why this device or another rank (`limits`, training/facts.py) has no FP8 matmuls, or None."""
    why = no_fp8(device)
    if why is None and limits is not None and not limits.fp8:
        ranks = ",".join(map(str, limits.no_fp8))
        why = f"rank(s) {ranks} have none ({limits.differ()})"
    return why


def cannot_run(device: str, dtype: str | None, limits=None) -> str | None:
    """Why recorded float8 layers cannot run on this run's ranks under train.dtype `dtype`
    (another dtype than bf16, no FP8 matmuls on some rank, no torchao), or None."""
    if dtype not in (None, "auto", "bfloat16"):
        return f"train.dtype = {dtype}, float8 training runs under bf16"
    why = no_fp8_anywhere(device, limits)
    if why is None and torchao_version() is None:
        why = "torchao is not installed"
    return why


def refuse(device: str, asked: str | None, dtype: str, limits=None) -> None:
    """A UserError (one line) where float8 was asked for (`on`, or the shapes a checkpoint
    recorded) but the run computes in another dtype than bf16 (`dtype`: train.dtype, or a
    checkpoint's), this device or another rank (`limits`) has no FP8 matmuls or torchao is
    missing; nothing for None, off and auto. Imports torchao only where it was asked for and
    the device has FP8."""
    if asked in (None, "off", "auto"):
        return
    what = "train.float8 = on" if asked == "on" else f"the checkpoint's float8 layers ({asked})"
    parse(asked if asked != "on" else None)
    if dtype not in ("auto", "bfloat16"):
        raise UserError(
            f"{what} computes under bf16 autocast, but train.dtype = {dtype!r}; set --train.dtype=bfloat16 (or auto), or train.float8=auto"
        )
    why = no_fp8_anywhere(device, limits)
    if why is not None:
        raise UserError(
            f"{what} needs a GPU with FP8 matmuls (CUDA compute capability >= 8.9), but {why}; use train.float8=auto or off"
        )
    if torchao_version() is None:
        raise UserError(MISSING)


def decide(device, s, asked, dtype, compiled, fsdp, measure, out, pick, most_flops, limits=None):
    """out.float8 and out.how["float8"] for train.float8 = `asked` (None: not decided here; on,
    off, or a checkpoint's shapes, which `refuse` has checked): auto as the module docstring
    says, on s.linears (choices.Shapes) in the run's `dtype`, compiled where `compiled`, with
    bf16 weights under FSDP2 (`fsdp`) and float32 ones under autocast otherwise; `measure`
    (timing.Timings) times, `pick` (choices._pick) decides, `most_flops` bounds the rows;
    `limits` (training/facts.py): auto is off by rule where another rank has no FP8 matmuls."""
    if asked is None or (asked == "auto" and no_fp8(device) is not None):
        return
    out.float8, out.how["float8"] = Float8("off"), "config"
    if asked != "auto":
        out.float8.layers = text(s.linears) if asked == "on" else asked
        return
    version = torchao_version()
    rule = no_fp8_anywhere(device, limits) or _off_by_rule(s, dtype, version)
    if rule is not None:
        out.how["float8"] = f"rule: {rule}"
        if rule.startswith("torchao"):
            out.warnings.append(
                "train.float8 = auto: this GPU has FP8 matmuls but torchao is not installed, so float8 training is off; pip install 'gptrain[fp8]'"
            )
        return
    worst = max(i * o for i, o in s.linears)
    rows = min(s.micro_batch * s.seq_len, max(16, int(most_flops / (6 * worst))))
    weights = "bfloat16" if fsdp else "float32"
    chosen, times_ms = [], {}
    try:
        for shape in s.linears:
            makes = {c: partial(linear_run, device, shape, rows, c, compiled, weights) for c in CANDIDATES}  # fmt: skip
            key = [*shape, rows, compiled, weights, version]
            times = measure(KIND, key, makes, rounds=2)
            times_ms[text([shape])] = {c: t * 1e3 for c, t in times.items()}
            if pick(times, CANDIDATES) == "float8":
                chosen.append(shape)
    except torch.cuda.OutOfMemoryError:
        if not device.startswith("cuda"):
            raise
        torch.cuda.empty_cache()
        out.how["float8"] = "rule: its timing ran out of memory"
        out.warnings.append(f"timing float8 Linear layers on {rows} rows ran out of GPU memory; train.float8 = auto is off")  # fmt: skip
        return
    out.float8, out.how["float8"] = Float8(text(chosen), rows, times_ms), "measured"


def _off_by_rule(s, dtype: str, version: str | None) -> str | None:
    """Why auto is off untimed on a device with FP8 matmuls (torchao's `version`), or None."""
    if dtype != "bfloat16":
        return f"train.dtype = {dtype}, float8 training runs under bf16"
    if not s.linears:
        return "no Linear layer in the blocks has both dimensions multiples of 16"
    return "torchao is not installed" if version is None else None


def line_part(c) -> list[str]:
    """The speed-choice line's part for train.float8 of the Choices `c` (none where undecided)."""
    f = c.float8
    if f is None:
        return []
    part = f"train.float8={f.layers} ({c.how['float8']})"
    if f.ms:
        each = ", ".join(f"{k} {v['bfloat16']:.3g} vs {v['float8']:.3g} ms" for k, v in f.ms.items())  # fmt: skip
        part += f" [one Linear fwd+bwd of {f.rows} rows, bf16 vs float8: {each}]"
    return [part]


def linear_run(device, shape, rows, candidate, compiled, weights, emulate=False):
    """The run of one Linear layer of `shape` (in, out; with bias) forward + backward on `rows`
    rows under bf16 autocast, with `weights` ("float32" or "bfloat16") parameters, as nn.Linear
    (candidate "bfloat16") or torchao's Float8Linear ("float8"; `emulate`: float8 rounding without
    FP8 matmuls, for tests on a CPU); `compiled`: through torch.compile, compiled before the timing.
    Its own generator: the global RNG is never touched."""
    fan_in, fan_out = shape
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.device("meta"):
        layer = nn.Sequential(nn.Linear(fan_in, fan_out))
    layer.to_empty(device=device)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.02, generator=gen)
    layer.to(DTYPES[weights])
    if candidate == "float8":
        parallelize.to_float8(layer, {"0"}, emulate)
    x = torch.randn(rows, fan_in, device=device, generator=gen, requires_grad=True)
    autocast, _ = mixed_precision(torch.bfloat16, torch.device(device).type)
    # compiled: the layer itself, so nn.Linear's and Float8Linear's forward each hold one
    # compilation per shape (dynamo's recompile limit counts those per function)
    fn = torch.compile(layer[0], dynamic=False) if compiled else layer

    def run():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        with autocast:
            y = fn(x)
        y.float().sum().backward()
        synchronize(device)

    if compiled:
        run()  # the compilation, outside the timing
    return run

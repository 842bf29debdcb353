"""Replicas that cannot drift: at each checkpoint, before anything of it is written, the ranks
compare exact checksums of the state every one of them should hold bit for bit.

    tensors = replicated(model, optimizer, numbers)   # (name, tensor) in the same order on every rank
    check(tensors, info, step)                        # collective; raises ReplicaMismatch (exit 5)

What is replicated: under DDP (and on one process) every parameter and optimizer-state tensor.
Under FSDP2 each parameter and each moment (AdamW's exp_avg and exp_avg_sq, Muon's momentum) is a
shard (a DTensor, skipped): every element has one copy, on one rank, so there is no replica to
compare. What remains is compared under every parallelism: AdamW's per-parameter step counters
(plain tensors every rank keeps: a rank that skipped or repeated an update differs), every
optimizer group's hyperparameters (the scheduled lr among them) and the numbers the caller
passes (step, tokens, training time, skipped and rolled-back steps, the spike window, the data
cursor). gptrain's models have no buffers and FSDP2 leaves no parameter unsharded, so nothing
else is replicated. Unseen under FSDP2: a shard that goes wrong on its rank (a flipped bit, a
faulty update) is the only copy; every rank all-gathers the same wrong value, the ranks stay
consistent, and the checkpoint saves it. Only its effects can catch it: train.nonfinite (a NaN
or inf gradient norm), train.spike (a loss or gradient-norm spike), the evaluation loss; the
checkpoint's sha256s guard its files after they are written. The RNG states are not compared:
each rank's dropout stream is seeded with its rank, so they differ by design.

Each tensor's checksum is exact: its bytes read as integers of the element's width, then two
sums in int64 (wrapping modulo 2^64, so the order of the reduction cannot change them): the
plain sum, and the sum weighted by each element's position (1, 2, 3, ...), which catches two
elements swapped. The sums are computed where the tensor lives (GPU or CPU), chunk by chunk, and
read once per device. Then two all-gathers of a small CPU tensor on the default group (gloo;
under nccl its CPU side is gloo: no device sync), within dist.timeout_s like every collective:
the counts of tensors, then the [n, 2] checksums. Measured cost: benchmarks/RESULTS.md, "Several
processes on CPUs". The ranks whose checksums differ from the largest group of equal ranks (ties:
the group with the lowest rank) are named with the first tensor where they differ.
"""

from __future__ import annotations

import torch
import torch.distributed as tdist

from gptrain.distributed import runtime as dist
from gptrain.distributed.failures import ReplicaMismatch

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# elements per pass: on a CPU a slice that stays in cache (the int64 work buffer: 256 KB) and is
# too small for torch to split it over threads (no waits between threads of a busy CPU); on a
# GPU fewer, larger passes (32 MB)
_CHUNK = {"cpu": 1 << 15, "cuda": 1 << 22}


class _Work:
    """A device's position weights 1..chunk and an int64 buffer of the same size, reused by
    every pass (no allocation per pass: on a CPU, no page faults)."""

    def __init__(self, device: torch.device):
        self.chunk = _CHUNK.get(device.type, 1 << 22)
        self.weights = torch.arange(1, self.chunk + 1, device=device)
        self.buffer = torch.empty(self.chunk, dtype=torch.int64, device=device)


def checksum(t: torch.Tensor, work: _Work | None = None) -> torch.Tensor:
    """Two int64 sums of `t`'s bytes read as integers (plain, and weighted by position from 1),
    on t's device: equal for equal bytes; a changed or moved element changes them. (Element i of
    the pass starting at `start` weighs start + i: its weight-i sum plus start x its plain sum.)"""
    flat = t.detach().reshape(-1)
    ints = flat.view(_INTS[flat.element_size()])
    work = work or _Work(flat.device)
    out = torch.zeros(2, dtype=torch.int64, device=flat.device)
    for start in range(0, ints.numel(), work.chunk):
        part = ints[start : start + work.chunk]
        buffer = work.buffer[: part.numel()]
        buffer.copy_(part)
        plain = buffer.sum()
        weighted = buffer.mul_(work.weights[: part.numel()]).sum()
        out += torch.stack([plain, weighted + start * plain])
    return out


def _replicated_value(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor every replica holds alike, or None for a shard (an FSDP2 DTensor)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(t, DTensor):
        return t
    return t.to_local() if all(isinstance(p, Replicate) for p in t.placements) else None


def _number(value) -> torch.Tensor:
    """A number or a list of numbers as a tensor: floats as float64, whole numbers as int64."""
    values = value if isinstance(value, list | tuple) else [value]
    whole = all(isinstance(v, bool | int) for v in values)
    return torch.tensor(values, dtype=torch.int64 if whole else torch.float64)


def replicated(model, optimizer, numbers: dict) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of the state every rank must hold alike, in the same order on every rank:
    the parameters (`model`: the plain model, its names), then each one's optimizer state, then
    each optimizer group's numbers, then `numbers` (name -> a number or a list of numbers)."""
    out: list[tuple[str, torch.Tensor]] = []
    named = list(model.named_parameters())
    for name, p in named:
        if (value := _replicated_value(p)) is not None:
            out.append((name, value))
    for name, p in named:
        state = optimizer.state.get(p, {})
        for key in sorted(state):
            value = state[key]
            if not isinstance(value, torch.Tensor):
                out.append((f"optimizer {name}.{key}", _number(value)))
            elif (value := _replicated_value(value)) is not None:
                out.append((f"optimizer {name}.{key}", value))
    for i, group in enumerate(optimizer.param_groups):
        for key in sorted(group):
            if isinstance(group[key], bool | int | float):
                out.append((f"optimizer group {i} {key}", _number(group[key])))
    out += [(name, _number(v)) for name, v in numbers.items()]
    return out


def checksums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[n, 2] int64 on the CPU: each tensor's checksum, computed on its device, read once per
    device."""
    work: dict[torch.device, _Work] = {}
    sums = []
    for t in tensors:
        if t.device not in work:
            work[t.device] = _Work(t.device)
        sums.append(checksum(t, work[t.device]))
    out = torch.zeros(len(sums), 2, dtype=torch.int64)
    for device in {s.device for s in sums}:
        rows = [i for i, s in enumerate(sums) if s.device == device]
        out[rows] = torch.stack([sums[i] for i in rows]).cpu()
    return out


def _gather(t: torch.Tensor, world: int) -> list[torch.Tensor]:
    out = [torch.zeros_like(t) for _ in range(world)]
    tdist.all_gather(out, t)
    return out


def check(named: list[tuple[str, torch.Tensor]], info, step: int) -> None:
    """Collective: every rank's checksums of `named` (from `replicated`) gathered and compared;
    a ReplicaMismatch on every rank (the same line) when any rank differs. Nothing on one
    process."""
    if not dist.active():
        return
    counts = [int(c) for c in _gather(torch.tensor([len(named)]), info.world_size)]
    if len(set(counts)) > 1:
        held = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
        raise ReplicaMismatch(_line(step, f"the ranks hold different numbers of tensors ({held})"))
    gathered = _gather(checksums([t for _, t in named]), info.world_size)
    groups: dict[bytes, list[int]] = {}
    for rank, sums in enumerate(gathered):
        groups.setdefault(sums.numpy().tobytes(), []).append(rank)
    if len(groups) == 1:
        return
    ref = max(groups.values(), key=lambda ranks: (len(ranks), -ranks[0]))
    odd = [r for r in range(info.world_size) if r not in ref]
    rows = [(gathered[r] != gathered[ref[0]]).any(dim=1) for r in odd]
    first = min(int(row.nonzero()[0]) for row in rows)
    n_bad = int(torch.stack(rows).any(dim=0).sum())
    who = f"rank{'s' * (len(odd) > 1)} {', '.join(map(str, odd))} differ{'s' * (len(odd) == 1)}"
    agree = f"rank {ref[0]}" + (f" (and {len(ref) - 1} more that agree)" if len(ref) > 1 else "")
    more = f" (the first of {n_bad} tensors that differ)" if n_bad > 1 else ""
    raise ReplicaMismatch(_line(step, f"{who} from {agree} in {named[first][0]}{more}"))


def _line(step: int, what: str) -> str:
    return (
        f"step {step}: the replicas differ: {what}; this step's checkpoint is not written, "
        "`latest` still names the previous one; exit 5: a rank computed differently (a faulty "
        "device or memory, a nondeterministic kernel, a bug). Rerunning resumes from the last "
        "checkpoint (one copy, loaded by every rank); a repeat at the same step points at the code"
    )

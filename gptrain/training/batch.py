"""Batch geometry: the micro-batch a run uses and the gradient accumulation that follows from it.

`train.micro_batch_size` is a whole number (checked: it must divide the global batch on this
world size) or `auto`: the largest divisor of the sequences each process handles per optimizer
step, total_batch_size / (seq_len x world size), that is <= `train.micro_batch_cap`. On a GPU,
auto also has to fit: one trial forward + backward per candidate (eager, on random tokens, with
room reserved for the optimizer state), the next smaller divisor at most half as large after an
out-of-memory error. All ranks try the same candidates in lockstep and agree after each (an
all-reduce MIN of "it fitted"), so every rank ends with the same micro-batch.
"""

from __future__ import annotations

import gc

import torch

from gptrain.config.sections import TrainConfig
from gptrain.distributed import parallelize
from gptrain.distributed import runtime as dist
from gptrain.errors import UserError
from gptrain.model.losses import chunk_rows


def accumulation_steps(
    total_batch_size: int, micro_batch_size: int, seq_len: int, world_size: int
) -> int:
    """total_batch_size / (micro_batch_size * seq_len * world_size), or a UserError with the numbers."""
    per_micro_step = micro_batch_size * seq_len * world_size
    if total_batch_size % per_micro_step == 0:
        return total_batch_size // per_micro_step
    lower = total_batch_size // per_micro_step * per_micro_step
    totals = " or ".join(str(v) for v in (lower, lower + per_micro_step) if v > 0)
    fix = f"nearest valid totals: {totals}"
    if total_batch_size % (seq_len * world_size) == 0:  # a smaller micro-batch divides
        n = total_batch_size // (seq_len * world_size)
        best = max(d for d in range(1, micro_batch_size) if n % d == 0)
        fix += f"; or train.micro_batch_size={best} (or auto)"
    raise UserError(
        f"train.total_batch_size = {total_batch_size} is not a multiple of train.micro_batch_size ({micro_batch_size}) "
        f"x train.seq_len ({seq_len}) x world size ({world_size}) = {per_micro_step}; {fix}"
    )


def sequences_per_rank(total_batch_size: int, seq_len: int, world_size: int) -> int:
    """Sequences one process handles per optimizer step, or a UserError naming the keys."""
    per = seq_len * world_size
    if total_batch_size % per:
        lower = max(per, total_batch_size // per * per)
        raise UserError(
            f"train.total_batch_size = {total_batch_size} is not a multiple of train.seq_len ({seq_len}) x world size "
            f"({world_size}) = {per}, so no micro-batch divides it; nearest valid totals: {lower} or {lower + per}"
        )
    return total_batch_size // per


def candidates(t: TrainConfig, world_size: int) -> list[int]:
    """micro_batch_size = auto: the divisors of the per-process sequences that are <= the cap,
    largest first. An explicit number: [that number] once it divides (else the usual error)."""
    if t.micro_batch_size != "auto":
        accumulation_steps(t.total_batch_size, t.micro_batch_size, t.seq_len, world_size)
        return [t.micro_batch_size]
    n = sequences_per_rank(t.total_batch_size, t.seq_len, world_size)
    return [d for d in range(min(n, t.micro_batch_cap), 0, -1) if n % d == 0]


def plan(t: TrainConfig, world_size: int) -> tuple[int, int]:
    """(micro-batch, accumulation steps) without looking at memory: what auto gives on a CPU and
    what a GPU tries first."""
    mb = candidates(t, world_size)[0]
    return mb, accumulation_steps(t.total_batch_size, mb, t.seq_len, world_size)


def fit(options: list[int], fits, all_min=None) -> int:
    """The first of `options` (largest first) that `fits(mb)` on every rank, going from a failed
    size to the largest option at most half of it. `all_min(flag)` is the MIN over ranks (all
    ranks call it after every trial, so they try the same sizes); None on a single process."""
    i = 0
    while True:
        ok = int(fits(options[i]))
        if all_min is not None:
            ok = all_min(ok)
        if ok:
            return options[i]
        half = options[i] // 2
        rest = [j for j in range(i + 1, len(options)) if options[j] <= half]
        if not rest:
            raise UserError(
                f"train.micro_batch_size = auto: not even {options[i]} sequence(s) per process fit in GPU memory; "
                "use a shorter train.seq_len, a smaller model, more processes with dist.mode=fsdp, or activation checkpointing"
            )
        i = rest[0]


def _all_min(flag: int, device) -> int:
    t = torch.tensor([flag], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return int(t.item())


def trial_fits(
    wrapped, model, autocast, mb: int, seq_len: int, vocab_size: int, device, compiled: bool = False
) -> bool:
    """One forward + backward of a (mb, seq_len) batch of random tokens, while a buffer the size
    of AdamW's state (2 floats per local parameter) is held; False on CUDA out-of-memory. The
    trial runs eager; `compiled` (the whole model, loss included, is compiled: compile without
    FSDP) gives it the compiled loss's larger chunks (losses.chunk_rows), so that it
    needs the memory the compiled run's loss will. Leaves
    no gradients behind and consumes no global random numbers (dropout draws happen under a
    forked RNG), so training is unchanged by it. DDP: without gradient communication (the
    gradients stay in .grad, cleared below). FSDP2: with it, as on a last micro-step: without
    sync FSDP2 would keep the unsharded gradient in its own buffers, out of zero_grad's reach,
    and add it to the first real step's."""
    fsdp = parallelize.syncs_per_block(wrapped)
    oom, rows = False, model.loss_chunk_rows
    if compiled and not fsdp:  # FSDP compiles block by block: its loss runs eager
        model.loss_chunk_rows = chunk_rows(
            mb * seq_len, model.config.padded_vocab_size, rows, compiled=True
        )
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            numel = parallelize.local_numel(model)
            reserve = torch.empty(2 * numel, dtype=torch.float32, device=device)  # AdamW m and v
            gen = torch.Generator(device=device).manual_seed(0)
            x = torch.randint(0, vocab_size, (mb, seq_len + 1), device=device, generator=gen)
            with parallelize.eager(), parallelize.grad_sync(wrapped, sync=fsdp), autocast:
                _, loss = wrapped(x[:, :-1], x[:, 1:])
            loss.backward()
            del loss, x, reserve
    except torch.cuda.OutOfMemoryError:
        oom = True  # handled outside the except block: its traceback holds the trial's tensors
    finally:
        model.loss_chunk_rows = rows
    model.zero_grad(set_to_none=True)
    if oom:
        gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return not oom


def resolve(
    t: TrainConfig,
    info: dist.DistInfo,
    wrapped=None,
    model=None,
    autocast=None,
    vocab_size: int = 0,
    options: list[int] | None = None,
) -> tuple[int, int]:
    """(micro-batch, accumulation steps) for this run: plan(), then on CUDA with auto the largest
    candidate that fits on every rank (needs the wrapped model, its autocast and the vocabulary)."""
    options = options or candidates(t, info.world_size)  # `options`: start's, passed on
    mb = options[0]
    if t.micro_batch_size == "auto" and info.device_type == "cuda" and wrapped is not None:
        device = torch.device(info.device)
        all_min = (lambda ok: _all_min(ok, device)) if dist.active() else None
        mb = fit(
            options,
            lambda m: trial_fits(
                wrapped, model, autocast, m, t.seq_len, vocab_size, device, t.compile
            ),
            all_min,
        )
    return mb, accumulation_steps(t.total_batch_size, mb, t.seq_len, info.world_size)

"""Batch geometry: the micro-batch a run uses and the gradient accumulation that follows from it.

`train.micro_batch_size` is a whole number (checked: it must divide the global batch on this
world size) or `auto`: the largest divisor of the sequences each process handles per optimizer
step, total_batch_size / (seq_len x world size), that is <= `train.micro_batch_cap`. On a GPU,
auto also has to fit, found by eager trial forward + backward passes on random tokens:

- One process or DDP (`fit`): one trial per candidate, with room reserved for the optimizer
  state, the next smaller divisor at most half as large after an out-of-memory error. The trial
  does no gradient communication, so all ranks try the same candidates in lockstep and agree
  after each (an all-reduce MIN of "it fitted").
- FSDP2 (`fsdp_fit`): a trial all-gathers and reduce-scatters, and a rank that ran out of memory
  inside one cannot leave it in step with its peers, so only sizes predicted to fit are tried:
  the smallest candidate, then the second smallest when a line through the first says it fits
  (else the smallest again, so that every rank runs the same collectives). The peaks measured
  give peak(mb) = a + b x mb (`predict_fit`); each rank takes the largest candidate whose
  predicted peak plus its reserve (AdamW state, and with accumulation > 1 under
  dist.fsdp_reduce = last the unsharded float32 gradient FSDP2 keeps between micro-steps) fits
  in 90% of its memory, and one all-reduce MIN
  after all trials makes the ranks agree. After each trial the ranks agree whether it ran out of
  memory anywhere (one all-reduce of a CPU flag per rank, over gloo, before anything waits on the
  device: a rank whose peer left a collective would wait forever for it there); if it did, every
  rank stops with the same line naming the ranks (a UserError, exit 2).

A resumed run reuses the micro-batch its checkpoint recorded (`resolve`'s `recorded`): auto keeps
it where it is still a candidate (it divides the batch at this world size, within the cap) and,
on a GPU, fits (the trials start from it); otherwise it is decided again with one warning naming
both values. An explicit micro-batch that differs from the recorded one wins, with one warning.
"""

from __future__ import annotations

import gc

import torch

from gptrain.config.sections import TrainConfig
from gptrain.distributed import parallelize
from gptrain.distributed import runtime as dist
from gptrain.errors import UserError
from gptrain.model.losses import chunk_rows
from gptrain.training.recorded import decided_again, overrides_line


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
            raise _no_fit(options[i])
        i = rest[0]


def _no_fit(mb: int) -> UserError:
    return UserError(
        f"train.micro_batch_size = auto: not even {mb} sequence(s) per process fit in GPU memory; "
        "use a shorter train.seq_len, a smaller model, more processes with dist.mode=fsdp, or activation checkpointing"
    )


MEMORY_MARGIN = 0.9  # FSDP2's prediction may fill this share of the memory the allocator can use


def predict_fit(
    options: list[int], measured: dict[int, int], base: int, capacity: int, reserve_for
) -> int:
    """The largest of `options` whose predicted peak + `reserve_for(mb)` bytes is <= `capacity`,
    or 0 when none is. The peak is the line through the two points of `measured` ({mb: peak
    bytes}), or with one point (or a second no higher) the line through it and (0, `base`), the
    bytes allocated before the trial: its slope includes the fixed cost, so it over-predicts
    larger sizes."""
    (m1, p1), *more = sorted(measured.items())
    slope = (p1 - base) / m1
    if more and more[0][1] > p1:  # a second point that grew: the line through both
        m2, p2 = more[0]
        slope = (p2 - p1) / (m2 - m1)
    for mb in options:
        if p1 + slope * (mb - m1) + reserve_for(mb) <= capacity:
            return mb
    return 0


def fsdp_fit(
    options: list[int], measure, base: int, capacity: int, reserve_for, all_min=None, agree=None
) -> int:
    """FSDP2's choice among `options` (largest first): `measure(mb)` runs one trial and returns
    its peak bytes (None after out-of-memory); it runs for the smallest option and for the second
    smallest when the one-point line says its trial fits in `capacity`, else for the smallest
    again (a trial's collectives do not depend on mb, so every rank stays in step). After each
    trial `agree(fitted)` (every rank calls it) gives the ranks whose trial ran out of memory
    (None: this process alone); any is one UserError, the same on every rank: the collectives
    such a trial was in cannot be rejoined. Then `predict_fit`, and `all_min(mb)` (MIN over
    ranks; None on a single process) once, after every trial."""
    agree = agree or (lambda fitted: [] if fitted else [0])

    def peak_of(mb: int) -> int:
        peak = measure(mb)
        failed = agree(peak is not None)
        if failed:
            raise _trial_oom(mb, failed)
        return peak

    small = options[-1]
    measured = {small: peak_of(small)}
    if len(options) > 1:
        second = options[-2]
        if predict_fit([second], measured, base, capacity, lambda m: 0) == second:
            measured[second] = peak_of(second)
        else:  # its trial might run out of memory inside a collective: repeat the smallest
            peak_of(small)
    mb = predict_fit(options, measured, base, capacity, reserve_for)
    if all_min is not None:
        mb = all_min(mb)
    if mb == 0:
        raise _no_fit(small)
    return mb


def _trial_oom(mb: int, ranks: list[int]) -> UserError:
    return UserError(
        f"train.micro_batch_size = auto: the FSDP2 trial of {mb} sequence(s) per process ran out of GPU memory on rank(s) {','.join(map(str, ranks))}, "
        "and a rank that runs out of memory inside FSDP2's collectives cannot rejoin them; "
        + (f"give train.micro_batch_size a number below {mb}, or " if mb > 1 else "")
        + "use a shorter train.seq_len, a smaller model, more processes or activation checkpointing"
    )


def failed_ranks(fitted: bool) -> list[int]:
    """Collective: the ranks whose trial did not fit (each passes `fitted`). One all-reduce of a
    CPU tensor, one slot per rank: over gloo (under nccl the "cpu:gloo,cuda:nccl" group's),
    within dist.timeout_s, and without waiting on the device."""
    if not dist.active():
        return [] if fitted else [0]
    flags = torch.zeros(torch.distributed.get_world_size(), dtype=torch.int32)
    flags[torch.distributed.get_rank()] = 0 if fitted else 1
    torch.distributed.all_reduce(flags)
    return [r for r, f in enumerate(flags.tolist()) if f]


def agreed(fitted: bool, device) -> list[int]:
    """`failed_ranks`, then, where every rank's trial fitted, the trial's cached memory released."""
    failed = failed_ranks(fitted)
    if not failed and torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return failed


def _all_min(value: int, device) -> int:
    t = torch.tensor([value], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
    return int(t.item())


def trial_fits(
    wrapped,
    model,
    autocast,
    mb: int,
    seq_len: int,
    vocab_size: int,
    device,
    compiled: bool = False,
    reserve: bool = True,
    release: bool = True,
) -> bool:
    """One forward + backward of a (mb, seq_len) batch of random tokens, while a buffer the size
    of AdamW's state (2 floats per local parameter) is held unless `reserve` is False; False on
    CUDA out-of-memory. The trial runs eager; `compiled` (the whole model, loss included, is
    compiled: compile without FSDP) gives it the compiled loss's larger chunks
    (losses.chunk_rows), so that it needs the memory the compiled run's loss will. Leaves no
    gradients behind and consumes no global random numbers (dropout draws happen under a
    forked RNG), so training is unchanged by it. DDP: without gradient communication (the
    gradients stay in .grad, cleared below). FSDP2: with it, as on a last micro-step: without
    sync FSDP2 would keep the unsharded gradient in its own buffers, out of zero_grad's reach,
    and add it to the first real step's. `release` False: the cached memory is not released
    (that waits on the device, which FSDP2's peers may have left stuck in a collective)."""
    fsdp = parallelize.syncs_per_block(wrapped)
    oom, rows = False, model.loss_chunk_rows
    if compiled and not fsdp:  # FSDP compiles block by block: its loss runs eager
        model.loss_chunk_rows = chunk_rows(
            mb * seq_len, model.config.padded_vocab_size, rows, compiled=True
        )
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            numel = parallelize.local_numel(model) if reserve else 0
            held = torch.empty(2 * numel, dtype=torch.float32, device=device)  # AdamW m and v
            gen = torch.Generator(device=device).manual_seed(0)
            x = torch.randint(0, vocab_size, (mb, seq_len + 1), device=device, generator=gen)
            with parallelize.eager(), parallelize.grad_sync(wrapped, sync=fsdp), autocast:
                _, loss = wrapped(x[:, :-1], x[:, 1:])
            loss.backward()
            del loss, x, held
    except torch.cuda.OutOfMemoryError:
        oom = True  # handled outside the except block: its traceback holds the trial's tensors
    finally:
        model.loss_chunk_rows = rows
    model.zero_grad(set_to_none=True)
    if oom:
        gc.collect()
    if device.type == "cuda" and (release or oom):  # this rank's collectives all completed
        torch.cuda.empty_cache()
    return not oom


def trial_peak(
    wrapped, model, autocast, mb: int, seq_len: int, vocab_size: int, device
) -> int | None:
    """The CUDA peak bytes allocated during `trial_fits` without its reserve (FSDP2: with its
    collectives), its cached memory not released (see `agreed`); None on out-of-memory."""
    torch.cuda.reset_peak_memory_stats(device)
    ok = trial_fits(
        wrapped, model, autocast, mb, seq_len, vocab_size, device, reserve=False, release=False
    )
    return torch.cuda.max_memory_allocated(device) if ok else None


def _memory(device) -> tuple[int, int]:
    """(bytes allocated now, MEMORY_MARGIN x the bytes the allocator could hold: free + its own)."""
    free, _ = torch.cuda.mem_get_info(device)
    usable = free + torch.cuda.memory_reserved(device)
    return torch.cuda.memory_allocated(device), int(MEMORY_MARGIN * usable)


def runs_trials(t: TrainConfig, info: dist.DistInfo) -> bool:
    """Whether `resolve` measures the micro-batch with trial steps: auto on a GPU."""
    return t.micro_batch_size == "auto" and info.device_type == "cuda"


def resolve(
    t: TrainConfig,
    info: dist.DistInfo,
    wrapped=None,
    model=None,
    autocast=None,
    vocab_size: int = 0,
    options: list[int] | None = None,
    recorded: int | None = None,
    warnings: list | None = None,
) -> tuple[int, int]:
    """(micro-batch, accumulation steps) for this run: plan(), then on CUDA with auto the largest
    candidate that fits on every rank (needs the wrapped model, its autocast and the vocabulary):
    `fsdp_fit` under FSDP2, else `fit`. `recorded`: the micro-batch a resumed checkpoint recorded
    (Choices.record()), reused as the module docstring says; its warnings go into `warnings`."""
    options = options or candidates(t, info.world_size)  # `options`: start's, passed on
    options, why = _from_record(t, info.world_size, options, recorded, warnings)
    mb = options[0]
    if runs_trials(t, info) and wrapped is not None:
        device = torch.device(info.device)
        mb = _trials(t, info, wrapped, model, autocast, vocab_size, options, device)
    if why or (recorded and t.micro_batch_size == "auto" and mb != recorded):
        why = why or "it does not fit in GPU memory here"
        (warnings if warnings is not None else []).append(
            decided_again("micro_batch_size", recorded, why, mb)
        )
    return mb, accumulation_steps(t.total_batch_size, mb, t.seq_len, info.world_size)


def recorded_micro_batch(saved: dict) -> int | None:
    """The micro-batch a resumed checkpoint's meta (`saved`) recorded with its speed choices
    (checkpoints before that record: its "micro_batch_size"), or None."""
    record = saved.get("speed_choices") or {}
    return record.get("micro_batch_size", saved.get("micro_batch_size"))


def _from_record(t: TrainConfig, world: int, options: list[int], recorded, warnings):
    """(the options a run tries, why the `recorded` micro-batch cannot run here or None): auto
    tries the recorded one first, then smaller ones; an explicit one that differs is a warning."""
    if not recorded:
        return options, None
    if t.micro_batch_size != "auto":
        if t.micro_batch_size != recorded and warnings is not None:
            warnings.append(overrides_line("micro_batch_size", t.micro_batch_size, recorded))
        return options, None
    if recorded in options:
        return [o for o in options if o <= recorded], None
    n = sequences_per_rank(t.total_batch_size, t.seq_len, world)
    why = f"it does not divide the {n} sequences per process at world size {world}"
    if n % recorded == 0:
        why = f"it is over train.micro_batch_cap = {t.micro_batch_cap}"
    return options, why


def _trials(t: TrainConfig, info, wrapped, model, autocast, vocab_size: int, options, device):
    """The largest of `options` that fits on every rank, by trial steps (see `resolve`)."""
    all_min = (lambda v: _all_min(v, device)) if dist.active() else None
    if parallelize.syncs_per_block(wrapped):
        local = parallelize.local_numel(model)
        full = sum(p.numel() for p in model.parameters())  # a DTensor's numel is the whole
        whole = not parallelize.syncs_every_micro_step(wrapped)

        def reserve_for(m: int) -> int:  # AdamW m and v; an unsharded grad when accumulating
            accum = accumulation_steps(t.total_batch_size, m, t.seq_len, info.world_size)
            return 8 * local + (4 * full if accum > 1 and whole else 0)

        return fsdp_fit(
            options,
            lambda m: trial_peak(wrapped, model, autocast, m, t.seq_len, vocab_size, device),
            *_memory(device),
            reserve_for,
            all_min,
            lambda fitted: agreed(fitted, device),
        )
    return fit(
        options,
        lambda m: trial_fits(wrapped, model, autocast, m, t.seq_len, vocab_size, device, t.compile),
        all_min,
    )

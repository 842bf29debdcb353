"""The one place a model is wrapped for training, and the one answer to "is this run sharded?".

Order (torchtitan's), applied from outside the model by `wrap_model`: float8 Linear layers ->
activation checkpointing -> torch.compile -> DDP | FSDP2. A new parallelism goes here: a branch
in wrap_model, its answer in `shards` / `is_sharded`, and its gradient-sync rule in `grad_sync`;
the checkpoint manager and the training loop ask these functions and never sniff wrapper types
themselves.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from gptrain.config.sections import DistConfig
from gptrain.distributed.runtime import DistInfo
from gptrain.errors import UserError

# FSDP2 roots that reduce-scatter on every micro-step (dist.fsdp_reduce = every), see grad_sync
_REDUCE_EVERY: weakref.WeakSet = weakref.WeakSet()


def shards(cfg: DistConfig, info: DistInfo) -> bool:
    """Does this run shard its parameters (FSDP2 on 2+ processes)? Decided from the config, before
    a model exists; one process under dist.mode = fsdp holds everything and is not sharded."""
    return cfg.mode == "fsdp" and info.world_size > 1


def is_sharded(model: nn.Module) -> bool:
    """The same question asked of a built model: its parameters are FSDP2 DTensors."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def wrap_model(
    model: nn.Module,
    cfg: DistConfig,
    *,
    info: DistInfo,
    compile: bool,
    param_dtype: torch.dtype,
    activation_checkpointing: str = "none",
    float8: tuple = (),
) -> nn.Module:
    """Apply float8 layers, activation checkpointing, compile and data parallelism from outside
    the model, always in this order (torchtitan's; each step wraps what the previous one produced):

    0. float8 (`float8`: the (in, out) shapes train.float8 chose): convert_float8, in place; the
       Float8Linear layers keep their Parameters, so keys and values stay those of nn.Linear.
    1. activation checkpointing (`blocks`): each transformer block's forward runs under the public
       `torch.utils.checkpoint.checkpoint` (non-reentrant), so backward recomputes the block instead
       of keeping its activations. The block's own `forward` is replaced on the instance: no wrapper
       module, so state-dict keys stay plain (no `_checkpoint_wrapped_module.`).
    2. torch.compile, in place (`Module.compile()`), so keys never gain `_orig_mod.`. Under FSDP each
       block is compiled on its own, after checkpointing (the recompute is traced with the block)
       and before `fully_shard`: FSDP2's hooks are `torch._dynamo.disable`d, so they run eagerly
       around the compiled block (tested: no recompiles after the first step).
    3. world size 1: nothing more. ddp: DistributedDataParallel. fsdp: FSDP2 `fully_shard` on every
       block, then on the root (embeddings, final norm, the output head, tied or untied). With
       bf16 the blocks all-gather and compute with bf16 parameters; the root keeps float32
       parameters; and the caller runs forward under the same autocast as DDP. So the residual
       stream, LayerNorms, logits and loss stay float32 as under DDP + autocast, and matmuls see
       the same bf16-rounded weights. Gradients are reduced in float32. LayerNorms: CUDA's
       autocast runs layer_norm in float32, casting the bf16-gathered weights up (their master
       copies stay float32). CPU autocast does not, and refuses bf16 LayerNorm parameters with a
       float32 input, so on the CPU each block's LayerNorms (where it has any: nanochat's RMSNorm
       has no weights) get a float32 group of their own; that group's hooks sit inside the
       compiled block and break its graph (with activation checkpointing, the whole block then
       runs eagerly), which is why CUDA does without it.

    The model may be on the `meta` device under FSDP (see build.py: `to_empty` + init after this).
    The returned module is what the training loop calls; save the original `model` (its keys are
    the plain ones). The caller builds the optimizer after wrapping (FSDP replaces parameters).
    """
    if float8:
        convert_float8(model, float8)
    blocks = model.blocks()
    if activation_checkpointing == "blocks":
        for block in blocks:
            checkpoint_forward(block)
    if shards(cfg, info):
        _fully_shard(model, blocks, cfg, info, compile, param_dtype)
        return model
    if compile:
        model.compile()
    if info.world_size > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        device_ids = [info.local_rank] if info.device_type == "cuda" else None
        return DDP(
            model,
            device_ids=device_ids,
            bucket_cap_mb=cfg.bucket_cap_mb,
            gradient_as_bucket_view=cfg.gradient_as_bucket_view,
            static_graph=cfg.static_graph,
        )
    return model


def _fully_shard(model, blocks, cfg: DistConfig, info: DistInfo, compile: bool, param_dtype):
    """wrap_model's FSDP2 step 3 (and step 2 per block): see its docstring."""
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:
        raise UserError(
            f"dist.mode = 'fsdp' needs torch >= 2.6 (this is {torch.__version__}); upgrade torch or use dist.mode=ddp"
        ) from None
    low = None if param_dtype == torch.float32 else param_dtype
    block_mp = MixedPrecisionPolicy(
        param_dtype=low, reduce_dtype=torch.float32, cast_forward_inputs=False
    )
    fp32 = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for block in blocks:
        if compile:
            block.compile()
        norms = [m for m in block.modules() if isinstance(m, nn.LayerNorm)]
        if low is not None and norms and info.device_type == "cpu":  # wrap_model, 3.
            fully_shard(norms, mp_policy=fp32)
        fully_shard(block, mp_policy=block_mp)
    fully_shard(model, mp_policy=fp32)
    if cfg.fsdp_reduce == "every":
        _REDUCE_EVERY.add(model)


def float8_layers(model: nn.Module) -> dict[str, tuple[int, int]]:
    """The Linear layers float8 training may convert, {name: (in_features, out_features)}: those
    inside the transformer blocks (model.blocks(): GPT-2's c_attn, c_proj, c_fc; nanochat's c_q,
    c_k, c_v, c_proj, c_fc) whose two dimensions are multiples of 16 (FP8 matmuls need it). The
    embeddings and the output head, tied or not (computed by model/losses.py), stay as they are."""
    in_blocks = {id(m) for block in model.blocks() for m in block.modules()}
    return {
        name: (m.in_features, m.out_features)
        for name, m in model.named_modules()
        if id(m) in in_blocks
        and isinstance(m, nn.Linear)
        and m.in_features % 16 == 0
        and m.out_features % 16 == 0
    }


def convert_float8(model: nn.Module, shapes, emulate: bool = False) -> list[str]:
    """Swap the float8_layers of the given (in, out) `shapes` for torchao's Float8Linear, in
    place (to_float8); the names swapped."""
    wanted = {tuple(s) for s in shapes}
    chosen = {name for name, shape in float8_layers(model).items() if shape in wanted}
    to_float8(model, chosen, emulate)
    return sorted(chosen)


def to_float8(module: nn.Module, names: set, emulate: bool = False) -> None:
    """The nn.Linear layers of `module` named in `names` become torchao's Float8Linear with
    tensorwise dynamic scaling (each matmul of forward and backward casts its two operands to
    float8, one scale per tensor from its largest magnitude). Float8Linear takes over the layer's
    own weight and bias Parameters (no copy, no new buffer), so state-dict keys and values stay
    those of nn.Linear and checkpoints stay plain. `emulate`: float8 rounding on any device,
    without FP8 matmuls (tests only)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    convert_to_float8_training(
        module,
        module_filter_fn=lambda _, name: name in names,
        config=Float8LinearConfig(emulate=emulate),
    )


def eager():
    """A context in which modules compiled by wrap_model run their eager code: for calls whose
    shapes change every time (the trial step per micro-batch, HellaSwag's batch lengths), each of
    which would otherwise compile a graph of its own. torch < 2.6 has no set_stance: a no-op."""
    set_stance = getattr(torch.compiler, "set_stance", None)
    return set_stance("force_eager") if set_stance else contextlib.nullcontext()


def checkpoint_forward(module: nn.Module) -> None:
    """Activation checkpointing of one module, in place: while gradients are recorded, its forward
    runs under torch.utils.checkpoint (non-reentrant; RNG state restored for the recompute, so
    dropout masks match), keeping only its inputs; eval and sampling (no_grad) run it plainly."""
    from torch.utils.checkpoint import checkpoint

    inner = module.forward

    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():
            return inner(*args, **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward


def syncs_every_micro_step(wrapped: nn.Module) -> bool:
    """Are gradients reduced on every micro-step, not only the last? FSDP2 under
    dist.fsdp_reduce = every: each micro-step's gradient is reduce-scattered and summed into the
    local shard, so no rank ever holds a whole gradient (torchtitan's way; accumulation-times the
    reduce-scatters). Under `last` FSDP2 keeps an unsharded float32 gradient of every parameter
    between micro-steps. DDP always reduces on the last micro-step only: its gradients are whole
    on every rank anyway."""
    return wrapped in _REDUCE_EVERY


def grad_sync(wrapped: nn.Module, sync: bool):
    """Context for one micro-step: gradient communication only when `sync` (the caller passes
    the last micro-step, or every one where `syncs_every_micro_step`).

    DDP: the public `no_sync()` context, entered around forward AND backward. FSDP2:
    `set_requires_gradient_sync(sync)`. Single process: nothing to skip.
    """
    if hasattr(wrapped, "no_sync"):  # DistributedDataParallel
        return contextlib.nullcontext() if sync else wrapped.no_sync()
    if hasattr(wrapped, "set_requires_gradient_sync"):  # FSDPModule
        wrapped.set_requires_gradient_sync(sync)
    return contextlib.nullcontext()


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A value computed on sharded parameters (a DTensor, e.g. FSDP2's gradient norm) as the
    whole tensor on every rank; a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def local_numel(model: nn.Module) -> int:
    """Parameters this rank holds: its shards under FSDP2, every parameter otherwise."""
    return sum(
        p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in model.parameters()
    )


def syncs_per_block(wrapped: nn.Module) -> bool:
    """Does forward/backward gather and reduce per block (FSDP2), so that a step without sync
    still communicates?"""
    return hasattr(wrapped, "set_requires_gradient_sync")


@dataclass(frozen=True)
class RowShards:
    """How a matrix is split over the ranks of `group`: rank r holds rows[r] whole rows, the
    block starting at row r * max(rows) (torch.chunk's split of dim 0, as DTensor's Shard(0))."""

    group: object  # the torch.distributed ProcessGroup of the mesh
    rank: int  # this process's index in `group`
    rows: tuple[int, ...]


def row_shards(p: torch.Tensor) -> RowShards | None:
    """The layout of a matrix parameter: None when this rank holds all of it (one process, DDP);
    its row blocks when it is a DTensor sharded along dim 0 over a 1-D mesh (FSDP2's layout);
    ValueError naming the layout for anything else (e.g. sharded along its columns)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor):
        return None
    mesh, placements = p.device_mesh, tuple(p.placements)
    by_rows = mesh.ndim == 1 and len(placements) == 1 and type(placements[0]) is Shard
    if not by_rows or placements[0].dim != 0:
        raise ValueError(f"sharded as {placements} over a {mesh.ndim}-D mesh, not by rows")
    n, total = mesh.size(), p.shape[0]
    chunk = -(-total // n)
    rows = tuple(max(0, min(chunk, total - r * chunk)) for r in range(n))
    me = mesh.get_local_rank()
    if p.to_local().shape[0] != rows[me]:
        raise ValueError(f"sharded into uneven row blocks ({p.to_local().shape[0]} rows here)")
    return RowShards(mesh.get_group(), me, rows)


def replica_group():
    """The process group whose ranks hold identical copies of the plain (unsharded) parameters:
    the default group of a run with 2+ processes (DDP); None for one process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.group.WORLD
    return None

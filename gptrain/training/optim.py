"""Optimizers (AdamW; Muon for the block matrices + AdamW for the rest) and the learning-rate
schedules (warmup + cosine; warmup, stable, linear decay).

optim.embed_lr (> 0) gives the embeddings and the output head (`embed_head`) an AdamW group of their
own at that peak lr, in both modes, scheduled as optim.lr (set_lr); 0 leaves them in the groups
they always had (so checkpoints written without it resume unchanged). optim.head_lr (> 0) gives an
untied output head (nanochat's lm_head) a group of its own at that lr, out of the embeddings'; a
tied head (GPT-2's: the token embedding itself) is refused, it has no lr apart from wte's.

Weight decay applies to matrices (embeddings and Linear weights, dim >= 2) and not to biases or
LayerNorm parameters: optim.weight_decay to AdamW's matrices, optim.muon_weight_decay to Muon's
(both decoupled, multiplied by their own optimizer's scheduled lr). AdamW works unchanged with
FSDP2 (DTensor parameters report their global shape); Muon (ours, gptrain/training/muon.py:
torch.optim.Muon's update with the orthogonalisation in a dtype chosen for the device)
orthogonalises each whole matrix once per step on one owner rank under FSDP2, and under DDP too
with optim.muon_split = split, or auto where the split was measured faster (`muon_splits`).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from gptrain.config.sections import OptimConfig
from gptrain.distributed import parallelize
from gptrain.errors import UserError
from gptrain.training.muon import Muon


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: dim >= 2 parameters decayed, the rest not; a tied weight appears once."""
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() yields a shared (tied) Parameter only once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def embed_head(model: nn.Module) -> list:
    """The embeddings (every nn.Embedding's weight: wte, and wpe where there is one) and the
    output head (model.lm_head.weight: GPT-2's is wte itself, listed once; nanochat's is its own)."""
    found = [m.weight for m in model.modules() if isinstance(m, nn.Embedding)]
    head = getattr(model, "lm_head", None)
    found += [head.weight] if head is not None else []
    return list({id(p): p for p in found if p.requires_grad}.values())


def untied_head(model: nn.Module):
    """The output head's weight where it is a parameter of its own (nanochat's lm_head), else None
    (GPT-2's head is wte itself; a model without model.lm_head has none)."""
    head = getattr(model, "lm_head", None)
    if head is None:
        return None
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return None if id(head.weight) in embeddings else head.weight


def split_own_lrs(model: nn.Module, groups: list[dict], cfg: OptimConfig) -> list[dict]:
    """`groups` (AdamW's) with the parameters that have an lr of their own taken out, into groups
    decayed as the other matrices and marked for set_lr (the marks are saved with the optimizer
    state): cfg.embed_lr > 0: the embeddings, and the head unless it has its own, marked "embed";
    cfg.head_lr > 0: the untied head, marked "head" (a tied head: UserError). Empty groups are
    left out (a nanochat model has no 1-D parameters, and a checkpoint's optimizer may have one
    empty group only). Neither key set: `groups` unchanged."""
    head = untied_head(model) if cfg.head_lr > 0 else None
    if cfg.head_lr > 0 and head is None:
        raise UserError(
            f"optim.head_lr = {cfg.head_lr} is the lr of an untied output head, but this model's head is its token embedding (tied, as GPT-2's): set optim.head_lr=0 and give both one lr with optim.embed_lr, or use model.arch=nanochat"
        )
    own = [{"params": [head], "weight_decay": cfg.weight_decay, "head": True}] if head is not None else []  # fmt: skip
    if cfg.embed_lr > 0:
        embed = [p for p in embed_head(model) if p is not head]
        own.insert(0, {"params": embed, "weight_decay": cfg.weight_decay, "embed": True})
    if not own:
        return groups  # as without the keys, empty groups included: old checkpoints resume
    ids = {id(p) for g in own for p in g["params"]}
    rest = [{**g, "params": [p for p in g["params"] if id(p) not in ids]} for g in groups]
    return [g for g in (*own, *rest) if g["params"]]


def muon_split(model: nn.Module, weight_decay: float) -> tuple[list, list[dict]]:
    """(Muon parameters, AdamW groups): the 2-D weights inside the transformer blocks
    (model.blocks()) go to Muon; the rest stays with AdamW: the embeddings (wte, and wpe where
    there is one), the output head (tied to wte, or untied: nanochat's lm_head, never Muon),
    biases and norm weights. The no-decay group is empty where there are no 1-D parameters."""
    in_blocks = {id(p) for block in model.blocks() for p in block.parameters()}
    muon, rest = [], []
    for p in model.parameters():
        if p.requires_grad:
            (muon if id(p) in in_blocks and p.dim() == 2 else rest).append(p)
    return muon, [
        {"params": [p for p in rest if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in rest if p.dim() < 2], "weight_decay": 0.0},
    ]


class MuonAdamW(torch.optim.Optimizer):
    """Muon (gptrain/training/muon.py) over `muon_params` and torch.optim.AdamW over
    `adamw_groups`, as ONE optimizer: one step(), one zero_grad(), one param_groups list (Muon's groups first) and one
    state dict, so checkpointing (torch.distributed.checkpoint.state_dict), GradScaler and
    clipping see a plain Optimizer. The two inner optimizers share this object's group dicts and
    its `state`; load_state_dict re-links them to the loaded ones.

    Muon scales each matrix's step by sqrt(max(1, rows / cols)) (torch's adjust_lr_fn
    "original", Keller Jordan's rule, as in modded-nanogpt and nanochat), so `muon_lr` is of the
    order of 0.02 while AdamW's lr stays that of an AdamW run. `muon_dtype` is the dtype of the
    orthogonalisation (bf16: torch.optim.Muon's, bit for bit); `muon_split`: under DDP, each
    matrix orthogonalised on one rank and broadcast (gptrain/training/muon.py). The groups and
    state are torch.optim.Muon's, so checkpoints of earlier versions (which used it) resume."""

    def __init__(
        self,
        muon_params,
        adamw_groups,
        *,
        muon: dict,
        adamw: dict,
        muon_dtype: torch.dtype = torch.bfloat16,
        muon_split: bool = False,
    ):
        self.muon = Muon(muon_params, **muon, dtype=muon_dtype, split=muon_split)
        self.adamw = torch.optim.AdamW(adamw_groups, **adamw)
        super().__init__(self.muon.param_groups + self.adamw.param_groups, defaults={})
        self._n_muon = len(self.muon.param_groups)
        self._link()

    def _link(self) -> None:
        self.muon.param_groups = self.param_groups[: self._n_muon]
        self.adamw.param_groups = self.param_groups[self._n_muon :]
        self.muon.state = self.adamw.state = self.state  # disjoint parameters: one state mapping

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MuonAdamW.step takes no closure")
        self.muon.step()
        self.adamw.step()

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)  # replaces self.param_groups and self.state
        self._link()


def build_optimizer(
    model: nn.Module,
    cfg: OptimConfig,
    device_type: str,
    muon_dtype: torch.dtype | None = None,
    split_choice: str | None = None,
) -> torch.optim.Optimizer:
    """cfg.name = adamw: AdamW(betas=(beta1, beta2), eps) over param_groups, with the fused
    kernel on CUDA and CPU (on a CPU 5-10x faster than foreach: one pass over each parameter
    instead of a dozen), else foreach. muon: MuonAdamW (see muon_split for which parameter goes
    where), decaying the Muon matrices by cfg.muon_weight_decay and AdamW's by cfg.weight_decay,
    orthogonalising in `muon_dtype` (the run's measured choice, gptrain/training/choices.py;
    None: cfg.muon_dtype when explicit, else bf16, what torch.optim.Muon does), each matrix on
    one owner rank under FSDP2, and under DDP as `split_choice` says (the run's measured choice,
    Choices.muon_split; None: cfg.muon_split's rule, muon_splits). cfg.embed_lr > 0: the
    embeddings and head in an AdamW group of their own, cfg.head_lr > 0: an untied head in one of
    its own (split_own_lrs), in both modes."""
    fused = device_type in ("cuda", "cpu")
    adamw = dict(
        lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused, foreach=not fused
    )
    if cfg.name == "adamw":
        groups = split_own_lrs(model, param_groups(model, cfg.weight_decay), cfg)
        return torch.optim.AdamW(groups, **adamw)
    muon_params, groups = muon_split(model, cfg.weight_decay)
    groups = split_own_lrs(model, groups, cfg)
    muon = dict(
        lr=cfg.muon_lr,
        weight_decay=cfg.muon_weight_decay,
        momentum=cfg.muon_momentum,
        nesterov=True,
        ns_steps=cfg.muon_ns_steps,
    )
    if muon_dtype is None:
        muon_dtype = torch.float32 if cfg.muon_dtype == "float32" else torch.bfloat16
    check_muon_layout(model, muon_params)
    split = muon_splits(split_choice or cfg.muon_split)
    return MuonAdamW(
        muon_params, groups, muon=muon, adamw=adamw, muon_dtype=muon_dtype, muon_split=split
    )


def muon_splits(choice: str) -> bool:
    """optim.muon_split: does each DDP rank orthogonalise only the matrices it owns and receive
    the others' (split), or every matrix itself (redundant)? auto, where nothing measured it
    (choices.decide_muon_split does under DDP): split, faster on 2 CPU ranks and the same code at
    1 (docs/distributed.md, "Muon under FSDP2 and DDP"). FSDP2 always splits: no rank holds a
    whole matrix."""
    return choice != "redundant"


def check_muon_layout(model: nn.Module, muon_params: list) -> None:
    """A UserError naming the first Muon matrix whose layout Muon cannot orthogonalise whole
    (parallelize.row_shards: sharded other than by rows over one mesh), and the fix."""
    names = {id(p): n for n, p in model.named_parameters()}
    for p in muon_params:
        try:
            parallelize.row_shards(p)
        except ValueError as e:
            raise UserError(
                f"optim.name = 'muon': parameter {names.get(id(p), tuple(p.shape))} is {e}; Muon orthogonalises whole matrices and needs each rank's shard to be whole rows (FSDP2's default Shard(0)): shard it by rows, or use optim.name=adamw"
            ) from None


def set_lr(optimizer: torch.optim.Optimizer, lr: float, cfg: OptimConfig) -> None:
    """Set this step's learning rate: `lr` (from lr_at) for the AdamW groups, and the same fraction
    of the peak, lr / cfg.lr, of cfg.muon_lr for the Muon groups, of cfg.embed_lr for the
    embeddings' group and of cfg.head_lr for the untied head's (where those keys > 0 made them):
    warmup, decay and the min_lr / lr ratio are the same for all four. Taken from the config every step, so a resumed
    run follows the config it is started with (a checkpoint's saved lrs are overwritten)."""
    fraction = lr / cfg.lr
    for group in optimizer.param_groups:
        if "ns_steps" in group:  # only Muon's groups have ns_steps
            group["lr"] = cfg.muon_lr * fraction
        elif group.get("embed"):
            group["lr"] = (cfg.embed_lr or cfg.lr) * fraction
        elif group.get("head"):
            group["lr"] = cfg.head_lr * fraction
        else:
            group["lr"] = lr


def beta2_at(
    batch_tokens: float, ref_beta2: float = 0.95, ref_batch_tokens: float = 2**19
) -> float:
    """AdamW's beta2 at a batch of `batch_tokens` tokens per step that keeps the half-life, in
    tokens, of ref_beta2 at ref_batch_tokens: ref_beta2 ** (batch_tokens / ref_batch_tokens).
    (The second-moment average weighs a gradient k steps old by beta2**k; it halves after
    log(1/2) / log(beta2) steps, times batch_tokens tokens.) E.g. 0.95 at 2**19 tokens is
    0.99960 at 4,096."""
    if not batch_tokens > 0 or not ref_batch_tokens > 0 or not 0 < ref_beta2 < 1:
        raise ValueError(
            f"need batch_tokens > 0, ref_batch_tokens > 0 and 0 < ref_beta2 < 1; got {batch_tokens}, {ref_batch_tokens}, {ref_beta2}"
        )
    return ref_beta2 ** (batch_tokens / ref_batch_tokens)


def lr_at(step: float, cfg: OptimConfig, max_steps: int) -> float:
    """The learning rate of optimizer step `step` under cfg's schedule (see the two below); a
    fractional step (train.time_budget reads the schedule at the share of the budget spent) lies
    between its neighbours' learning rates."""
    kw = dict(lr=cfg.lr, min_lr=cfg.min_lr, warmup_steps=cfg.warmup_steps, max_steps=max_steps)
    if cfg.lr_schedule == "wsd":
        return wsd_lr(step, decay_fraction=cfg.decay_fraction, **kw)
    return cosine_lr(step, **kw)


def _check_args(step: float, warmup_steps: int, max_steps: int) -> None:
    if warmup_steps < 0 or max_steps < 1 or step < 0:
        raise ValueError(
            f"need step >= 0, warmup_steps >= 0, max_steps >= 1; got step={step}, "
            f"warmup_steps={warmup_steps}, max_steps={max_steps}"
        )


def cosine_lr(step: float, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """Learning rate of optimizer step `step` (counted from 0).

        step < warmup_steps:              lr * min(1, (step + 1) / warmup_steps)  (linear warmup)
        step >= max_steps - 1:            min_lr                              (end, held after)
        otherwise, with p = (step - warmup_steps) / (max_steps - 1 - warmup_steps) in [0, 1):
                                          min_lr + 0.5 * (1 + cos(pi * p)) * (lr - min_lr)

    So the last warmup step and the first cosine step both use the peak lr, and min_lr is
    reached exactly at step max_steps - 1. warmup_steps may be 0 (start at the peak). The min
    changes nothing for whole steps; a fractional step between the last warmup step and the first
    cosine step (train.time_budget) stays at the peak.
    """
    _check_args(step, warmup_steps, max_steps)
    if step < warmup_steps:
        return lr * min(1.0, (step + 1) / warmup_steps)
    if step >= max_steps - 1:
        return min_lr
    progress = (step - warmup_steps) / (max_steps - 1 - warmup_steps)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def wsd_lr(
    step: float,
    *,
    lr: float,
    min_lr: float,
    warmup_steps: int,
    max_steps: int,
    decay_fraction: float,
) -> float:
    """Warmup, stable, decay: learning rate of optimizer step `step` (counted from 0).

    With n = max(1, round(decay_fraction * max_steps)) decay steps starting at
    d = max(warmup_steps, max_steps - n) (the decay never eats into the warmup):

        step < warmup_steps:      lr * min(1, (step + 1) / warmup_steps)   (linear warmup)
        warmup_steps <= step < d: lr                                       (stable)
        d <= step < max_steps:    lr + (min_lr - lr) * (step - d + 1) / (max_steps - d)
        step >= max_steps:        min_lr                                   (held)

    So step d - 1 is the last at the peak, the decay is linear, and step max_steps - 1 (the last
    step) uses min_lr, as in cosine_lr. Read between whole steps (train.time_budget), the lr is
    continuous: the decay line runs from step d - 1 (peak) to step max_steps - 1 (min_lr).
    """
    _check_args(step, warmup_steps, max_steps)
    if not 0 < decay_fraction <= 1:
        raise ValueError(f"decay_fraction must be in (0, 1], got {decay_fraction}")
    if step < warmup_steps:
        return lr * min(1.0, (step + 1) / warmup_steps)
    if step >= max_steps - 1:
        return min_lr
    start = max(warmup_steps, max_steps - max(1, round(decay_fraction * max_steps)))
    if step <= start - 1:  # (for whole steps: step < start; between steps, continuous)
        return lr
    return lr + (min_lr - lr) * (step - start + 1) / (max_steps - start)

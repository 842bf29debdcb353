"""Muon (momentum + Newton-Schulz orthogonalisation) for the 2-D matrices inside the blocks, with
the orthogonalisation in a dtype chosen for the device (`optim.muon_dtype`), computed once per
matrix per step also when several processes train.

Why our own: torch.optim.Muon (torch >= 2.9) always orthogonalises in bf16 (`grad.bfloat16()`),
which is fast where bf16 is native (GPUs of compute capability >= 8.0, CPUs with AVX512-BF16 or
AMX) and ~20x slower than float32 where it is emulated (AVX2-only CPUs, older GPUs), and it is not
DTensor-aware. The update below is the same computation, op for op: in bfloat16 it equals
torch.optim.Muon with adjust_lr_fn="original" bit for bit (tests/test_optim.py); in float32 the
orthogonalisation is within 1e-5 of the same iteration in float64 (max abs error; measured ~7e-7
on entries of ~0.1-0.6, where bf16 is ~1e-2 off; same test file). It also runs on a torch
without torch.optim.Muon (< 2.9).

Several processes (docs/distributed.md, "Muon under FSDP2 and DDP"): each matrix has one owner
rank (`assign_owners`: largest first to the least-loaded rank, so each rank's Newton-Schulz work
is at most 1/N of the total plus the largest matrix's). Under FSDP2 (parameters sharded by rows,
`parallelize.row_shards`) the owner gathers the momentum-updated gradient's row blocks,
orthogonalises the whole matrix and scatters the result's row blocks back; each rank applies its
block to its shard, and the momentum stays sharded (a DTensor, saved by DCP like any optimizer
state). Under DDP with `split` the owner orthogonalises and broadcasts, so every replica applies
the same bytes; without it every rank orthogonalises every matrix (`redundant`). Either way each
matrix's update is the one a single process computes from the same gradient.

The optimizer keeps torch.optim.Muon's layout: the same param-group keys (lr, weight_decay,
momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn) and one state entry per matrix,
`momentum_buffer`, so checkpoints written with either resume with either. The dtype and the split
are not part of that state: they are properties of the machine a run is on, not of the run.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from gptrain.distributed import parallelize

# Keller Jordan's quintic iteration (torch.optim._muon's DEFAULT_A, _B, _C and EPS)
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
EPS = 1e-7


def orthogonalise(
    g: Tensor,
    steps: int,
    dtype: torch.dtype = torch.bfloat16,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = EPS,
) -> Tensor:
    """~U V^T of g = U S V^T by `steps` Newton-Schulz iterations in `dtype` (the singular values
    land in roughly [0.5, 1.5], which is all Muon needs). Returns a new tensor in `dtype`, never
    g itself. Works on the wide orientation (rows <= cols), where the Gram matrix is smaller."""
    a, b, c = coefficients
    tall = g.size(0) > g.size(1)
    x = g.to(dtype)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm = 1
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b G + c G^2
        x = torch.addmm(x, poly, x, beta=a)  # a X + (b G + c G^2) X
    return x.T if tall else x


def ns_flops(shape, steps: int) -> int:
    """Multiply-add FLOPs of orthogonalise on a matrix of `shape`: per iteration, on the wide
    orientation m x n (m <= n), the Gram matrix (2 m^2 n), its square (2 m^3) and the product with
    X (2 m^2 n)."""
    m, n = sorted(shape[:2])
    return steps * (4 * m * m * n + 2 * m**3)


def assign_owners(costs: list[int], ranks: int) -> list[int]:
    """The owner rank of each matrix: in order of decreasing cost (ties: list order), each to the
    rank with the least cost so far (ties: the lowest rank). The same on every rank, and each
    rank's total is at most sum(costs) / ranks + max(costs) (a matrix goes to a rank whose load
    is at most the mean of the loads so far)."""
    load, owner = [0] * ranks, [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owner[i], load[rank] = rank, load[rank] + costs[i]
    return owner


def lr_scale(shape: torch.Size) -> float:
    """torch's adjust_lr_fn "original" (Keller Jordan's rule): sqrt(max(1, rows / cols))."""
    rows, cols = shape[:2]
    return math.sqrt(max(1, rows / cols))


def _local(t: Tensor) -> Tensor:
    """This rank's part of a DTensor (a view: in-place ops change the DTensor), or t itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class Muon(torch.optim.Optimizer):
    """Muon over 2-D parameters: per matrix, momentum (nesterov by default), its orthogonalisation
    in `dtype`, decoupled weight decay p *= 1 - lr * weight_decay (the group's lr, without
    lr_scale), then p -= lr * lr_scale(p.shape) * update. Groups and state as torch.optim.Muon's
    (module docstring). Parameters sharded by rows (FSDP2) are orthogonalised whole on one owner
    rank each; plain parameters of a run with 2+ processes (DDP) are too when `split` is true."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        dtype: torch.dtype = torch.bfloat16,
        split: bool = False,
    ):
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=NS_COEFFICIENTS,
            eps=EPS,
            ns_steps=ns_steps,
            adjust_lr_fn="original",
        )
        super().__init__(params, defaults)
        self.dtype = dtype
        matrices = [(p, g) for g in self.param_groups for p in g["params"]]
        for p, _ in matrices:
            if p.dim() != 2:
                raise ValueError(f"Muon takes 2-D parameters only, got shape {tuple(p.shape)}")
        self.plan = _Plan([p for p, _ in matrices], [g["ns_steps"] for _, g in matrices], split)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("Muon.step takes no closure")
        work = [(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None]
        momenta = [self._momentum(p, g) for p, g in work]
        updates = self.plan.orthogonalise(work, momenta, self.dtype)
        for (p, group), update in zip(work, updates, strict=True):
            lr, local = group["lr"], _local(p)
            local.mul_(1 - lr * group["weight_decay"])
            local.add_(update, alpha=-lr * lr_scale(p.shape))

    def _momentum(self, p: Tensor, group: dict) -> Tensor:
        """Update the momentum (sharded like the parameter) and return what gets orthogonalised:
        this rank's rows of it (all of them unless the parameter is sharded)."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)  # a DTensor under FSDP2
        grad, buf = _local(p.grad), _local(state["momentum_buffer"])
        buf.lerp_(grad, 1 - group["momentum"])
        return grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf


class _Plan:
    """Who orthogonalises which matrix, decided once from the parameters' layout: every rank all
    of them (one process, or DDP without split), or each matrix on its owner rank."""

    def __init__(self, matrices: list[Tensor], steps: list[int], split: bool):
        shards = [parallelize.row_shards(p) for p in matrices]  # ValueError: not by rows
        groups = {tuple(dist.get_process_group_ranks(s.group)) for s in shards if s}
        if groups and (len(groups) > 1 or not all(shards)):
            raise ValueError("Muon needs all its matrices sharded by rows over the same ranks")
        self.shards = {p: s for p, s in zip(matrices, shards, strict=True)} if groups else None
        self.group = shards[0].group if groups else (parallelize.replica_group() if split else None)
        self.rank = dist.get_rank(self.group) if self.group is not None else 0
        ranks = dist.get_world_size(self.group) if self.group is not None else 1
        costs = [ns_flops(p.shape, s) for p, s in zip(matrices, steps, strict=True)]
        self.owner = dict(zip(matrices, assign_owners(costs, ranks), strict=True))

    def owned(self, p: Tensor) -> bool:
        """Does this rank orthogonalise p (always, unless the work is split)?"""
        return self.group is None or self.owner[p] == self.rank

    def orthogonalise(self, work, updates: list[Tensor], dtype) -> list[Tensor]:
        """The orthogonalised update of each (parameter, group) in `work`, this rank's rows of it."""

        def ns(x: Tensor, group: dict) -> Tensor:
            return orthogonalise(
                x, group["ns_steps"], dtype, group["ns_coefficients"], group["eps"]
            )

        if self.group is None:
            return [ns(u, g) for (_, g), u in zip(work, updates, strict=True)]
        if self.shards is None:
            return self._broadcast(work, updates, dtype, ns)
        return self._gather_scatter(work, updates, dtype, ns)

    def _src(self, p: Tensor) -> int:
        return dist.get_global_rank(self.group, self.owner[p])

    def _broadcast(self, work, updates, dtype, ns) -> list[Tensor]:
        """Replicas (DDP): each owner orthogonalises its matrices and broadcasts them as it goes
        (the sends overlap the next matrix's work); waits are bounded by the group's time-out."""
        out, pending = [], []
        for (p, group), u in zip(work, updates, strict=True):
            if self.owned(p):
                x = ns(u, group).contiguous()
            else:
                x = torch.empty(u.shape, dtype=dtype, device=u.device)
            pending.append(dist.broadcast(x, self._src(p), group=self.group, async_op=True))
            out.append(x)
        for handle in pending:
            handle.wait()
        return out

    def _gather_scatter(self, work, updates, dtype, ns) -> list[Tensor]:
        """Row shards (FSDP2): every matrix's row blocks are gathered to its owner (all gathers
        started at once), the owner orthogonalises the whole matrix and scatters its row blocks
        back. Blocks travel in `dtype` (the orthogonalisation's first op is that cast, so a
        single process rounds the same values) and padded to equal sizes, as collectives need."""
        gathers, inboxes = [], []
        for (p, _), u in zip(work, updates, strict=True):
            rows = self.shards[p].rows
            chunk = max(rows)
            send = u.new_zeros((chunk, u.shape[1]), dtype=dtype)
            send[: u.shape[0]] = u
            whole = send.new_empty((chunk * len(rows), u.shape[1])) if self.owned(p) else None
            blocks = list(whole.split(chunk)) if whole is not None else None
            gathers.append(dist.gather(send, blocks, self._src(p), self.group, async_op=True))
            inboxes.append(whole)
        out, scatters = [], []
        for i, ((p, group), u) in enumerate(zip(work, updates, strict=True)):
            rows = self.shards[p].rows
            chunk, blocks = max(rows), None
            if self.owned(p):
                gathers[i].wait()
                x = ns(inboxes[i][: p.shape[0]], group)  # the blocks in order: the whole matrix
                padded = x.new_zeros((chunk * len(rows), x.shape[1]))
                padded[: x.shape[0]] = x
                blocks, inboxes[i] = list(padded.split(chunk)), None
            mine = torch.empty((chunk, u.shape[1]), dtype=dtype, device=u.device)
            scatters.append(dist.scatter(mine, blocks, self._src(p), self.group, async_op=True))
            out.append(mine[: u.shape[0]])
        for handle in gathers + scatters:
            handle.wait()
        return out

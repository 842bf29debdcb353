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

Batched: the matrices one rank orthogonalises that share a shape (GPT-2's 12 blocks: 12 each of
4 shapes) are one stack (B, m, n), orthogonalised with one batched matrix product per product of
the iteration instead of B (`orthogonalise` on a 3-D tensor; `Muon(batched=False)` keeps the
per-matrix path). Each matrix keeps its own norm, so the result is the per-matrix one within
rounding (float32: 1e-5, bf16: a few of its steps; tests/test_optim.py; on this CPU the bits
came out equal). A matrix alone in its stack takes the 2-D path, torch.optim.Muon's. The update
is written straight into its slot of the stack in the orthogonalisation's dtype (`Update`).

Several processes (docs/distributed.md, "Muon under FSDP2 and DDP"): each matrix has one owner
rank (`assign_owners`: largest first to the least-loaded rank, so each rank's Newton-Schulz work
is at most 1/N of the total plus the largest matrix's). Under FSDP2 (parameters sharded by rows,
`parallelize.row_shards`) the owner gathers the momentum-updated gradient's row blocks,
orthogonalises the whole matrix and scatters the result's row blocks back; each rank applies its
block to its shard, and the momentum stays sharded (a DTensor, saved by DCP like any optimizer
state). Under DDP with `split` the owner orthogonalises and broadcasts, so every replica applies
the same bytes; without it every rank orthogonalises every matrix (`redundant`). Either way each
matrix's update is the one a single process computes from the same gradient. Batching applies to
the matrices of one owner: a DDP owner broadcasts each stack as soon as it is done (the sends
overlap its next stack's work); under FSDP2 the row blocks are gathered straight into the
owner's stack.

The optimizer keeps torch.optim.Muon's layout: the same param-group keys (lr, weight_decay,
momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn) and one state entry per matrix,
`momentum_buffer`, so checkpoints written with either resume with either. The dtype and the split
are not part of that state: they are properties of the machine a run is on, not of the run.
"""

from __future__ import annotations

import math
from typing import NamedTuple

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
    g itself. Works on the wide orientation (rows <= cols), where the Gram matrix is smaller.

    g is one matrix (m, n) or a stack of matrices of one shape (B, m, n), each orthogonalised on
    its own (its own norm) but all B in one batched matrix product per product of the iteration:
    B times fewer kernels, each B times larger (the same FLOPs)."""
    a, b, c = coefficients
    tall = g.size(-2) > g.size(-1)
    x = g.to(dtype)
    if tall:
        x = x.mT
    if x.dim() == 2:
        x = x / x.norm().clamp(min=eps)  # spectral norm <= Frobenius norm = 1
        for _ in range(steps):
            gram = x @ x.T
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b G + c G^2
            x = torch.addmm(x, poly, x, beta=a)  # a X + (b G + c G^2) X
    else:
        x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)
        for _ in range(steps):
            gram = torch.bmm(x, x.mT)
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, poly, x, beta=a)
    return x.mT if tall else x


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


class Update(NamedTuple):
    """What one matrix's orthogonalisation starts from: its momentum buffer, or with nesterov
    grad.lerp(buf, momentum). Written straight into the place the plan needs it (a slot of a stack,
    a row block to send) in the orthogonalisation's dtype, and only by a rank that orthogonalises
    it: no intermediate copy, and a DDP replica that receives the matrix skips it."""

    grad: Tensor
    buf: Tensor
    weight: float | None  # nesterov: the momentum; None: the buffer itself

    @property
    def shape(self) -> torch.Size:
        return self.buf.shape

    def write(self, out: Tensor) -> Tensor:
        if self.weight is None:
            return out.copy_(self.buf)
        return torch.lerp(self.grad, self.buf, self.weight, out=out)  # rounded once, into out


class Muon(torch.optim.Optimizer):
    """Muon over 2-D parameters: per matrix, momentum (nesterov by default), its orthogonalisation
    in `dtype`, decoupled weight decay p *= 1 - lr * weight_decay (the group's lr, without
    lr_scale), then p -= lr * lr_scale(p.shape) * update. Groups and state as torch.optim.Muon's
    (module docstring). Parameters sharded by rows (FSDP2) are orthogonalised whole on one owner
    rank each; plain parameters of a run with 2+ processes (DDP) are too when `split` is true.
    `batched`: the matrices a rank orthogonalises that share a shape go as one stack (False: one
    at a time, the per-matrix path, kept for comparison)."""

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
        batched: bool = True,
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
        self.dtype, self.batched = dtype, batched
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
        sources = [self._momentum(p, g) for p, g in work]
        updates = self.plan.orthogonalise(work, sources, self.dtype, self.batched)
        for (p, group), update in zip(work, updates, strict=True):
            lr, local = group["lr"], _local(p)
            local.mul_(1 - lr * group["weight_decay"])
            local.add_(update, alpha=-lr * lr_scale(p.shape))

    def _momentum(self, p: Tensor, group: dict) -> Update:
        """Update the momentum (sharded like the parameter; in place, one matrix at a time, as
        torch's multi-tensor ops are not public API in the torch versions supported) and return
        what gets orthogonalised: this rank's rows of it (all unless the parameter is sharded)."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)  # a DTensor under FSDP2
        grad, buf = _local(p.grad), _local(state["momentum_buffer"])
        buf.lerp_(grad, 1 - group["momentum"])
        return Update(grad, buf, group["momentum"] if group["nesterov"] else None)


def _stack(updates: list[Update], idx: list[int], dtype: torch.dtype) -> Tensor:
    """The updates idx written into one new (B, m, n) tensor in `dtype`."""
    first = updates[idx[0]].buf
    stack = torch.empty((len(idx), *first.shape), dtype=dtype, device=first.device)
    for j, i in enumerate(idx):
        updates[i].write(stack[j])
    return stack


def _ns(stack: Tensor, group: dict) -> Tensor:
    """The stack (B, m, n) orthogonalised, each matrix on its own, as a (B, m, n) tensor; a stack
    of one goes through the plain 2-D path (op for op torch.optim.Muon's)."""
    x = stack if len(stack) > 1 else stack[0]
    x = orthogonalise(x, group["ns_steps"], stack.dtype, group["ns_coefficients"], group["eps"])
    return x if x.dim() == 3 else x[None]


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

    def stacks(self, work, batched: bool = True) -> list[list[int]]:
        """Indices into `work` orthogonalised together: the matrices of one owner that share a
        shape and an iteration (the group's ns_steps, coefficients, eps), in order of first
        appearance, the same on every rank; with batched False, one matrix each."""
        if not batched:
            return [[i] for i in range(len(work))]
        stacks: dict = {}
        for i, (p, g) in enumerate(work):
            iteration = (g["ns_steps"], tuple(g["ns_coefficients"]), g["eps"])
            stacks.setdefault((self.owner[p], tuple(p.shape), iteration), []).append(i)
        return list(stacks.values())

    def orthogonalise(self, work, updates: list[Update], dtype, batched=True) -> list[Tensor]:
        """The orthogonalised update of each (parameter, group) in `work` (`updates`: what each
        starts from), this rank's rows of it; the matrices of one stack in one batched iteration."""
        stacks = self.stacks(work, batched)
        if self.group is None:
            out = [None] * len(work)
            for idx in stacks:
                x = _ns(_stack(updates, idx, dtype), work[idx[0]][1])
                for i, xi in zip(idx, x.unbind(0), strict=True):
                    out[i] = xi
            return out
        if self.shards is None:
            return self._broadcast(work, updates, dtype, stacks)
        return self._gather_scatter(work, updates, dtype, stacks)

    def _src(self, p: Tensor) -> int:
        return dist.get_global_rank(self.group, self.owner[p])

    def _broadcast(self, work, updates, dtype, stacks) -> list[Tensor]:
        """Replicas (DDP): each owner orthogonalises its stacks and broadcasts each as it is done
        (the sends overlap the next stack's work); waits are bounded by the group's time-out."""
        out, pending = [None] * len(work), []
        for idx in stacks:
            p, group = work[idx[0]]
            if self.owned(p):
                x = _ns(_stack(updates, idx, dtype), group).contiguous()
            else:
                x = torch.empty(
                    (len(idx), *p.shape), dtype=dtype, device=updates[idx[0]].buf.device
                )
            pending.append(dist.broadcast(x, self._src(p), group=self.group, async_op=True))
            for i, xi in zip(idx, x.unbind(0), strict=True):
                out[i] = xi
        for handle in pending:
            handle.wait()
        return out

    def _gather_scatter(self, work, updates, dtype, stacks) -> list[Tensor]:
        """Row shards (FSDP2): every matrix's row blocks are gathered to its owner, into its
        stack (all gathers started at once), the owner orthogonalises the whole stack and scatters
        each matrix's row blocks back. Blocks travel in `dtype` (the orthogonalisation's first op
        is that cast, so a single process rounds the same values) and padded to equal sizes, as
        collectives need; the padding rows arrive as zeros and leave unread."""
        gathers, inboxes = {}, {}
        for s, idx in enumerate(stacks):
            p = work[idx[0]][0]
            chunk, cols, device = max(self.shards[p].rows), p.shape[1], updates[idx[0]].buf.device
            total = chunk * len(self.shards[p].rows)
            whole = inboxes[s] = (
                torch.empty((len(idx), total, cols), dtype=dtype, device=device)
                if self.owned(p)
                else None
            )
            for j, i in enumerate(idx):
                send = torch.zeros((chunk, cols), dtype=dtype, device=device)
                updates[i].write(send[: updates[i].shape[0]])
                blocks = list(whole[j].split(chunk)) if whole is not None else None
                gathers[i] = dist.gather(send, blocks, self._src(p), self.group, async_op=True)
        out, scatters = [None] * len(work), []
        for s, idx in enumerate(stacks):
            (p, group), whole = work[idx[0]], inboxes.pop(s)
            chunk = max(self.shards[p].rows)
            if whole is not None:
                for i in idx:
                    gathers[i].wait()
                whole[:, : p.shape[0]] = _ns(whole[:, : p.shape[0]], group)  # padding: zeros
            for j, i in enumerate(idx):
                mine = torch.empty((chunk, p.shape[1]), dtype=dtype, device=updates[i].buf.device)
                blocks = list(whole[j].split(chunk)) if whole is not None else None
                scatters.append(dist.scatter(mine, blocks, self._src(p), self.group, async_op=True))
                out[i] = mine[: updates[i].shape[0]]
        for handle in list(gathers.values()) + scatters:
            handle.wait()
        return out

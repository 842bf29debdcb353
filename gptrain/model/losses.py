"""The output head's cross-entropy, two ways: chunk by chunk without the logits, or whole.

`linear_cross_entropy` runs the output head (x @ weight.T) and the cross-entropy over chunks of
rows and, when gradients are needed, computes each chunk's input and weight gradients right there
(Liger-kernel style), so at most one chunk's float32 logits are alive in forward and none in
backward. Same value and gradients as the plain computation, same FLOPs. `full_cross_entropy` is
the plain computation: the full logits, then F.cross_entropy (under torch.compile, fused by it);
faster where its memory is at hand (the choice: train.loss). Imports only torch.

`softcap` c > 0 (NanoChat) caps the float32 logits as c * tanh(logits / c) before the
cross-entropy, and only then are the padded columns masked to -inf (masked first, they would
become -c and get probability). 0: no cap, the computation untouched.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -1  # targets with this value are left out of the loss

# Rows per loss chunk = LOSS_CHUNK_ELEMENTS // padded vocab: one chunk's float32 logits are 128 MiB
# (GPT-2: 667 rows). Large enough to keep matmuls efficient, small next to the activations.
LOSS_CHUNK_ELEMENTS = 2**25
# torch.compile unrolls the chunk loop into its graph, and the compile time grows with the chunks
# (measured on an AVX2 EPYC, 2 layers, vocab 50257: 31.8 s with 1 chunk, 35.5 s with 4, 53.5 s
# with 8, 121.5 s with 32; GPT-2 124M's 64 x 1024 micro-batch has 99): a compiled loss takes at
# most this many chunks, each then at most 1/8 of the full logits (benchmarks/RESULTS.md,
# "Compiled loss").
MAX_COMPILED_CHUNKS = 8


def chunk_rows(
    n_rows: int, padded_vocab: int, rows: int | None = None, compiled: bool | None = None
) -> int:
    """Rows per loss chunk for n_rows rows: `rows`, else LOSS_CHUNK_ELEMENTS // padded_vocab; for a
    compiled loss (compiled None: while torch.compile traces) enough for at most
    MAX_COMPILED_CHUNKS chunks."""
    rows = rows or max(1, LOSS_CHUNK_ELEMENTS // padded_vocab)
    if torch.compiler.is_compiling() if compiled is None else compiled:
        rows = max(rows, -(-n_rows // MAX_COMPILED_CHUNKS))
    return rows


def linear_cross_entropy(
    x: Tensor,
    weight: Tensor,
    targets: Tensor,
    vocab_size: int,
    chunk_rows: int,
    softcap: float = 0.0,
) -> Tensor:
    """Mean cross-entropy of the logits x @ weight.T (only the first vocab_size columns), in
    float32, without ever holding more than chunk_rows rows of logits.

    x (N, C), weight (padded V, C), targets (N,) int64 with IGNORE_INDEX for ignored rows. Equal
    in value and gradients to `F.cross_entropy((x @ weight.T)[:, :vocab_size].float(), targets,
    ignore_index=-1)` (the matmuls in the same dtype, e.g. bf16 under autocast; the softcap, when
    given, applied to those float32 logits). With gradients
    enabled the chunks' gradients are computed in forward (Liger-kernel style), so backward only
    rescales them: no recomputation, no logits kept for backward.
    """
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(x, weight, targets, vocab_size, chunk_rows, softcap)
    loss_sum, n_valid, _, _ = chunked_loss(
        x, weight, targets, vocab_size, chunk_rows, False, softcap=softcap
    )
    return loss_sum / n_valid.clamp_min(1)


def full_cross_entropy(
    x: Tensor, weight: Tensor, targets: Tensor, vocab_size: int, softcap: float = 0.0
) -> Tensor:
    """Mean cross-entropy of the full logits x @ weight.T (the first vocab_size columns), in
    float32: what linear_cross_entropy equals, holding (N, V) logits, their float32 copy and,
    in backward, their gradient. x (N, C), weight (padded V, C), targets (N,) as there."""
    logits = (x @ weight.t())[:, :vocab_size].float()  # (N, V)
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    loss = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX)
    return torch.where((targets != IGNORE_INDEX).any(), loss, 0.0)  # no counted target: 0


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, vocab_size, chunk_rows, softcap):
        loss_sum, n_valid, grad_x, grad_w = chunked_loss(
            x, weight, targets, vocab_size, chunk_rows, True, softcap=softcap
        )
        ctx.weight_dtype = weight.dtype
        n_valid = n_valid.clamp_min(1)  # no counted target: loss 0, gradients 0
        ctx.save_for_backward(grad_x, grad_w, n_valid)
        return loss_sum / n_valid

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_w, n_valid = ctx.saved_tensors  # gradients of the loss SUM
        scale = grad_loss / n_valid  # d(mean)/d(sum) times the incoming gradient
        return (
            (grad_x * scale).to(grad_x.dtype),
            (grad_w * scale).to(ctx.weight_dtype),
            None,
            None,
            None,
            None,
        )


def chunked_loss(
    x, weight, targets, vocab_size, chunk_rows, with_grads, row_losses=None, softcap=0.0
):
    """(sum of the per-row losses, number of counted rows, d sum/dx, d sum/dweight) chunk by chunk;
    with `row_losses` (N,), each row's loss is also written there (0 for ignored rows).

    The gradients are of the loss SUM (softmax - one-hot, without the 1/N of the mean): their
    matmul inputs are in [-1, 1], not [-1/N, 1/N], so float16 (which has no GradScaler factor
    here) keeps them as well as it keeps the plain path's scaled gradients; the caller scales.
    With a softcap the logits are capped in float32 before the padded columns are masked, and
    the gradient takes the cap's derivative 1 - tanh^2 (kept from before the masking: a second
    chunk-sized buffer, only then).
    """
    N, padded_vocab = x.size(0), weight.size(0)
    acc = torch.promote_types(weight.dtype, torch.float32)  # float32 (float64 stays float64)
    keep_all = targets != IGNORE_INDEX  # (N,)
    n_valid = keep_all.sum()
    loss_sum = torch.zeros((), dtype=acc, device=x.device)
    grad_x = torch.empty_like(x) if with_grads else None  # (N, C)
    grad_w = torch.zeros(weight.shape, dtype=acc, device=x.device) if with_grads else None
    for start in range(0, N, chunk_rows):
        rows = slice(start, start + chunk_rows)
        x_c, t_c, keep = x[rows], targets[rows], keep_all[rows]  # (n, C), (n,), (n,)
        logits = (x_c @ weight.t()).to(acc)  # (n, padded V)
        dcap = None
        if softcap:
            tanh = logits.div_(softcap).tanh_()  # in place: (n, padded V)
            logits = tanh * softcap
            dcap = tanh.square_().neg_().add_(1.0) if with_grads else None  # 1 - tanh^2
        if padded_vocab > vocab_size:
            logits[:, vocab_size:] = float("-inf")  # padded ids: probability 0
        safe = torch.where(keep, t_c, 0)  # ignored rows read column 0 (then masked); ids >= V raise
        lse = torch.logsumexp(logits, dim=1)  # (n,)
        target_logit = logits[:, :vocab_size].gather(1, safe[:, None]).squeeze(1)  # (n,)
        row_loss = torch.where(keep, lse - target_logit, 0.0)  # (n,)
        loss_sum = loss_sum + row_loss.sum()
        if row_losses is not None:
            row_losses[rows] = row_loss
        if with_grads:
            grad = logits.sub_(lse[:, None]).exp_()  # softmax, in place: (n, padded V)
            grad.scatter_add_(1, safe[:, None], torch.full_like(lse[:, None], -1.0))
            grad.mul_(keep[:, None])  # ignored rows contribute nothing
            if dcap is not None:
                grad.mul_(dcap)  # through the cap (padded columns: 0 * finite)
            grad = grad.to(weight.dtype)
            grad_x[rows] = grad @ weight  # (n, C)
            grad_w += grad.t() @ x_c  # (padded V, C), accumulated in float32
    return loss_sum, n_valid, grad_x, grad_w

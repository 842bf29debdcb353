"""Causal self-attention as explicit matmuls with a hand-written backward: `train.attention =
matmul` (auto picks it where it measured faster on the run's shapes, see
training/choices.py). Imports only torch; the model (gpt.py) calls it in place of
scaled_dot_product_attention."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def matmul_attention(
    q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, block: int = 64
) -> Tensor:
    """Causal attention as explicit matmuls: the same function as
    scaled_dot_product_attention(is_causal=True), the result in v's dtype. Queries go in blocks
    of `block` rows, each against the keys up to its last row only (~T^2/2 work); every block's
    probabilities are kept for backward, in float32 and as the bf16 copy multiplied with V
    (6 bytes per score, B * nh * ~T^2/2 scores: meant for short windows).

    Precision, with q, k, v in bf16/fp16 (as under autocast): the products whose inputs and
    outputs are low-precision anyway run in that dtype (P @ V; in backward P^T @ dO, dS @ K and
    dS^T @ Q); the two whose rounded outputs would lose accuracy run in float32: the scores
    S = Q K^T (rounded before the softmax they shift the probabilities) and dP = dO V^T, and the
    softmax backward dS = P * (dP - rowsum(P * dP)) is float32 throughout. Against float64, on a
    trained model's real activations, the output error is within 1.25x of SDPA's CPU flash
    kernel's and the q and k gradients are 2-5x closer (SDPA's rowsum uses its rounded output);
    with every product in bf16 they are 2-4x further off (tests/test_attention.py).
    In float32 everything is float32."""
    return _CausalAttention.apply(q, k, v, dropout_p, block)


def _blocks(T: int, block: int) -> list[tuple[int, int]]:
    """The query blocks (start, end): rows start..end-1 see keys 0..end-1."""
    return [(s, min(s + block, T)) for s in range(0, T, block)]


class _CausalAttention(torch.autograd.Function):
    """matmul_attention's computation, on (B * nh, T, hs) contiguous copies: q, k, v arrive as
    strided views of c_attn's output, and every matmul on such a view would copy it again. The
    output and the input gradients are written straight into the (B, T, nh, hs) layout that
    c_proj reads and c_attn's gradient has (returned as (B, nh, T, hs) views of it), so the
    model's transpose + reshape on either side copies nothing."""

    @staticmethod
    def forward(ctx, q, k, v, dropout_p: float, block: int):
        B, nh, T, hs = q.shape
        dtype, scale = v.dtype, 1.0 / math.sqrt(hs)
        acc = torch.promote_types(dtype, torch.float32)  # float32 (float64 stays float64)
        q, k, v = (t.contiguous().view(B * nh, T, hs) for t in (q, k, v))  # (B*nh, T, hs)
        o = torch.empty(B, T, nh, hs, dtype=dtype, device=q.device)  # c_proj's layout
        saved = []
        with torch.autocast(q.device.type, enabled=False):  # the dtypes below are deliberate
            q_acc = q.to(acc, copy=True).mul_(scale)  # the scale folded into q
            k_acc = k.to(acc).transpose(1, 2)  # (B*nh, hs, T)
            # -inf above the diagonal: added to each block's diagonal square only
            future = torch.full((block, block), float("-inf"), dtype=acc, device=q.device).triu_(1)
            for start, end in _blocks(T, block):
                n = end - start
                s = torch.bmm(q_acc[:, start:end], k_acc[..., :end])  # (B*nh, n, end)
                s[..., start:].add_(future[:n, :n])
                p = s.softmax(dim=-1)  # (B*nh, n, end) in acc
                if dropout_p:
                    keep = torch.rand_like(p) >= dropout_p  # (B*nh, n, end) bool
                    pd = (p * keep / (1.0 - dropout_p)).to(dtype)
                    saved += [p, pd, keep]
                else:
                    pd = p.to(dtype)
                    saved += [p, pd]  # P in acc, and as multiplied with V
                pv = torch.bmm(pd, v[:, :end])  # (B*nh, n, hs)
                o[:, start:end] = pv.view(B, nh, n, hs).transpose(1, 2)
        ctx.save_for_backward(q, k, v, *saved)
        ctx.dropout_p, ctx.block, ctx.scale, ctx.shape = dropout_p, block, scale, (B, nh, T, hs)
        return o.transpose(1, 2)  # (B, nh, T, hs)

    @staticmethod
    def backward(ctx, do):
        q, k, v, *saved = ctx.saved_tensors  # (B*nh, T, hs) each
        drop, dtype, (B, nh, T, hs), scale = ctx.dropout_p, v.dtype, ctx.shape, ctx.scale
        per = 3 if drop else 2  # saved tensors per query block
        acc = torch.promote_types(dtype, torch.float32)
        do = do.to(dtype).contiguous().view(q.shape)  # (B*nh, T, hs)
        grads = torch.empty(3, B, T, nh, hs, dtype=dtype, device=q.device)  # dq, dk, dv
        dk = dv = None  # (B*nh, T, hs), from the last block (which sees every key) down
        with torch.autocast(q.device.type, enabled=False):
            do_acc = do.to(acc)
            v_acc_t = v.to(acc).transpose(1, 2)  # (B*nh, hs, T)
            for i, (start, end) in reversed(list(enumerate(_blocks(T, ctx.block)))):
                n = end - start
                p, pd = saved[per * i], saved[per * i + 1]  # (B*nh, n, end)
                # dV and dK sum over the query blocks inside the matmuls (accumulating in float32
                # there, one rounding per block)
                if dv is None:
                    dv = torch.bmm(pd.transpose(1, 2), do[:, start:end])
                else:
                    dv[:, :end].baddbmm_(pd.transpose(1, 2), do[:, start:end])
                dp = torch.bmm(do_acc[:, start:end], v_acc_t[..., :end])  # (B*nh, n, end)
                # softmax backward, in acc: dS = P * dP - P * rowsum(P * dP), where dropout
                # multiplies dP by its mask and 1 / (1 - dropout_p)
                ds = dp.mul_(p * saved[per * i + 2] / (1.0 - drop) if drop else p)
                ds = ds.addcmul_(p, ds.sum(-1, keepdim=True), value=-1).to(dtype)
                dq = torch.bmm(ds, k[:, :end]).mul_(scale)  # S = scale * q k^T
                grads[0, :, start:end] = dq.view(B, nh, n, hs).transpose(1, 2)
                if dk is None:
                    dk = torch.bmm(ds.transpose(1, 2), q[:, start:end])
                else:
                    dk[:, :end].baddbmm_(ds.transpose(1, 2), q[:, start:end])
        grads[1].transpose(1, 2).copy_(dk.mul_(scale).view(B, nh, T, hs))
        grads[2].transpose(1, 2).copy_(dv.view(B, nh, T, hs))
        return (*(g.transpose(1, 2) for g in grads), None, None)  # (B, nh, T, hs) views

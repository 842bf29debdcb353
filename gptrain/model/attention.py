"""Causal self-attention as explicit matmuls with a hand-written backward: `train.attention =
matmul` (auto picks it where it measured faster on the run's shapes, see
training/choices.py). Imports only torch; the model (gpt.py) calls it in place of
scaled_dot_product_attention."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def matmul_attention(
    q: Tensor, k: Tensor, v: Tensor, dropout_p: float = 0.0, block: int = 128
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
    with every product in bf16 they are 2-4x further off (README, issue 11; tests/test_model.py).
    In float32 everything is float32."""
    return _CausalAttention.apply(q, k, v, dropout_p, block)


class _CausalAttention(torch.autograd.Function):
    """matmul_attention's computation, on (B * nh, T, hs) contiguous copies: q, k, v arrive as
    strided views of c_attn's output, and every matmul on such a view would copy it again."""

    @staticmethod
    def forward(ctx, q, k, v, dropout_p: float, block: int):
        B, nh, T, hs = q.shape
        dtype, scale = v.dtype, 1.0 / math.sqrt(hs)
        acc = torch.promote_types(dtype, torch.float32)  # float32 (float64 stays float64)
        q, k, v = (t.contiguous().view(B * nh, T, hs) for t in (q, k, v))  # (B*nh, T, hs)
        outs, saved = [], []
        with torch.autocast(q.device.type, enabled=False):  # the dtypes below are deliberate
            q_acc = q.to(acc) * scale  # the scale folded into q
            k_acc = k.to(acc).transpose(1, 2)  # (B*nh, hs, T)
            for start in range(0, T, block):
                end = min(start + block, T)  # rows start..end-1 see keys 0..end-1
                mask = torch.full((end - start, end), float("-inf"), dtype=acc, device=q.device)
                s = torch.baddbmm(
                    mask.triu_(start + 1), q_acc[:, start:end], k_acc[..., :end]
                )  # + q k^T
                p = s.softmax(dim=-1)  # (B*nh, n, end) in acc
                if dropout_p:
                    keep = torch.rand_like(p) >= dropout_p  # (B*nh, n, end) bool
                    pd = (p * keep / (1.0 - dropout_p)).to(dtype)
                    saved += [p, pd, keep]
                else:
                    pd = p.to(dtype)
                    saved += [p, pd]  # P in acc, and as multiplied with V
                outs.append(torch.bmm(pd, v[:, :end]))  # (B*nh, n, hs)
        o = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)  # (B*nh, T, hs)
        ctx.save_for_backward(q, k, v, *saved)
        ctx.dropout_p, ctx.block, ctx.scale, ctx.shape = dropout_p, block, scale, (B, nh, T, hs)
        return o.view(B, nh, T, hs)

    @staticmethod
    def backward(ctx, do):
        q, k, v, *saved = ctx.saved_tensors  # (B*nh, T, hs) each
        drop, dtype, shape, T = ctx.dropout_p, v.dtype, ctx.shape, q.size(1)
        per = 3 if drop else 2  # saved tensors per query block
        acc = torch.promote_types(dtype, torch.float32)
        do = do.to(dtype).contiguous().view(q.shape)  # (B*nh, T, hs)
        dq = torch.empty_like(q)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)  # summed over query blocks
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        with torch.autocast(q.device.type, enabled=False):
            do_acc = do.to(acc)
            v_acc_t = v.to(acc).transpose(1, 2)  # (B*nh, hs, T)
            for i, start in enumerate(range(0, T, ctx.block)):
                end = min(start + ctx.block, T)
                p, pd = saved[per * i], saved[per * i + 1]  # (B*nh, n, end)
                dv[:, :end] += torch.bmm(pd.transpose(1, 2), do[:, start:end])
                dp = torch.bmm(do_acc[:, start:end], v_acc_t[..., :end])  # (B*nh, n, end)
                # softmax backward, in acc: dS = P * dP - P * rowsum(P * dP), where dropout
                # multiplies dP by its mask and 1 / (1 - dropout_p)
                ds = dp.mul_(p * saved[per * i + 2] / (1.0 - drop) if drop else p)
                ds = ds.addcmul_(p, ds.sum(-1, keepdim=True), value=-1).to(dtype)
                dq[:, start:end] = torch.bmm(ds, k[:, :end])
                dk[:, :end] += torch.bmm(ds.transpose(1, 2), q[:, start:end])
        scale = ctx.scale  # S = scale * q k^T
        grads = (dq.mul_(scale), (dk * scale).to(dtype), dv.to(dtype))
        return (*(g.view(shape) for g in grads), None, None)

"""The chunked loss: the same value and gradients as cross-entropy over the full float32 logits,
without ever holding them (checked by watching every tensor the step creates and saves)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from gptrain.model.gpt import GPT, GPTConfig
from gptrain.model.losses import linear_cross_entropy


def make(vocab_size: int = 100, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=vocab_size, block_size=16, n_layer=2, n_head=2, n_embd=32)
    return GPT(cfg)  # vocab 100 -> a padded table of 128 rows


def plain_loss(model: GPT, idx, targets):
    """Today's reference: the full (B, T, V) float32 logits, then F.cross_entropy."""
    logits, _ = model(idx)  # (B, T, V) float32
    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def batch(vocab_size: int = 100, B: int = 3, T: int = 16):
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, vocab_size, (B, T), generator=g)
    targets = torch.randint(0, vocab_size, (B, T), generator=g)
    targets[0, :5] = -1  # ignored positions
    targets[2, -1] = -1
    return idx, targets


def loss_and_grads(model, fn):
    model.zero_grad(set_to_none=True)
    loss = fn()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("chunk_rows", [1, 7, 48, None])  # one row, uneven, one chunk, default
def test_float32_loss_and_every_gradient_equal_plain_cross_entropy(chunk_rows):
    model = make()
    model.loss_chunk_rows = chunk_rows
    idx, targets = batch()
    ref_loss, ref = loss_and_grads(model, lambda: plain_loss(model, idx, targets))
    loss, got = loss_and_grads(model, lambda: model(idx, targets)[1])
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name, g in ref.items():  # incl. the tied wte/lm_head matrix and its padded rows (zero)
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-7, msg=name)


def test_padded_rows_get_no_head_gradient_and_no_probability():
    model = make()
    idx, targets = batch()
    with torch.no_grad():
        model.transformer.wte.weight[100:] = 5.0  # padded ids would dominate a softmax over 128
    model.loss_chunk_rows = 5
    ref_loss, ref = loss_and_grads(model, lambda: plain_loss(model, idx, targets))
    loss, got = loss_and_grads(model, lambda: model(idx, targets)[1])
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    w = got["transformer.wte.weight"]
    torch.testing.assert_close(w, ref["transformer.wte.weight"], rtol=1e-5, atol=1e-7)
    assert torch.equal(w[100:], torch.zeros_like(w[100:]))


def test_bf16_autocast_matches_plain_computation_under_autocast():
    model = make()
    model.loss_chunk_rows = 7
    idx, targets = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, ref = loss_and_grads(model, lambda: plain_loss(model, idx, targets))
        loss, got = loss_and_grads(model, lambda: model(idx, targets)[1])
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss, rtol=1e-3, atol=1e-3)
    for name, g in ref.items():
        scale = g.abs().max().item()
        torch.testing.assert_close(got[name], g, rtol=2e-2, atol=2e-2 * scale, msg=name)


def test_no_grad_path_gives_the_same_loss():
    model = make()
    idx, targets = batch()
    _, loss = model(idx, targets)
    with torch.no_grad():
        _, loss_eval = model(idx, targets)
    torch.testing.assert_close(loss_eval, loss.detach(), rtol=0, atol=0)


def test_functional_form_matches_cross_entropy_and_scales_incoming_gradient():
    torch.manual_seed(0)
    x = torch.randn(10, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(64, 8, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, 50, (10,))
    t[3] = -1
    ref = F.cross_entropy((x @ w.t())[:, :50], t, ignore_index=-1)
    (3.0 * ref).backward()  # a non-unit incoming gradient, like 1/accum or a GradScaler
    ref_grads = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    loss = linear_cross_entropy(x, w, t, vocab_size=50, chunk_rows=3)
    (3.0 * loss).backward()
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, ref_grads[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w.grad, ref_grads[1], rtol=1e-12, atol=1e-12)


class _Largest(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _step_footprint(model, idx, targets, use_plain: bool) -> tuple[int, int]:
    """(largest tensor created in forward + backward, largest tensor saved for backward)."""
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with _Largest() as mode, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = plain_loss(model, idx, targets) if use_plain else model(idx, targets)[1]
        loss.backward()
    return mode.largest, max(saved)


def test_full_logits_never_exist_only_one_chunk():
    """B*T = 96 rows, vocab 1000 (padded 1024), width 32, chunks of 8 rows: the full logits have
    96 x 1000 elements; the chunked step must never create or save anything that large."""
    model = make(vocab_size=1000)
    model.loss_chunk_rows = 8
    B, T = 6, 16
    idx, targets = batch(vocab_size=1000, B=B, T=T)
    full_logits = B * T * 1000
    largest, largest_saved = _step_footprint(model, idx, targets, use_plain=False)
    allowed = max(8 * 1024, model.lm_head.weight.numel(), B * T * 4 * 32)  # chunk, head, MLP
    assert largest <= allowed < full_logits, (largest, allowed, full_logits)
    assert largest_saved < full_logits
    # the same probe sees the full logits in the plain computation (so it can fail)
    largest_plain, saved_plain = _step_footprint(copy.deepcopy(model), idx, targets, True)
    assert largest_plain >= full_logits and saved_plain >= full_logits


def test_compiled_loss_and_gradients_match_eager():
    model = make()
    model.loss_chunk_rows = 7
    idx, targets = batch()
    ref_loss, ref = loss_and_grads(model, lambda: model(idx, targets)[1])
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)  # no graph breaks
    loss, got = loss_and_grads(model, lambda: compiled(idx, targets)[1])
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name, g in ref.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("chunk_rows", [1, 7, None])
def test_per_token_losses_equal_plain_cross_entropy_without_reduction(chunk_rows):
    """reduction="none" (HellaSwag scoring): each position's loss, 0 where the target is ignored,
    equal to F.cross_entropy over the full float32 logits; their masked mean is the usual loss."""
    model = make()
    model.loss_chunk_rows = chunk_rows
    idx, targets = batch()
    with torch.no_grad():
        logits, _ = model(idx)  # (B, T, V)
        ref = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=-1, reduction="none")
        _, per_token = model(idx, targets, reduction="none")
        _, mean = model(idx, targets)
    assert per_token.shape == targets.shape and per_token.dtype == torch.float32
    torch.testing.assert_close(per_token, ref, rtol=1e-6, atol=1e-6)
    assert torch.all(per_token[targets == -1] == 0)
    torch.testing.assert_close(per_token.sum() / (targets != -1).sum(), mean)


def test_a_compiled_loss_takes_at_most_max_compiled_chunks(monkeypatch):
    """torch.compile unrolls the chunk loop (its compile time grows with the chunks): while it
    traces, the rows per chunk grow so that there are at most MAX_COMPILED_CHUNKS. Counted in the
    graph torch.compile hands its backend (one logsumexp per chunk), and the compiled loss and
    gradients still equal eager's 48 one-row chunks."""
    from gptrain.model import losses

    assert losses.chunk_rows(65536, 50304) == 667  # GPT-2's vocabulary: 128 MiB float32 logits
    model = make()
    model.loss_chunk_rows = 1  # eager: 48 chunks of one row
    idx, targets = batch()
    ref_loss, ref = loss_and_grads(model, lambda: model(idx, targets)[1])

    def chunks_in_graph() -> tuple[int, torch.Tensor, dict]:
        seen = []

        def backend(gm, example_inputs):  # the traced graph, run as it is
            graphs = [m.graph for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]
            seen.append(sum(n.target is torch.logsumexp for g in graphs for n in g.nodes))
            return gm.forward

        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend, fullgraph=True)
        loss, grads = loss_and_grads(model, lambda: compiled(idx, targets)[1])
        return seen[0], loss, grads

    n, loss, got = chunks_in_graph()
    assert n == losses.MAX_COMPILED_CHUNKS == 8
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name, g in ref.items():
        torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-7, msg=name)
    monkeypatch.setattr(losses, "MAX_COMPILED_CHUNKS", 1000)  # no cap: the loop unrolled whole
    assert chunks_in_graph()[0] == 48
    torch._dynamo.reset()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_full_path_gives_plain_cross_entropy_like_the_chunked_one(dtype):
    """set_loss("full") (train.loss = full: the full logits, then F.cross_entropy) and the chunked
    path both give F.cross_entropy's loss and every gradient on the full float32 logits, in
    float32 and under bf16 autocast (bf16's tolerance there); only the full path holds the full
    logits (so set_loss really switches)."""
    model = make(vocab_size=1000)
    model.loss_chunk_rows = 8
    idx, targets = batch(vocab_size=1000, B=6)
    on = dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=on):
        ref_loss, ref = loss_and_grads(model, lambda: plain_loss(model, idx, targets))
        got = {}
        for path in ("full", "chunked"):
            model.set_loss(path)
            got[path] = loss_and_grads(model, lambda: model(idx, targets)[1])
    for loss, grads in got.values():
        assert loss.dtype == torch.float32
        torch.testing.assert_close(loss, ref_loss, rtol=1e-3 if on else 1e-6, atol=1e-3 if on else 1e-6)  # fmt: skip
        for name, g in ref.items():
            atol = 2e-2 * g.abs().max().item() if on else 1e-7
            torch.testing.assert_close(grads[name], g, rtol=2e-2 if on else 1e-5, atol=atol, msg=name)  # fmt: skip
    full_logits = 6 * 16 * 1000
    for path, holds in (("full", True), ("chunked", False)):
        model.set_loss(path)
        assert (_step_footprint(model, idx, targets, use_plain=False)[0] >= full_logits) == holds
    with pytest.raises(ValueError, match="chunked or full"):
        model.set_loss("fused")


def _softcap_reference(x, w, t, vocab, cap):
    """The plain computation: full float logits, the real columns, capped, cross-entropy."""
    logits = (x @ w.t())[:, :vocab]
    return F.cross_entropy(cap * torch.tanh(logits / cap), t, ignore_index=-1, reduction="none")


@pytest.mark.parametrize("chunk_rows", [1, 3, 10])
def test_softcap_loss_and_gradients_equal_the_capped_cross_entropy(chunk_rows):
    """softcap: chunked and full losses, their gradients (through 1 - tanh^2) and the per-row
    losses equal cross-entropy over cap * tanh(logits / cap) of the real columns, in float64.
    The padded rows are made large: capped before masking they would get probability."""
    from gptrain.model.losses import chunked_loss, full_cross_entropy

    torch.manual_seed(0)
    cap, vocab = 3.0, 50
    x = torch.randn(10, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(64, 8, dtype=torch.float64)
    w[vocab:] = 10.0  # padded rows: logits far above the cap
    w.requires_grad_()
    t = torch.randint(0, vocab, (10,))
    t[3] = -1
    rows = _softcap_reference(x, w, t, vocab, cap)
    ref = rows.sum() / 9
    (3.0 * ref).backward()
    ref_grads = x.grad.clone(), w.grad.clone()
    assert torch.all(ref_grads[1][vocab:] == 0)
    for loss_fn, tol in (  # the full path computes its logits in float32 by design
        (lambda: linear_cross_entropy(x, w, t, vocab, chunk_rows, softcap=cap), 1e-12),
        (lambda: full_cross_entropy(x, w, t, vocab, softcap=cap), 1e-5),
    ):
        x.grad = w.grad = None
        loss = loss_fn()
        (3.0 * loss).backward()
        torch.testing.assert_close(loss.double(), ref, rtol=tol, atol=tol)
        torch.testing.assert_close(x.grad, ref_grads[0], rtol=tol, atol=tol)
        torch.testing.assert_close(w.grad, ref_grads[1], rtol=tol, atol=tol)
    per_row = torch.zeros(10, dtype=torch.float64)
    with torch.no_grad():
        chunked_loss(x, w, t, vocab, chunk_rows, False, per_row, softcap=cap)
        torch.testing.assert_close(per_row, rows, rtol=1e-12, atol=1e-12)
        uncapped = linear_cross_entropy(x, w, t, vocab, chunk_rows)
    assert not torch.allclose(uncapped, ref)  # the cap changes the loss: the test can fail

"""A step whose micro-batches leave out different numbers of targets (IGNORE_INDEX) takes the
gradient of the mean loss per counted target of the whole batch, on 1 process, 2 DDP ranks and 2
FSDP2 ranks alike; the reference is torch's own F.cross_entropy over the whole batch at once, on
the model's full logits. A step of full windows keeps its numbers bit for bit (weights exactly 1).
"""

from __future__ import annotations

import dist_helpers as h
import masked_worker as worker
import pytest
import torch
import torch.nn.functional as F

from gptrain.config.load import load_config
from gptrain.distributed.runtime import DistInfo
from gptrain.training.build import build_training
from gptrain.training.step import target_weights


def reference() -> tuple[dict, float]:
    """({name: gradient}, loss) of F.cross_entropy over all four micro-batches at once."""
    cfg = load_config(worker.DEBUG, ["train.dtype=float32"])
    model = build_training(cfg, DistInfo(), worker.VOCAB, "float32", False)[0]
    x, y = (torch.cat(t) for t in zip(*worker.global_batch(), strict=True))
    logits, _ = model(x)  # (B, T, V): the output head without gptrain's losses
    loss = F.cross_entropy(logits.reshape(-1, worker.VOCAB), y.reshape(-1), ignore_index=-1)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}, loss.item()


def assert_equal_to_reference(grads: dict, loss: float, ref: tuple[dict, float]) -> None:
    ref_grads, ref_loss = ref
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_target_weights_by_hand():
    full = torch.zeros(2, 8, dtype=torch.int64)
    assert torch.equal(target_weights([full] * 3), torch.ones(3))  # exactly 1: numbers unchanged
    ys = []
    for counted in (8, 2, 0, 5):
        y = torch.zeros(1, 8, dtype=torch.int64)
        y[:, counted:] = -1
        ys.append(y)
    expected = torch.tensor([8, 2, 0, 5]) * 4 / 15  # count x accum / total
    torch.testing.assert_close(target_weights(ys), expected.float(), rtol=0, atol=0)


@pytest.mark.parametrize("loss", ["full", "chunked"])
def test_one_process_step_is_the_mean_per_counted_target(loss):
    grads, logged = worker.step(DistInfo(), f"train.loss={loss}")
    assert_equal_to_reference(grads, logged, reference())


def test_ddp_and_fsdp_steps_equal_the_mean_per_counted_target(tmp_path):
    """Rank 0 counts 64 + 16 targets per row, rank 1 0 + 61: the ranks' own means would weight
    each of rank 1's targets 1.3x as much as each of rank 0's."""
    out = tmp_path / "result"
    for mode in ("ddp", "fsdp"):
        h.check_ok(h.wait_all(h.spawn(["tests/masked_worker.py", str(out), mode]), h.TIMEOUT))
    ref = reference()
    for mode in ("ddp", "fsdp"):
        saved = torch.load(f"{out}.{mode}.pt")
        assert_equal_to_reference(saved["grads"], saved["loss"], ref)

"""train.micro_split = halves (training/halves.py): the two row halves of each micro-batch on two
threads give the one-pass gradients up to rounding, bit-identical from run to run; a half with no
counted target falls back to one pass; a worker's error reaches the caller; where halves cannot
run, one line and exit 2."""

import json
import math
import shutil

import pytest
import torch
from train_helpers import DEBUG, assert_same_training, comparable, run, weights

from gptrain.__main__ import main as cli
from gptrain.model.gpt import GPT, GPTConfig
from gptrain.model.losses import IGNORE_INDEX
from gptrain.training.halves import Halves, ineligible
from gptrain.training.step import train_step


@pytest.fixture
def two_threads():
    """Halves share out the intra-op threads: give torch two, as on the 2-core CI machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=65, block_size=32, n_layer=2, n_head=2, n_embd=32, bias=True)
    return GPT(cfg)


def _batches(n, rows=6, seed=1):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = torch.randint(0, 65, (rows, 33), generator=gen)
        out.append((t[:, :-1], t[:, 1:].clone()))
    return out


def _grads(model, batches, halves, accum):
    """One train_step's gradients (taken before the optimizer step) and its loss."""
    params = [p for p in model.parameters()]
    opt = torch.optim.SGD(params, lr=0.0)  # lr 0: the step leaves the weights alone
    seen = iter(batches)
    captured = {}

    def grab(optimizer, *args, **kwargs):
        captured["grads"] = [p.grad.clone() for p in params]

    opt.register_step_pre_hook(grab)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    loss, _ = train_step(model, model, opt, scaler, lambda: next(seen), accum, torch.autocast("cpu", enabled=False), 0.0, halves=halves)  # fmt: skip
    return captured["grads"], loss


def test_halves_give_the_one_pass_gradients_and_the_same_bits_every_time(two_threads):
    batches = _batches(3)
    want, want_loss = _grads(_model(), batches, None, accum=3)
    got, got_loss = _grads(_model(), batches, Halves(), accum=3)
    again, again_loss = _grads(_model(), batches, Halves(), accum=3)
    for w, g, a in zip(want, got, again, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)  # float32 rounding only
        assert torch.equal(g, a)  # the worker's half is always added second
    assert got_loss.item() == pytest.approx(want_loss.item(), rel=1e-6)
    assert torch.equal(got_loss, again_loss)
    # the halves really were used: a worker thread exists and gradients differ in the last bits
    assert any(not torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_ignored_targets_weight_each_half_by_its_counted_targets(two_threads):
    ((x, y),) = _batches(1, rows=4)
    y[0, :20] = IGNORE_INDEX  # the first half counts 44 targets, the second 64
    want, want_loss = _grads(_model(), [(x, y)], None, accum=1)
    got, got_loss = _grads(_model(), [(x, y)], Halves(), accum=1)
    assert got_loss.item() == pytest.approx(want_loss.item(), rel=1e-6)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)
    # a half without a counted target: its mean would be 0/0, so the micro-batch runs whole
    y[:2] = IGNORE_INDEX
    model = _model()
    params = list(model.parameters())
    assert Halves().micro_step(model, params, x, y, torch.autocast("cpu", enabled=False), 1) is None
    assert all(p.grad is None for p in params)  # nothing was run
    want, want_loss = _grads(_model(), [(x, y)], None, accum=1)
    got, got_loss = _grads(_model(), [(x, y)], Halves(), accum=1)
    assert torch.equal(got_loss, want_loss) and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))  # fmt: skip


def test_an_error_in_the_workers_half_reaches_the_caller_and_the_halves_go_on(two_threads):
    model, halves = _model(), Halves()
    params = list(model.parameters())
    off = torch.autocast("cpu", enabled=False)
    ((x, y),) = _batches(1, rows=4)
    bad = y.clone()
    bad[3, 0] = 70  # a target id outside the 65-token vocabulary, in the worker's half
    with pytest.raises((IndexError, RuntimeError)):
        halves.micro_step(model, params, x, bad, off, 1)
    model.zero_grad(set_to_none=True)
    halves._done.put((0, RuntimeError("a result an interrupted call left")))
    loss = halves.micro_step(model, params, x, y, off, 1)  # no deadlock, no stale result
    assert loss is not None and math.isfinite(loss.item()) and torch.get_num_threads() == 2


def test_where_halves_cannot_run():
    ok = dict(device_type="cpu", world_size=1, compile=False, dropout=0.0, activation_checkpointing="none", micro_batch=8, threads=2)  # fmt: skip
    assert ineligible(**ok) is None
    for change, why in [
        (dict(device_type="cuda"), "GPU"),
        (dict(world_size=2), "more than one process"),
        (dict(compile=True), "train.compile"),
        (dict(dropout=0.1), "model.dropout"),
        (dict(activation_checkpointing="blocks"), "activation_checkpointing"),
        (dict(threads=1), "1 intra-op thread"),
        (dict(micro_batch=1), "micro-batch is 1"),
    ]:
        assert why in ineligible(**{**ok, **change})


def test_halves_where_they_cannot_run_is_one_line_and_writes_nothing(byte_data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = ["train", "--config", DEBUG, f"--data.dir={byte_data}", f"--run.dir={run_dir}", "--train.micro_split=halves", "--model.dropout=0.1"]  # fmt: skip
    assert cli(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.micro_split = 'halves' but model.dropout > 0" in err[0], err
    assert "train.micro_split=none" in err[0] and "Traceback" not in err[0]
    assert not (run_dir / "checkpoints").exists()


def test_a_run_in_halves_trains_like_one_pass_repeats_and_resumes_bit_for_bit(byte_data, tmp_path, two_threads):  # fmt: skip
    common = ["train.max_steps=6", "eval.every=0", "checkpoint.every=3", "eval.sample_every=0", "eval.tokens=512"]  # fmt: skip
    for name, split in (("one", "none"), ("halves", "halves"), ("again", "halves")):
        run(byte_data, tmp_path / name, f"train.micro_split={split}", *common)
    one, halves, again = (weights(tmp_path / n) for n in ("one", "halves", "again"))
    assert (
        "accumulation 2 (each micro-batch in halves on two threads)"
        in (tmp_path / "halves" / "train.log").read_text()
    )
    assert all(torch.equal(halves[k], again[k]) for k in halves)
    assert_same_training(comparable(halves), comparable(one), "halves against one pass", 6 * 3e-3)
    logged = [json.loads(r) for r in (tmp_path / "halves" / "metrics.jsonl").read_text().splitlines()]  # fmt: skip
    want = [json.loads(r) for r in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    got = [r["loss"] for r in logged if "loss" in r]
    assert len(got) >= 1 and got == pytest.approx([r["loss"] for r in want if "loss" in r], rel=1e-5)  # fmt: skip
    # stopped after step 3's save, resumed: steps 4-6 in halves give the uninterrupted weights
    shutil.rmtree(tmp_path / "again" / "checkpoints" / "step_00000006")
    (tmp_path / "again" / "checkpoints" / "latest").write_text("step_00000003")
    run(byte_data, tmp_path / "again", "train.micro_split=halves", *common, "checkpoint.resume=3")
    resumed = weights(tmp_path / "again")
    assert all(torch.equal(resumed[k], halves[k]) for k in halves)

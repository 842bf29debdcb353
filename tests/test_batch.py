"""Batch geometry: micro_batch_size = N | auto, its config forms and errors, the out-of-memory
search every rank agrees on, and the trial step leaving training untouched."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from gptrain.__main__ import main as cli
from gptrain.config.load import load_config, to_toml
from gptrain.config.sections import DistConfig, TrainConfig
from gptrain.distributed import parallelize, runtime
from gptrain.distributed.runtime import DistInfo
from gptrain.errors import UserError
from gptrain.model.gpt import GPT, GPTConfig
from gptrain.training import batch


def train_cfg(*overrides):
    return load_config(None, list(overrides)).train


def test_auto_in_toml_and_on_the_cli_and_integers_still_work(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[train]\nmicro_batch_size = "auto"\n')
    assert load_config(str(f)).train.micro_batch_size == "auto"
    f.write_text("[train]\nmicro_batch_size = 8\n")
    assert load_config(str(f)).train.micro_batch_size == 8
    assert train_cfg("train.micro_batch_size=auto").micro_batch_size == "auto"
    assert train_cfg("train.micro_batch_size=12").micro_batch_size == 12
    cfg = load_config(None, ["train.micro_batch_size=auto"])
    again = tmp_path / "again.toml"
    again.write_text(to_toml(cfg))  # the saved config round-trips
    assert load_config(str(again)) == cfg


@pytest.mark.parametrize(
    "text, overrides, needle",
    [
        (
            '[train]\nmicro_batch_size = "big"\n',
            [],
            "train.micro_batch_size = 'big' in the config file must be a whole number or \"auto\"",
        ),  # fmt: skip
        ("[train]\nmicro_batch_size = 2.5\n", [], "train.micro_batch_size = 2.5"),
        ("[train]\nmicro_batch_size = true\n", [], "train.micro_batch_size = True"),
        (
            "",
            ["train.micro_batch_size=big"],
            "--train.micro_batch_size='big' is not a whole number or auto",
        ),  # fmt: skip
        ("", ["train.micro_batch_size=0"], "train.micro_batch_size = 0 must be >= 1 or auto"),
        ("", ["train.micro_batch_cap=0"], "train.micro_batch_cap = 0 must be >= 1"),
        (
            "",
            ["dist.mode=fsdp", "train.dtype=float16"],
            "dist.mode = 'fsdp' with train.dtype = 'float16'",
        ),  # fmt: skip
    ],
)
def test_bad_values_name_the_key(tmp_path, text, overrides, needle):
    path = None
    if text:
        path = tmp_path / "c.toml"
        path.write_text(text)
    with pytest.raises(UserError) as e:
        load_config(str(path) if path else None, overrides)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_float16_with_fsdp_is_refused_before_anything_is_written(tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = ["train", "--dist.mode=fsdp", "--train.dtype=float16", f"--run.dir={run_dir}"]
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gptrain: error: dist.mode = 'fsdp' with train.dtype = 'float16'")
    assert "use train.dtype=bfloat16" in err and "\n" not in err
    assert not run_dir.exists()


@pytest.mark.parametrize(
    "total, seq_len, world, cap, expected",
    [
        (524288, 1024, 8, 64, [64, 32, 16, 8, 4, 2, 1]),  # GPT-2 124M on 8 GPUs
        (524288, 1024, 16, 64, [32, 16, 8, 4, 2, 1]),  # 2 nodes x 8
        (524288, 1024, 32, 64, [16, 8, 4, 2, 1]),  # 4 nodes x 8
        (16384, 256, 8, 64, [8, 4, 2, 1]),  # default.toml on 8 GPUs
        (1024 * 48, 1024, 1, 64, [48, 24, 16, 12, 8, 6, 4, 3, 2, 1]),
        (1024 * 48, 1024, 1, 20, [16, 12, 8, 6, 4, 3, 2, 1]),  # the cap
    ],
)
def test_auto_candidates_are_the_divisors_under_the_cap(total, seq_len, world, cap, expected):
    t = train_cfg(
        "train.micro_batch_size=auto",
        f"train.total_batch_size={total}",
        f"train.seq_len={seq_len}",
        f"train.micro_batch_cap={cap}",
    )
    assert batch.candidates(t, world) == expected
    mb, accum = batch.plan(t, world)
    assert mb == expected[0] and mb * seq_len * world * accum == total


def test_plan_errors_name_the_numbers():
    t = train_cfg("train.micro_batch_size=auto", "train.total_batch_size=1000", "train.seq_len=64")
    with pytest.raises(UserError, match=r"train.total_batch_size = 1000 .* train.seq_len \(64\)"):
        batch.plan(t, 2)
    t = train_cfg("train.micro_batch_size=64", "train.total_batch_size=524288", "train.seq_len=1024")  # fmt: skip
    assert batch.plan(t, 8) == (64, 1)
    with pytest.raises(UserError, match=r"train.micro_batch_size \(64\)"):
        batch.plan(t, 16)  # an explicit number that cannot divide: the existing error


def test_fit_halves_to_a_divisor_after_out_of_memory():
    tried = []

    def fits(mb):
        tried.append(mb)
        return mb <= 5

    # 48 fails -> at most 24; 24 -> 12; 12 -> 6; 6 -> 3 fits (4 would too: halving skips it)
    assert batch.fit([48, 24, 16, 12, 8, 6, 4, 3, 2, 1], fits) == 3
    assert tried == [48, 24, 12, 6, 3]
    tried.clear()
    assert batch.fit([45, 15, 9, 5, 3, 1], fits) == 5  # odd sizes: the largest divisor <= half
    assert tried == [45, 15, 5]
    with pytest.raises(UserError, match="not even 1 sequence"):
        batch.fit([4, 2, 1], lambda mb: False)


def test_ranks_agree_on_the_smallest_fitting_size():
    """Two ranks (threads) with different memory: lockstep trials and a MIN after each; both end
    with the size that fits on the smaller one, and they try exactly the same sizes."""
    barrier, flags = threading.Barrier(2), [None, None]
    results, tried = [None, None], [[], []]
    limits = [64, 10]  # rank 1 has less memory

    def all_min(rank, flag):
        flags[rank] = flag
        barrier.wait()
        out = min(flags)
        barrier.wait()
        return out

    def worker(rank):
        def fits(mb):
            tried[rank].append(mb)
            return mb <= limits[rank]

        results[rank] = batch.fit([64, 32, 16, 8, 4, 2, 1], fits, lambda f: all_min(rank, f))

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=30)
    assert results == [8, 8] and tried[0] == tried[1] == [64, 32, 16, 8]


def linear_peak(base, fixed, slope, calls):
    """A fake FSDP2 trial: peak bytes base + fixed + slope x mb, each size recorded in `calls`."""

    def measure(mb):
        calls.append(mb)
        return base + fixed + slope * mb

    return measure


def test_fsdp_fit_measures_the_two_smallest_then_agrees_once():
    """Under FSDP2 a trial runs collectives: only the smallest two sizes are tried (never one the
    line through the first predicts too large: the smallest again instead, so every rank runs the
    same collectives), and the ranks' single MIN comes after every trial."""
    events = []
    all_min = lambda mb: events.append("all_min") or mb  # noqa: E731
    measure = linear_peak(1000, 100, 50, events)
    none = lambda mb: 0  # noqa: E731
    assert batch.fsdp_fit([8, 4, 2, 1], measure, 1000, 10_000, none, all_min) == 8
    assert events == [1, 2, "all_min"]
    events.clear()
    # one point: slope (1150 - 1000) / 1 = 150, so 2 is predicted at 1300 > 1250: not tried
    assert batch.fsdp_fit([8, 4, 2, 1], measure, 1000, 1250, none, all_min) == 1
    assert events == [1, 1, "all_min"]
    events.clear()
    assert batch.fsdp_fit([1], measure, 1000, 1250, none, all_min) == 1
    assert events == [1, "all_min"]


@pytest.mark.parametrize(
    "full, capacity, want",
    [
        (25, 1600, 8),  # 8: 1500 + 80 = 1580 fits
        (25, 1400, 2),  # 8: 1580, 4: 1300 + 180 = 1480 too much; 2: 1200 + 180 = 1380 fits
        (100, 1600, 8),  # 8 (accumulation 1): 1580 fits; 4 (accumulation 2): 1300 + 480 would not
        (100, 1700, 8),  # 8: 1580; 2: 1200 + 480 = 1680 would fit too: the largest wins
    ],
)
def test_fsdp_fit_predicts_the_peak_and_reserves_the_unsharded_grad_when_accumulating(full, capacity, want):  # fmt: skip
    """8 sequences per rank; peaks 1150 (mb 1) and 1200 (mb 2) over 1000 allocated give the line
    1100 + 50 x mb: 8 -> 1500, 4 -> 1300, 2 -> 1200, 1 -> 1150. Reserve: AdamW's 8 bytes x 10
    local parameters, plus 4 bytes x `full` parameters where accumulation (8 / mb) is > 1."""
    calls = []

    def reserve_for(mb):
        return 8 * 10 + (4 * full if 8 // mb > 1 else 0)

    measure = linear_peak(1000, 100, 50, calls)
    assert batch.fsdp_fit([8, 4, 2, 1], measure, 1000, capacity, reserve_for) == want
    assert calls == [1, 2]


def test_fsdp_fit_agrees_on_the_min_over_ranks_and_stops_every_rank_alike_on_oom():
    """After each trial the ranks agree whether it ran out of memory anywhere (`agree`, called
    once per trial on every rank, before the MIN); where it did, one line naming the trial's size
    and the ranks, and the MIN is never reached."""
    measure = linear_peak(1000, 100, 50, [])
    none = lambda mb: 0  # noqa: E731
    seen, agreed = [], []
    other_rank_fits = lambda mb: seen.append(mb) or min(mb, 2)  # noqa: E731
    everyone_fits = lambda fitted: agreed.append(fitted) or []  # noqa: E731
    assert batch.fsdp_fit([8, 4, 2, 1], measure, 1000, 10_000, none, other_rank_fits, everyone_fits) == 2  # fmt: skip
    assert seen == [8] and agreed == [True, True]  # this rank's own choice, once
    for oom_at in (1, 2):  # this rank fits, rank 1 ran out of memory in the trial of oom_at
        agreed.clear()

        def rank1(fitted, at=oom_at):
            agreed.append(fitted)
            return [1] if len(agreed) == at else []

        with pytest.raises(UserError) as e:
            batch.fsdp_fit([8, 4, 2, 1], measure, 1000, 10_000, none, other_rank_fits, rank1)
        assert str(e.value).startswith(f"train.micro_batch_size = auto: the FSDP2 trial of {oom_at} sequence(s) per process ran out of GPU memory on rank(s) 1, ")  # fmt: skip
        assert "activation checkpointing" in str(e.value) and "\n" not in str(e.value)
        assert ("a number below 2" in str(e.value)) == (oom_at == 2) and len(agreed) == oom_at
    # one process: its own out-of-memory, the same line naming rank 0
    with pytest.raises(UserError, match=r"trial of 1 sequence\(s\) per process ran out of GPU memory on rank\(s\) 0"):  # fmt: skip
        batch.fsdp_fit([8, 4, 2, 1], lambda mb: None, 1000, 10_000, none)
    assert seen == [8]
    # the reserve alone does not fit next to the smallest: every rank gets 0 and the same error
    with pytest.raises(UserError, match="not even 1 sequence"):
        batch.fsdp_fit([8, 4, 2, 1], measure, 1000, 1200, lambda mb: 100, lambda mb: mb)


def test_trial_step_leaves_weights_grads_and_rng_untouched():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=100, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.1))  # fmt: skip
    before = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    assert batch.trial_fits(model, model, torch.autocast("cpu", enabled=False), 4, 16, 100, torch.device("cpu"))  # fmt: skip
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_fsdp_trial_step_leaves_no_gradient_for_the_first_step(one_process_group):
    """FSDP2 (one-process gloo group, bf16 blocks with a float32 root as wrap_model sets them up):
    a trial step leaves nothing in FSDP's own buffers, so the first real step's gradients equal
    those of a model that never ran a trial. (Without gradient sync, FSDP2 keeps the trial's
    unsharded gradient and adds it to the next reduced one: zero_grad does not reach it.)"""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from gptrain.distributed.parallelize import grad_sync

    torch.manual_seed(0)
    plain = GPT(GPTConfig(vocab_size=100, block_size=16, n_layer=2, n_head=2, n_embd=32))
    models = [copy.deepcopy(plain), copy.deepcopy(plain)]
    low = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for m in models:
        for block in m.transformer.h:
            fully_shard(block.mlp, mp_policy=low)  # a bf16 group and float32 groups
        fully_shard(m, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
    off = torch.autocast("cpu", enabled=False)
    assert batch.trial_fits(models[0], models[0], off, 4, 16, 100, torch.device("cpu"))
    idx = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(1))
    grads = []
    for m in models:
        with grad_sync(m, sync=True):
            _, loss = m(idx, idx)
            loss.backward()
        grads.append({n: p.grad.full_tensor() for n, p in m.named_parameters()})
    for n, g in grads[1].items():
        torch.testing.assert_close(grads[0][n], g, rtol=0, atol=0, msg=n)


def test_resolve_uses_the_trial_only_for_auto_on_cuda(monkeypatch):
    t = train_cfg("train.micro_batch_size=auto", "train.total_batch_size=4096", "train.seq_len=64")
    calls = []
    monkeypatch.setattr(batch, "trial_fits", lambda w, m, a, mb, *rest: calls.append(mb) or mb <= 16)  # fmt: skip
    assert batch.resolve(t, DistInfo(), object()) == (64, 1)  # CPU: no memory probe
    assert calls == []
    cuda = DistInfo(device="cuda:0")
    assert batch.resolve(t, cuda, object()) == (16, 4)
    assert calls == [64, 32, 16]
    fixed = train_cfg("train.micro_batch_size=32", "train.total_batch_size=4096", "train.seq_len=64")  # fmt: skip
    assert batch.resolve(fixed, cuda, object()) == (32, 2)  # an explicit number is never probed


@pytest.mark.parametrize(
    "reduce, capacity_n, want",
    [("last", 35, 8), ("last", 28, 2), ("last", 24, None), ("every", 28, 4), ("every", 24, 2)],
)
def test_resolve_under_fsdp_predicts_from_two_trials_with_the_grad_reserve(monkeypatch, reduce, capacity_n, want):  # fmt: skip
    """An FSDP2-like wrapper on "CUDA": the prediction path, never the lockstep trials. 8 sequences
    per rank, N parameters, 10N bytes allocated, trial peaks 10N + N + 2N x mb. Predicted peak +
    reserve (8N, + 4N with accumulation > 1 under dist.fsdp_reduce = last): 8 -> 27N + 8N = 35N,
    4 -> 19N + 12N = 31N, 2 -> 15N + 12N = 27N, 1 -> 13N + 12N = 25N. With 28N bytes 2 fits;
    with 24N nothing does. Under `every` no rank holds a whole gradient: 4 -> 27N, 2 -> 23N."""
    monkeypatch.setattr(parallelize, "syncs_every_micro_step", lambda w: reduce == "every")
    t = train_cfg("train.micro_batch_size=auto", "train.total_batch_size=512", "train.seq_len=64")
    model = GPT(GPTConfig(vocab_size=100, block_size=64, n_layer=1, n_head=2, n_embd=32))
    n = sum(p.numel() for p in model.parameters())
    wrapped = copy.copy(model)
    wrapped.set_requires_gradient_sync = lambda *a, **k: None  # what resolve recognises FSDP2 by
    calls = []
    monkeypatch.setattr(batch, "trial_fits", lambda *a, **k: pytest.fail("lockstep trial under FSDP2"))  # fmt: skip
    monkeypatch.setattr(batch, "trial_peak", lambda w, m, a, mb, *rest: calls.append(mb) or 11 * n + 2 * n * mb)  # fmt: skip
    monkeypatch.setattr(batch, "_memory", lambda device: (10 * n, capacity_n * n))
    if want is None:
        with pytest.raises(UserError, match="not even 1 sequence"):
            batch.resolve(t, DistInfo(device="cuda:0"), wrapped, model)
    else:
        assert batch.resolve(t, DistInfo(device="cuda:0"), wrapped, model) == (want, 8 // want)
    assert calls == [1, 2]


@pytest.mark.parametrize("compiled, fsdp_like, want", [(False, False, 1), (True, False, 8), (True, True, 1)])  # fmt: skip
def test_the_trial_uses_the_chunks_of_the_loss_the_run_will_compile(monkeypatch, compiled, fsdp_like, want):  # fmt: skip
    """The trial runs eager, but a compiled model's loss takes at most MAX_COMPILED_CHUNKS (larger)
    chunks: the trial uses those, so that it needs the memory the run will; under FSDP (blocks
    compiled one by one) the loss stays eager. The model's own setting is restored after."""
    import gptrain.model.gpt as gpt

    seen, real = [], gpt.linear_cross_entropy

    def spy(x, weight, targets, vocab_size, chunk_rows):
        seen.append(chunk_rows)
        return real(x, weight, targets, vocab_size, chunk_rows)

    monkeypatch.setattr(gpt, "linear_cross_entropy", spy)
    model = GPT(GPTConfig(vocab_size=100, block_size=16, n_layer=1, n_head=2, n_embd=32))
    model.loss_chunk_rows = 1  # eager: 64 chunks of one row for 4 x 16 tokens
    wrapped = model
    if fsdp_like:  # what trial_fits recognises FSDP2 by
        wrapped = copy.copy(model)
        wrapped.set_requires_gradient_sync = lambda *a, **k: None
    off = torch.autocast("cpu", enabled=False)
    assert batch.trial_fits(wrapped, model, off, 4, 16, 100, torch.device("cpu"), compiled)
    assert seen == [want] and model.loss_chunk_rows == 1


def test_static_graph_is_refused_where_trial_steps_would_run_in_no_sync():
    """DDP's static_graph breaks under no_sync() (pytorch/pytorch#143580): the trial steps of
    micro_batch_size = auto run there on a GPU, so that combination is refused before them."""
    static = DistConfig(static_graph=True)
    gpus = DistInfo(world_size=2, device="cuda:0")
    auto, fixed = TrainConfig(micro_batch_size="auto"), TrainConfig(micro_batch_size=8)
    with pytest.raises(UserError, match="micro_batch_size = auto on a GPU"):
        runtime.check_options(static, 1, gpus, trial=batch.runs_trials(auto, gpus))
    runtime.check_options(static, 1, gpus, trial=batch.runs_trials(fixed, gpus))
    runtime.check_options(
        static, 1, DistInfo(world_size=2), trial=batch.runs_trials(auto, DistInfo(world_size=2))
    )
    runtime.check_options(DistConfig(), 1, gpus, trial=batch.runs_trials(auto, gpus))
    with pytest.raises(UserError, match="gradient accumulation"):
        runtime.check_options(static, 2, gpus)

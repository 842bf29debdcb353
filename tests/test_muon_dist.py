"""Muon on several processes (gptrain/training/muon.py): each matrix orthogonalised once per step,
whole, on one owner rank, under FSDP2 and (optim.muon_split = split) DDP.

Single process: the owners divide the Newton-Schulz FLOPs (at most 1/N of the total plus the
largest matrix's, its matrix products counted as they run); a matrix sharded other than by rows,
and optim.muon_split = redundant under FSDP2, are refused with one line naming the parameter or
the key. Two gloo ranks (tests/muon_dist_worker.py and `gptrain train`): 1 process, DDP
(redundant and split) and FSDP2 (also with row blocks of unequal sizes) end within 1e-5 of each
other after 5 float32 steps; an FSDP2 + Muon run killed mid-run resumes bit for bit on 2 ranks and
within 1e-5 on 1; its `gptrain export` gives transformers the same logits.
"""

from __future__ import annotations

import json
import shutil

import dist_helpers as h
import muon_dist_worker as worker
import pytest
import torch

from gptrain.checkpoint import dcp as sharded
from gptrain.checkpoint import manager as checkpoint
from gptrain.errors import UserError
from gptrain.model.gpt import GPT, PRESETS, GPTConfig
from gptrain.training.muon import assign_owners, ns_flops, orthogonalise
from gptrain.training.optim import build_optimizer

TOLERANCE = 1e-5  # max weight difference after 5 float32 steps (as the AdamW proofs)


def _matrices(n_layer: int, n_embd: int) -> list[tuple[int, int]]:
    """The Muon matrices of a GPT-2 of this size: c_attn, attn c_proj, c_fc, mlp c_proj."""
    c = n_embd
    return [(3 * c, c), (c, c), (4 * c, c), (c, 4 * c)] * n_layer


class _MatmulFlops(torch.overrides.TorchFunctionMode):
    """Counts 2 m k n for every matrix product computed inside it (mm, matmul, @, addmm), B times
    that for a batched one (bmm, baddbmm)."""

    PRODUCTS = {torch.mm, torch.matmul, torch.Tensor.mm, torch.Tensor.matmul, torch.Tensor.__matmul__}  # fmt: skip
    ADD_PRODUCTS = {torch.addmm, torch.Tensor.addmm, torch.bmm, torch.baddbmm}

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.PRODUCTS or func in self.ADD_PRODUCTS:
            a, b = args[-2:]
            batch = a.shape[0] if a.dim() == 3 else 1
            self.flops += 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]
        return func(*args, **(kwargs or {}))


def test_ns_flops_counts_what_orthogonalise_multiplies():
    for shape in [(48, 16), (16, 64), (37, 200), (64, 64)]:
        with _MatmulFlops() as counter:
            orthogonalise(torch.randn(shape), 5, torch.float32)
        assert counter.flops == ns_flops(shape, 5), shape
        with _MatmulFlops() as counter:  # a stack: the same products, batched
            orthogonalise(torch.randn(3, *shape), 5, torch.float32)
        assert counter.flops == 3 * ns_flops(shape, 5), shape


def test_owners_divide_the_newton_schulz_work():
    """Every GPT-2 preset on 1-8 ranks: each rank's FLOPs <= total / N + the largest matrix's;
    the assignment depends only on the shapes (the same on every rank)."""
    for name, arch in PRESETS.items():
        costs = [ns_flops(s, 5) for s in _matrices(arch["n_layer"], arch["n_embd"])]
        for ranks in range(1, 9):
            owners = assign_owners(costs, ranks)
            assert owners == assign_owners(list(costs), ranks)
            loads = [sum(c for c, o in zip(costs, owners, strict=True) if o == r) for r in range(ranks)]  # fmt: skip
            assert sum(loads) == sum(costs) and set(owners) == set(range(ranks)), (name, ranks)
            assert max(loads) <= sum(costs) / ranks + max(costs), (name, ranks, loads)


def test_matrix_sharded_by_columns_is_refused_in_one_line(one_process_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from gptrain.config.sections import OptimConfig

    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16))
    mlp = model.transformer.h[0].mlp
    mesh = init_device_mesh("cpu", (1,))
    mlp.c_fc.weight = torch.nn.Parameter(distribute_tensor(mlp.c_fc.weight.data, mesh, [Shard(1)]))
    with pytest.raises(UserError) as e:
        build_optimizer(model, OptimConfig(name="muon", muon_dtype="float32"), "cpu")
    line = str(e.value)
    assert "\n" not in line and "transformer.h.0.mlp.c_fc.weight" in line, line
    assert "Shard(dim=1)" in line and "optim.name=adamw" in line, line


def test_redundant_muon_under_fsdp_is_one_line_and_exit_2(tmp_path, capsys):
    """`gptrain train` with a Muon split FSDP2 cannot run stops before anything is written."""
    from gptrain.__main__ import main as cli

    run = tmp_path / "run"
    args = ["train", f"--run.dir={run}", "--optim.name=muon", "--dist.mode=fsdp"]
    assert cli([*args, "--optim.muon_split=redundant"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("gptrain: error: optim.muon_split = 'redundant'") and "\n" not in err
    assert "optim.muon_split=split" in err and not run.exists()


@pytest.fixture(scope="module")
def worker_runs(byte_data, tmp_path_factory):
    """The worker's three 2-rank variants, and the same steps in this one process."""
    out = tmp_path_factory.mktemp("muon") / "result"
    h.check_ok(h.wait_all(h.spawn(["tests/muon_dist_worker.py", str(out), str(byte_data)]), 200))
    records = [json.loads(out.with_name(f"result.{r}").read_text()) for r in (0, 1)]
    weights = {n: torch.load(out.with_name(f"result.{n}.pt")) for n in worker.VARIANTS}
    model, single = worker.train(str(byte_data), "dist.mode=ddp")
    weights["single"] = {k: v.detach() for k, v in model.state_dict().items()}
    model, _ = worker.train(str(byte_data), "dist.mode=ddp", *worker.ODD)
    weights["single_odd"] = {k: v.detach() for k, v in model.state_dict().items()}
    return weights, records, single


def _max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.slow
def test_ddp_and_fsdp_muon_equal_one_process(worker_runs):
    weights, records, single = worker_runs
    assert single["losses"][0] - single["losses"][-1] > 0.5  # it trained
    for name in ("ddp_redundant", "ddp_split", "fsdp"):
        assert _max_difference(weights[name], weights["single"]) <= TOLERANCE, name
        torch.testing.assert_close(records[0][name]["losses"], single["losses"], rtol=1e-5, atol=0)
    assert _max_difference(weights["fsdp_odd"], weights["single_odd"]) <= TOLERANCE
    for name in ("ddp_redundant", "ddp_split"):  # the replicas hold the same bytes
        prints = records[0][name]["fingerprints"]
        assert prints[0] == prints[1], name


@pytest.mark.slow
def test_each_rank_orthogonalises_its_share(worker_runs):
    """Counted per rank over 5 steps: split (DDP) and FSDP2 orthogonalise each matrix once in all,
    each rank <= 1/2 of the FLOPs + the largest matrix's; redundant does all of it on each rank."""
    _, records, single = worker_runs

    def flops(shapes) -> int:
        return sum(ns_flops(s, 5) for s in shapes)

    total, largest = flops(single["shapes"]), max(ns_flops(s, 5) for s in single["shapes"])
    steps = len(single["losses"])
    for name in ("ddp_split", "fsdp"):
        per_rank = [flops(r[name]["shapes"]) for r in records]
        assert sum(per_rank) == total, name
        assert max(per_rank) <= total / 2 + steps * largest, (name, per_rank)
        assert min(per_rank) > 0, name
    assert [flops(r["ddp_redundant"]["shapes"]) for r in records] == [total, total]


MUON_ARGS = [
    "--train.max_steps=5",
    "--train.micro_batch_size=4",
    "--train.total_batch_size=1024",
    "--optim.grad_clip=0.05",
    *h.FAST,
    "--optim.name=muon",
    "--optim.muon_dtype=float32",
    "--optim.lr_schedule=wsd",
    "--optim.decay_fraction=0.4",
    "--checkpoint.every=3",
]


def _train_args(byte_data, run_dir, *extra) -> list[str]:
    return ["-m", "gptrain", "train", "--config", h.DEBUG, f"--data.dir={byte_data}", f"--run.dir={run_dir}", *MUON_ARGS, *extra]  # fmt: skip


def _state(run_dir) -> tuple[dict, dict, dict]:
    """(full weights, optimizer tensors, data cursor) of a run's latest checkpoint."""
    folder = checkpoint.find(run_dir)
    weights, meta = checkpoint.load_model_state(folder)
    optim = sharded.load_full(folder, meta, "optim.") if meta.get("layout") == "dcp" else {}
    return weights, optim, checkpoint.load_state(folder)["data"]


@pytest.fixture(scope="module")
def fsdp_muon(byte_data, tmp_path_factory):
    """A 2-rank FSDP2 + Muon run of 5 steps (checkpoints at 3 and 5); the same run with rank 1
    killed inside step 4 (its latest checkpoint: step 3); the same 5 steps on one process."""
    from gptrain.commands.train import train
    from gptrain.config.load import load_config
    from gptrain.distributed.runtime import DistInfo

    root = tmp_path_factory.mktemp("fsdp_muon")
    fsdp = ["--dist.mode=fsdp", "--dist.timeout_s=20"]
    full = h.spawn(_train_args(byte_data, root / "full", *fsdp))
    killed = h.spawn(_train_args(byte_data, root / "killed", *fsdp), GPTRAIN_FAULT="crash@4/1")
    h.check_ok(h.wait_all(full, 200))
    results = h.wait_all(killed, 200)
    assert all(rc != 0 for rc, _, _ in results), results[0][2][-2000:]
    assert checkpoint.find(root / "killed").name == "step_00000003"
    args = _train_args(byte_data, root / "single")[5:]
    train(load_config(h.DEBUG, [a[2:] for a in args]), DistInfo())
    return root


@pytest.mark.slow
def test_killed_fsdp_muon_run_resumes_bit_for_bit(fsdp_muon, byte_data, tmp_path):
    """The killed run restarted on 2 ranks ends with the uninterrupted run's weights, sharded
    Muon momentum (and AdamW moments) and data cursor, bit for bit."""
    resumed = tmp_path / "resumed"
    shutil.copytree(fsdp_muon / "killed", resumed)
    results = h.wait_all(h.spawn(_train_args(byte_data, resumed, "--dist.mode=fsdp")), 200)
    h.check_ok(results)
    assert "resumed from" in results[0][1] and "step_00000003" in results[0][1]
    (wa, oa, da), (wb, ob, db) = _state(fsdp_muon / "full"), _state(resumed)
    momenta = [k for k in oa if k.endswith("momentum_buffer")]
    assert len(momenta) == 8 and da == db  # 2 blocks x 4 matrices
    for a, b in ((wa, wb), (oa, ob)):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_fsdp_muon_checkpoint_resumes_on_one_process(fsdp_muon, tmp_path):
    """The killed 2-rank run's step-3 checkpoint (sharded momentum) resumed by one process ends
    within 1e-5 of the 1-process run, as does the uninterrupted 2-rank run."""
    from gptrain.commands.train import train
    from gptrain.config.load import load_config
    from gptrain.distributed.runtime import DistInfo

    cut = tmp_path / "to_one"
    shutil.copytree(fsdp_muon / "killed", cut)
    overrides = [f"run.dir={cut}", "dist.mode=ddp", "dist.nproc_per_node=1"]
    assert train(load_config(str(cut / "config.toml"), overrides), DistInfo())["steps"] == 5
    single = _state(fsdp_muon / "single")[0]
    assert _max_difference(single, _state(cut)[0]) <= TOLERANCE
    assert _max_difference(single, _state(fsdp_muon / "full")[0]) <= TOLERANCE


@pytest.mark.slow
def test_fsdp_muon_run_exports_to_transformers_with_the_same_logits(fsdp_muon, tmp_path):
    transformers = pytest.importorskip("transformers")
    from gptrain.__main__ import main as cli
    from gptrain.evals.generate import load_model

    assert cli(["export", "--run", str(fsdp_muon / "full"), "--out", str(tmp_path / "hf")]) == 0
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    model, tokenizer, meta = load_model(fsdp_muon / "full")
    assert meta["step"] == 5
    idx = torch.tensor([tokenizer.encode("ROMEO: But soft! what light through yonder window")])
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx)[0], rtol=0, atol=1e-4)

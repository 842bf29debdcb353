"""Worker for tests/test_fsdp.py, run as one process per rank (gloo, RANK/WORLD_SIZE set by
dist_helpers.spawn): `python tests/fsdp_worker.py OUT_FILE DATA_DIR`.

It builds each variant with gptrain's own build_training (meta-device build, wrap_model order,
mixed precision) in one process group and records per step the loss averaged over ranks:

- init: the sharded init gathered to a full state dict equals build_model's single-process init;
- fsdp / fsdp_compile_ac: float32 FSDP2 without, and with per-block compile + activation
  checkpointing; "STEP n" markers on stderr let the test find recompiles after the first step;
- ddp_bf16 / fsdp_bf16: bf16 under DDP + autocast and under FSDP2 + MixedPrecisionPolicy, with
  the dtype of the residual stream (block 0's output) and of the loss;
- fsdp_last: float32 FSDP2 under dist.fsdp_reduce = last (the others: every, the default);
- held: under each dist.fsdp_reduce, the share of all parameters whose gradient a rank holds in
  .grad (its shards) when train_step's second micro-step starts;
- async_save: a checkpoint.async save whose writer is held back while training moves on.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
DEBUG = str(REPO / "configs" / "debug.toml")
STEPS = 3


def variant(data_dir: str, steps: int, *overrides: str, marker: str = "") -> dict:
    from gptrain.config.load import load_config
    from gptrain.data.loader import Dataset, TrainLoader
    from gptrain.distributed import runtime as dist
    from gptrain.training.batch import accumulation_steps
    from gptrain.training.build import build_training
    from gptrain.training.step import train_step

    cfg = load_config(
        DEBUG,
        [f"data.dir={data_dir}", "train.micro_batch_size=4", "optim.warmup_steps=1", *overrides],
    )
    info = dist.DistInfo.from_env("cpu")
    t = cfg.train
    dataset = Dataset(cfg.data.dir)
    loader = TrainLoader(dataset, t.seq_len, t.micro_batch_size, info.rank, info.world_size, t.seed)
    model, wrapped, optimizer, ptdtype, autocast, scaler = build_training(
        cfg, info, dataset.vocab_size, t.dtype, t.compile
    )
    seen = {}

    def residual_dtype(module, args, out) -> None:
        seen.setdefault("residual", str(out.dtype))

    model.transformer.h[0].register_forward_hook(residual_dtype)
    accum = accumulation_steps(t.total_batch_size, t.micro_batch_size, t.seq_len, info.world_size)
    losses = []
    for step in range(steps):
        loss, _ = train_step(
            wrapped, model, optimizer, scaler, loader.next_batch, accum, autocast, 1.0
        )
        seen.setdefault("loss", str(loss.dtype))
        losses.append(dist.all_reduce_mean(loss.float()).item())
        if marker:
            print(f"{marker} STEP {step + 1} done", file=sys.stderr, flush=True)
    return {"losses": losses, **seen}


def held_between_micro_steps(data_dir: str, reduce: str) -> float:
    """train_step over 2 micro-steps under dist.fsdp_reduce = `reduce`: the elements of .grad
    this rank holds when the second micro-step's forward starts, as a share of all parameters."""
    from gptrain.config.load import load_config
    from gptrain.data.loader import Dataset, TrainLoader
    from gptrain.distributed import runtime as dist
    from gptrain.training.build import build_training
    from gptrain.training.step import train_step

    cfg = load_config(DEBUG, [f"data.dir={data_dir}", "dist.mode=fsdp", f"dist.fsdp_reduce={reduce}", "train.micro_batch_size=4"])  # fmt: skip
    info, t = dist.DistInfo.from_env("cpu"), cfg.train
    dataset = Dataset(cfg.data.dir)
    loader = TrainLoader(dataset, t.seq_len, t.micro_batch_size, info.rank, info.world_size, t.seed)
    model, wrapped, optimizer, _, autocast, scaler = build_training(cfg, info, dataset.vocab_size, t.dtype, False)  # fmt: skip
    full = sum(p.numel() for p in model.parameters())
    held = []  # at each micro-step's forward: the share of .grad elements this rank holds

    sharded = list(model.parameters())  # DTensors: the forward swaps in unsharded ones

    def probe(module, args):
        grads = [p.grad for p in sharded if p.grad is not None]
        held.append(sum(g.to_local().numel() for g in grads) / full)

    model.register_forward_pre_hook(probe)
    train_step(wrapped, model, optimizer, scaler, loader.next_batch, 2, autocast, 1.0)
    assert len(held) == 2, held
    return held[1]


def init_matches_single_process(data_dir: str) -> dict:
    """Full state dict of the sharded (meta-built) model vs the single-process build_model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from gptrain.config.load import load_config
    from gptrain.distributed import runtime as dist
    from gptrain.training.build import build_model, build_training

    cfg = load_config(DEBUG, [f"data.dir={data_dir}", "dist.mode=fsdp", "model.n_layer=3"])
    info = dist.DistInfo.from_env("cpu")
    model, *_ = build_training(cfg, info, 257, "float32", False)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    local = sum(p.to_local().numel() for p in model.parameters())
    torch.manual_seed(cfg.train.seed)
    ref = build_model(cfg, 257)
    return {
        "tied": model.lm_head.weight is model.transformer.wte.weight,
        "keys_equal": sorted(full) == sorted(ref.state_dict()),
        "differ": [k for k, v in ref.state_dict().items() if not torch.equal(v, full[k])],
        "local_fraction": local / ref.num_params(non_embedding=False),
    }


def async_save_keeps_the_save_step(data_dir: str, run_dir: str) -> dict:
    """checkpoint.async: save after step 1 with DCP's writer held back until two more optimizer
    steps have changed every weight and moment; the checkpoint must hold step 1's state, stay
    invisible until wait(), and then be the published `latest`."""
    import threading

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from gptrain.checkpoint import dcp as sharded
    from gptrain.checkpoint import manager as checkpoint
    from gptrain.checkpoint import retention
    from gptrain.config.load import load_config
    from gptrain.data.loader import Dataset, TrainLoader
    from gptrain.distributed import runtime as dist
    from gptrain.training.build import build_training
    from gptrain.training.step import train_step

    cfg = load_config(DEBUG, [f"data.dir={data_dir}", "dist.mode=fsdp", "train.micro_batch_size=4", "optim.warmup_steps=1"])  # fmt: skip
    info, t = dist.DistInfo.from_env("cpu"), cfg.train
    dataset = Dataset(cfg.data.dir)
    loader = TrainLoader(dataset, t.seq_len, t.micro_batch_size, info.rank, info.world_size, t.seed)
    model, wrapped, optimizer, _, autocast, scaler = build_training(cfg, info, dataset.vocab_size, t.dtype, False)  # fmt: skip
    accum = t.total_batch_size // (t.micro_batch_size * t.seq_len * info.world_size)
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def full():  # collective: (weights, AdamW first moments) gathered on rank 0, copied
        m = {k: v.clone() for k, v in get_model_state_dict(model, options=opts).items()}
        o = get_optimizer_state_dict(model, optimizer, options=opts).get("state", {})
        return m, {k: v["exp_avg"].clone() for k, v in o.items()}

    def step():
        train_step(wrapped, model, optimizer, scaler, loader.next_batch, accum, autocast, 1.0)

    step()
    at_save, cursor = full(), loader.state_dict()["windows_consumed"]
    gate, write = threading.Event(), dcp.FileSystemWriter.write_data

    def held_back(self, *args, **kwargs):  # runs in DCP's thread
        assert gate.wait(120)
        return write(self, *args, **kwargs)

    dcp.FileSystemWriter.write_data = held_back
    pending = checkpoint.save(run_dir, 1, model, optimizer, loader, {"step": 1, "tokens": 0}, {}, info, background=True)  # fmt: skip
    step()
    step()
    later = full()
    tmp = Path(run_dir) / "checkpoints" / ".tmp-step_00000001"  # being written, not resumable:
    hidden = tmp.is_dir() and retention.resume_point(run_dir, "auto") == (None, [])
    gate.set()
    path = pending.wait()
    dcp.FileSystemWriter.write_data = write
    out = {"hidden_before_wait": hidden, "published": path is not None or not info.is_main}
    if info.is_main:
        meta = checkpoint.load_meta(path)
        saved = sharded.load_full(path, meta, "model.")
        moments = sharded.load_full(path, meta, "optim.")
        out["latest"] = checkpoint.latest(run_dir) == path
        out["weights_at_save"] = all(torch.equal(saved[k], v) for k, v in at_save[0].items() if k in saved)  # fmt: skip
        out["moments_at_save"] = all(torch.equal(moments[f"{k}.exp_avg"], v) for k, v in at_save[1].items())  # fmt: skip
        out["weights_moved"] = all(not torch.equal(later[0][k], v) for k, v in at_save[0].items())
        out["moments_moved"] = all(not torch.equal(later[1][k], v) for k, v in at_save[1].items())
        out["cursor_at_save"] = checkpoint.load_state(path)["data"]["windows_consumed"] == cursor
    return out


def main(out_file: str, data_dir: str) -> None:
    from gptrain.distributed import runtime as dist

    info = dist.DistInfo.from_env("cpu")
    dist.init(info, "gloo", 120)
    result = {"init": init_matches_single_process(data_dir)}
    result["fsdp"] = variant(data_dir, STEPS, "dist.mode=fsdp")
    result["fsdp_compile_ac"] = variant(
        data_dir,
        STEPS,
        "dist.mode=fsdp",
        "train.compile=true",
        "train.activation_checkpointing=blocks",
        marker="GPTRAIN-TEST",
    )
    result["fsdp_last"] = variant(data_dir, STEPS, "dist.mode=fsdp", "dist.fsdp_reduce=last")
    result["held"] = {r: held_between_micro_steps(data_dir, r) for r in ("every", "last")}
    result["ddp_bf16"] = variant(data_dir, STEPS, "dist.mode=ddp", "train.dtype=bfloat16")
    result["fsdp_bf16"] = variant(data_dir, STEPS, "dist.mode=fsdp", "train.dtype=bfloat16")
    result["async_save"] = async_save_keeps_the_save_step(data_dir, str(Path(out_file).parent / "async"))  # fmt: skip
    dist.teardown()
    Path(f"{out_file}.{os.environ['RANK']}").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
    from gptrain.__main__ import exit_quickly

    exit_quickly(0)

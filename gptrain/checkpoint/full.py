"""Checkpoints: one folder per step, written atomically, found through `latest`.

Layout (a contract, see README):

    run.dir/checkpoints/
      step_00000100/
        model.safetensors   unwrapped model weights (no `module.` / `_orig_mod.` prefixes)
        state.pt            {optimizer, data, train_state (step, RNG of every rank, ...)}
        meta.json           readable: step, model config, tokenizer identity, tokens seen, ...,
                            and the size + sha256 of every other file (checked when loaded)
        tokenizer.json      only for a trained BPE tokenizer: a copy, so the folder stands alone
      latest                name of the newest complete checkpoint folder

A checkpoint is written into `.tmp-step_XXXXXXXX`, each file fsynced, then renamed into place and
only then named in `latest` (itself replaced atomically). A crash at any point leaves either the
previous complete checkpoint or the new complete one: never a half-written folder that resume sees.
A write or publish that fails (a full disk, a refused rename) removes the temporary folder and is
one IOFailure on every rank, naming the rank, the path and the OS error; the previous checkpoint is
untouched and `latest` still names it.

Nothing in a checkpoint is code: weights are safetensors, meta.json is JSON, and state.pt is read
with `torch.load(weights_only=True)` (tensors and plain data; RNG states are stored as tensors).

Which checkpoint to resume from (skipping damaged ones) and which to keep: gptrain/checkpoint/retention.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from gptrain.checkpoint import folder
from gptrain.distributed import runtime as gdist
from gptrain.errors import UserError


def save(
    run_dir: str | Path,
    step: int,
    model_state: dict,
    meta: dict,
    state: dict | None = None,
    tied: dict[str, str] | None = None,
    threads: int = 1,
    rank: int = 0,
) -> Path:
    """Write checkpoint `step` under run_dir/checkpoints atomically and point `latest` at it.

    model_state: the unwrapped model's state dict (tensors); meta: JSON-able facts;
    state: tensors and plain data only (optimizer, data cursor, train state, RNG as tensors),
    since it is read back with weights_only=True;
    tied: {alias key: source key} of shared parameters (found from shared storage otherwise,
    but a gathered FSDP state dict holds separate copies);
    threads: how many files are written and hashed at once (folder.io_threads);
    rank: the rank writing it (named in the error line).
    A write or publish that fails removes the temporary folder and is one IOFailure naming the
    rank, the path and the OS error; the previous checkpoint stays intact and named in `latest`.
    """
    root = Path(run_dir) / "checkpoints"
    name = folder.step_dir_name(step)
    tmp = root / f".tmp-{name}"
    bad = [k for k in model_state if k.startswith(("module.", "_orig_mod.")) or "._orig_mod." in k]
    if bad:
        raise ValueError(f"wrapper prefix in model state key {bad[0]!r}: save the unwrapped model")
    what = "write"
    try:
        root.mkdir(parents=True, exist_ok=True)
        _write_folder(tmp, step, model_state, meta, state, tied, threads)
        what = "publish"
        return folder.publish(root, name, tmp, step)
    except Exception as e:  # a full disk, a quota, an I/O error: torch and safetensors wrap OSError
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(e, (OSError, RuntimeError)) and "Safetensor" not in type(e).__name__:
            raise
        raise gdist.IOFailure(folder.save_failed(rank, what, name, root, e)) from None


def _write_folder(
    tmp: Path, step: int, model_state: dict, meta: dict, state, tied, threads: int = 1
) -> None:
    """Every file of a checkpoint into the temporary folder `tmp`, each fsynced."""
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    tensors, tied, seen = {}, dict(tied or {}), {}
    for k, v in model_state.items():  # tied weights (lm_head = wte) are stored once
        key = (v.data_ptr(), v.shape, v.dtype, v.device)
        if k in tied:
            continue
        if key in seen:
            tied[k] = seen[key]
            continue
        seen[key] = k
        tensors[k] = v.detach().to("cpu").contiguous()

    def write_model() -> None:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"tied": json.dumps(tied)})
        folder.fsync_file(tmp / "model.safetensors")

    def write_state() -> None:
        torch.save(state, tmp / "state.pt")
        folder.fsync_file(tmp / "state.pt")

    # the two large files at once where threads allow (a GPT-2 124M-sized save on 2 cores:
    # 1.4-2.0x faster, benchmarks/RESULTS.md "Checkpoint I/O");
    # a write's error (a full disk) raises here, after both have ended
    writes = [write_model] + [write_state] * (state is not None)
    folder.in_threads(lambda write: write(), writes, threads)
    tok_file = meta.get("tokenizer", {}).get("path")  # a trained BPE: keep it with the weights
    if tok_file and Path(tok_file).is_file():
        folder.fsync_write(tmp / folder.TOKENIZER_FILE, Path(tok_file).read_bytes())
    files = folder.file_records(sorted(tmp.iterdir()), threads)  # what meta.json vouches for
    timeline = folder.timeline_keys(tmp.parent)  # the timeline this checkpoint belongs to
    record = {"step": step, "format": folder.FORMAT, **meta, **timeline, "files": files}
    folder.fsync_write(tmp / "meta.json", (json.dumps(record, indent=2) + "\n").encode())


def load_model_state(ckpt_dir: str | Path, device: str = "cpu") -> tuple[dict, dict]:
    """(model state dict, meta) of a checkpoint folder, its weights file verified first."""
    path = Path(ckpt_dir) / "model.safetensors"
    meta = folder.load_meta(ckpt_dir)
    folder.verify_file(path, meta)
    try:
        state = load_file(str(path), device=device)
        with safe_open(str(path), framework="pt") as f:
            tied = json.loads((f.metadata() or {}).get("tied", "{}"))
    except Exception as e:  # safetensors raises several types for corrupt files
        raise UserError(f"cannot read checkpoint weights {path}: {e}") from None
    for alias, source in tied.items():
        state[alias] = state[source]
    return state, meta


# --- training state: every stateful part, from any wrapping, through torch's public DCP API ---


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True, **kw)


def save_training(
    run_dir, step: int, model, optimizer, loader, train_state: dict, meta: dict, info, threads=1
) -> Path | None:
    """Collective: every rank calls it; the main process writes model, optimizer, data cursor,
    train_state and the RNG state of EVERY rank. Keys are the unwrapped model's (no prefixes). A
    failed write or publish (a full disk) is an IOFailure on every rank."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model_state = get_model_state_dict(model, options=_options())
    optim_state = get_optimizer_state_dict(model, optimizer, options=_options())
    rngs = [folder.rng_state(info.device)]
    if gdist.active():
        rngs = [None] * info.world_size
        torch.distributed.all_gather_object(rngs, folder.rng_state(info.device))
    state = {
        "optimizer": optim_state,
        "data": loader.state_dict(),
        "train_state": {**train_state, "world_size": info.world_size, "rng": rngs},
    }

    tied = folder.shared_parameters(model)
    # the main process writes and publishes while the others wait on the I/O group (within its
    # budget, not dist.timeout_s); a failed write or publish is one IOFailure on every rank
    return gdist.on_main(
        info, lambda: save(run_dir, step, model_state, meta, state, tied, threads, info.rank)
    )


def restore_training(ckpt_dir, model, optimizer, loader, info) -> dict:
    """Collective: load a checkpoint written by save_training into (possibly wrapped) parts.

    Only the main process reads the files; the model and optimizer are broadcast from it (any
    world size, FSDP included), and so are the data cursor and the train state. RNG states are
    restored per rank when the world size is unchanged. Returns the saved train_state."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    # only the main process reads the files (the other ranks may have no copy of the run directory)
    state, model_state = gdist.on_main(
        info,
        lambda: (folder.load_state(ckpt_dir), load_model_state(ckpt_dir)[0]),
        default=(None, {}),
    )
    optim_state = state["optimizer"] if state is not None else {}
    broadcast = gdist.active()
    opts = _options(broadcast_from_rank0=broadcast, strict=True)
    try:
        set_model_state_dict(model, model_state, options=opts)
    except RuntimeError as e:
        raise UserError(
            f"checkpoint {ckpt_dir} does not fit this model ({str(e).splitlines()[0]}); use the same [model] config it was trained with"
        ) from None
    set_optimizer_state_dict(model, optimizer, optim_state, options=opts)
    small = {"data": state["data"], "train_state": state["train_state"]} if state else None
    small = gdist.broadcast_from_main(small)
    loader.load_state_dict(small["data"])
    ts = small["train_state"]
    if ts.get("world_size") == info.world_size:
        folder.set_rng_state(ts["rng"][info.rank], info.device)
    return ts

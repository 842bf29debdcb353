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
A write that fails (a full disk) removes the temporary folder and is one UserError; the previous
checkpoint is untouched.

Nothing in a checkpoint is code: weights are safetensors, meta.json is JSON, and state.pt is read
with `torch.load(weights_only=True)` (tensors and plain data; RNG states are stored as tensors).

Which checkpoint to resume from (skipping damaged ones) and which to keep: gptrain/checkpoint/retention.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from gptrain.errors import UserError, first_line

STEP_PREFIX = "step_"
FORMAT = 2  # 2: state.pt holds only tensors and plain data (loaded with weights_only=True)
TOKENIZER_FILE = "tokenizer.json"  # a copy of a trained BPE tokenizer, so sampling needs no data


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def _fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    if os.name == "posix":
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save(
    run_dir: str | Path,
    step: int,
    model_state: dict,
    meta: dict,
    state: dict | None = None,
    tied: dict[str, str] | None = None,
) -> Path:
    """Write checkpoint `step` under run_dir/checkpoints atomically and point `latest` at it.

    model_state: the unwrapped model's state dict (tensors); meta: JSON-able facts;
    state: tensors and plain data only (optimizer, data cursor, train state, RNG as tensors),
    since it is read back with weights_only=True;
    tied: {alias key: source key} of shared parameters (found from shared storage otherwise,
    but a gathered FSDP state dict holds separate copies).
    """
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    name = step_dir_name(step)
    tmp = root / f".tmp-{name}"
    bad = [k for k in model_state if k.startswith(("module.", "_orig_mod.")) or "._orig_mod." in k]
    if bad:
        raise ValueError(f"wrapper prefix in model state key {bad[0]!r}: save the unwrapped model")
    try:
        _write_folder(tmp, step, model_state, meta, state, tied)
    except Exception as e:  # a full disk, a quota, an I/O error: torch and safetensors wrap OSError
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(e, (OSError, RuntimeError)) and "Safetensor" not in type(e).__name__:
            raise
        kept = (
            f"the previous checkpoint ({pointer(root)}) is intact"
            if pointer(root)
            else "no earlier checkpoint exists"
        )
        raise UserError(
            f"cannot write checkpoint {name} in {root} ({type(e).__name__}: {first_line(e)}); {kept}; free disk space and run the same command to resume"
        ) from None
    return publish(root, name, tmp)


def publish(root: Path, name: str, tmp: Path) -> Path:
    """Rename the complete folder `tmp` to root/name and point `latest` at it (also used by
    sharded.py for DCP checkpoints)."""
    final = root / name
    old = root / f".old-{name}"
    if final.exists():  # re-saving a step (a run resumed from an earlier step): two quick renames
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_write(root / ".latest.tmp", (name + "\n").encode())
    os.replace(root / ".latest.tmp", root / "latest")
    _fsync_dir(root)  # the renames themselves survive a power loss
    if old.exists():
        shutil.rmtree(old)
    return final


def pointer(root: Path) -> str:
    """The folder name `latest` holds ("" when there is none)."""
    try:
        return (root / "latest").read_text().strip()
    except OSError:
        return ""


def _write_folder(tmp: Path, step: int, model_state: dict, meta: dict, state, tied) -> None:
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
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"tied": json.dumps(tied)})
    _fsync_file(tmp / "model.safetensors")
    if state is not None:
        torch.save(state, tmp / "state.pt")
        _fsync_file(tmp / "state.pt")
    tok_file = meta.get("tokenizer", {}).get("path")  # a trained BPE: keep it with the weights
    if tok_file and Path(tok_file).is_file():
        _fsync_write(tmp / TOKENIZER_FILE, Path(tok_file).read_bytes())
    files = {f.name: _file_record(f) for f in sorted(tmp.iterdir())}  # what meta.json vouches for
    record = {"step": step, "format": FORMAT, **meta, "files": files}
    _fsync_write(tmp / "meta.json", (json.dumps(record, indent=2) + "\n").encode())


def _complete(path: Path) -> bool:
    weights = ("model.safetensors", ".metadata")  # a full checkpoint, or DCP shards (sharded.py)
    return (path / "meta.json").is_file() and any((path / w).is_file() for w in weights)


def latest(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint folder of a run, or None when there is none."""
    root = Path(run_dir) / "checkpoints"
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    path = root / name
    if not path.exists() and _complete(root / f".old-{name}"):
        # killed between the two renames of a re-save (see save): the previous copy is complete
        return root / f".old-{name}"
    if not _complete(path):
        raise UserError(
            f"{pointer} names {path.name}, which is incomplete or missing; delete {pointer} or restore the folder"
        )
    return path


def find(run_dir: str | Path, step: int | None = None) -> Path:
    """The checkpoint of `step`, or the latest one; a clear UserError when there is none."""
    if step is None:
        path = latest(run_dir)
        if path is None:
            raise UserError(
                f"no checkpoint in {Path(run_dir) / 'checkpoints'}; train first or pass --run with a trained run directory"
            )
        return path
    path = Path(run_dir) / "checkpoints" / step_dir_name(step)
    if not (path / "meta.json").is_file():
        raise UserError(f"no checkpoint for step {step} in {Path(run_dir) / 'checkpoints'}")
    return path


def load_meta(ckpt_dir: str | Path) -> dict:
    path = Path(ckpt_dir) / "meta.json"
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read checkpoint metadata {path}: {e}") from None


def _file_record(path: Path) -> dict:
    with open(path, "rb") as f:
        return {
            "bytes": path.stat().st_size,
            "sha256": hashlib.file_digest(f, "sha256").hexdigest(),
        }


def verify_file(path: Path, meta: dict) -> None:
    """The file is the one meta.json recorded (size and sha256); a UserError names it if not.
    (Checkpoints written before files were recorded are not checked.)"""
    want = meta.get("files", {}).get(path.name)
    if want is None:
        return
    got = _file_record(path) if path.is_file() else {"bytes": -1, "sha256": "missing"}
    if got != want:
        raise UserError(
            f"checkpoint file {path} is damaged ({got['bytes']} bytes, sha256 {got['sha256'][:12]}; meta.json recorded {want['bytes']} bytes, {want['sha256'][:12]}); "
            "restore it, or resume from an earlier checkpoint with --checkpoint.resume=STEP"
        )


def load_model_state(ckpt_dir: str | Path, device: str = "cpu") -> tuple[dict, dict]:
    """(model state dict, meta) of a checkpoint folder, its weights file verified first."""
    path = Path(ckpt_dir) / "model.safetensors"
    meta = load_meta(ckpt_dir)
    if meta.get("layout") == "dcp":  # sharded (an FSDP2 run): gathered into one full state dict
        from gptrain.checkpoint.dcp import load_full_model_state

        return load_full_model_state(ckpt_dir, meta, device), meta
    verify_file(path, meta)
    try:
        state = load_file(str(path), device=device)
        with safe_open(str(path), framework="pt") as f:
            tied = json.loads((f.metadata() or {}).get("tied", "{}"))
    except Exception as e:  # safetensors raises several types for corrupt files
        raise UserError(f"cannot read checkpoint weights {path}: {e}") from None
    for alias, source in tied.items():
        state[alias] = state[source]
    return state, meta


def load_state(ckpt_dir: str | Path) -> dict:
    """The training state (optimizer, data, train_state) of a checkpoint folder."""
    path = Path(ckpt_dir) / "state.pt"
    if not path.is_file():
        raise UserError(
            f"checkpoint {ckpt_dir} has no training state (state.pt); it can be sampled but not resumed"
        )
    meta = load_meta(ckpt_dir)
    if meta.get("format", 1) < FORMAT:
        raise UserError(
            f"checkpoint {ckpt_dir} was written by an older gptrain whose state.pt holds pickled Python objects; it is not loaded (a checkpoint must be data, never code): sample or export it, or start a new run.dir"
        )
    verify_file(path, meta)
    try:  # tensors and plain data only: nothing in the file can run code
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "weights only" not in str(e).lower():
            raise UserError(
                f"cannot read training state {path} ({first_line(e)}); resume from an earlier checkpoint with --checkpoint.resume=STEP"
            ) from None
        raise UserError(
            f"refused {path}: it holds objects other than tensors and plain data (a checkpoint is data, never code; nothing from it was run); use a checkpoint you trained yourself"
        ) from None
    except Exception as e:  # truncated or damaged: zip and torch raise various types
        raise UserError(
            f"cannot read training state {path} ({type(e).__name__}: {first_line(e)}); "
            "resume from an earlier checkpoint with --checkpoint.resume=STEP"
        ) from None


# --- training state: every stateful part, from any wrapping, through torch's public DCP API ---


def _options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True, **kw)


def _rng_state(device: str) -> dict:
    """This process's RNG states as tensors and plain data (loadable with weights_only=True)."""
    import random

    import numpy as np

    version, words, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": [version, torch.tensor(words, dtype=torch.int64), gauss],
        "numpy": [
            name,
            torch.from_numpy(keys.astype(np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        ],
    }
    if device.startswith("cuda"):
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: str) -> None:
    import random

    import numpy as np

    torch.set_rng_state(state["torch"])
    version, words, gauss = state["python"]
    random.setstate((version, tuple(words.tolist()), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if device.startswith("cuda") and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def shared_parameters(model: torch.nn.Module) -> dict[str, str]:
    """{alias name: first name} for parameters registered under several names (weight tying)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def save_training(
    run_dir, step: int, model, optimizer, loader, train_state: dict, meta: dict, info
) -> Path | None:
    """Collective: every rank calls it; the main process writes model, optimizer, data cursor,
    train_state and the RNG state of EVERY rank. Keys are the unwrapped model's (no prefixes). A
    failed write (full disk) is a UserError on every rank."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    from gptrain.distributed import runtime as gdist

    model_state = get_model_state_dict(model, options=_options())
    optim_state = get_optimizer_state_dict(model, optimizer, options=_options())
    rngs = [_rng_state(info.device)]
    if gdist.active():
        rngs = [None] * info.world_size
        torch.distributed.all_gather_object(rngs, _rng_state(info.device))
    state = {
        "optimizer": optim_state,
        "data": loader.state_dict(),
        "train_state": {**train_state, "world_size": info.world_size, "rng": rngs},
    }

    tied = shared_parameters(model)
    # the main process writes; its collective is the barrier after the save, and a failed write
    # (a full disk) is one UserError on every rank
    return gdist.on_main(info, lambda: save(run_dir, step, model_state, meta, state, tied=tied))


def restore_training(ckpt_dir, model, optimizer, loader, info) -> dict:
    """Collective: load a checkpoint written by save_training into (possibly wrapped) parts.

    Only the main process reads the files; the model and optimizer are broadcast from it (any
    world size, FSDP included), and so are the data cursor and the train state. RNG states are
    restored per rank when the world size is unchanged. Returns the saved train_state."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from gptrain.distributed import runtime as gdist

    # only the main process reads the files (the other ranks may have no copy of the run directory)
    state, model_state = gdist.on_main(
        info, lambda: (load_state(ckpt_dir), load_model_state(ckpt_dir)[0]), default=(None, {})
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
        _set_rng_state(ts["rng"][info.rank], info.device)
    return ts

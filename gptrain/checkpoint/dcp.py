"""Sharded checkpoints for FSDP2 runs, through torch.distributed.checkpoint (DCP).

Each rank writes its own shards of the model and optimizer: no rank gathers the full state (19 GB
for GPT-2 XL with AdamW), and no rank waits in a collective bounded by dist.timeout_s while another
writes (the collectives here use dist.io_group(), with its own generous time-out). Layout:

    step_00000100/
      .metadata          DCP's index of every tensor's chunks (written by rank 0)
      __0_0.distcp ...   rank r's tensor shards (`__{r}_*.distcp`)
      state.pt           {optimizer param_groups, data cursor, train_state incl. every rank's RNG}
      meta.json          as for full checkpoints, plus "layout": "dcp"; size + sha256 of every
                         file, each rank hashing the shards it wrote
      tokenizer.json     only for a trained BPE tokenizer

Atomic like checkpoint.save: everything goes into `.tmp-step_...`; after every rank has written and
hashed its files, rank 0 writes meta.json and renames the folder into place (folder.publish).
Needs a filesystem that every rank sees (a shared one on several nodes), as DCP does.

checkpoint.async: `save_training` returns as soon as DCP's async_save has staged a copy of this
rank's shards in host memory (and the small state is copied); a thread writes the shards while
training goes on. The folder stays `.tmp-step_...`, invisible to resume, until `Pending.wait()`
(the loop calls it at the next save, before a rollback, at the end and before a preemption exit)
has every rank's files hashed and publishes it; one save is pending at most.

Loading works on any world size, one process without a process group included (DCP reshards):
every file is checked against meta.json BEFORE anything is read (the ranks split the hashing), and
only tensors are stored in DCP files, so DCP unpickles nothing but its `.metadata` index (see
README: its hash is checked first). `gptrain export` / `sample` read the full model through
`load_full_model_state` on one process.
"""

from __future__ import annotations

import copy
import pickle
import shutil
import warnings
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as tdist

from gptrain.checkpoint import folder
from gptrain.distributed import faults
from gptrain.distributed import runtime as gdist
from gptrain.errors import UserError

LAYOUT = "dcp"  # meta.json "layout" of a sharded checkpoint (full ones have none)


def save_training(
    run_dir, step, model, optimizer, loader, train_state, meta, info, background=False, threads=1
):
    """Collective: a sharded (DCP) checkpoint of every stateful part of an FSDP2 run, each rank's
    shards written and hashed by `threads` threads (one file each, folder.io_threads). Returns the
    function that publishes it (every rank calls it once, see manager.Pending). background (checkpoint.async, DCP only): DCP's async_save stages a copy
    of this rank's shards in host memory before it returns (so later optimizer steps cannot reach
    the checkpoint) and writes it from a thread; everything else is captured now, too."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    group = gdist.io_group()
    root = Path(run_dir) / "checkpoints"
    name = folder.step_dir_name(step)
    tmp = root / f".tmp-{name}"
    gdist.on_main(info, lambda: _make_tmp(root, tmp, info.rank))  # an error stops every rank
    tensors, others = _state(model, optimizer)
    writer = dcp.FileSystemWriter(tmp, thread_count=threads)
    if background:  # the staged copy is taken here, in this thread, before it returns
        future = dcp.async_save(tensors, storage_writer=writer, process_group=group)
        future = getattr(future, "upload_completion", future)  # an AsyncSaveResponse: its write
    else:
        future = Future()
        try:
            future.set_result(dcp.save(tensors, storage_writer=writer, process_group=group))
        except (Exception, CheckpointException) as e:  # reported on every rank by _publish
            future.set_exception(e)
    state = {  # the rest of the state at this step (small), written when published
        "optimizer": copy.deepcopy(others),
        "data": copy.deepcopy(loader.state_dict()),
        "train_state": {**copy.deepcopy(train_state), "world_size": info.world_size},
    }
    rng = folder.rng_state(info.device)
    tied = folder.shared_parameters(model)
    return lambda: _publish(step, root, tmp, future, state, rng, meta, tied, info, group, threads)


def _make_tmp(root: Path, tmp: Path, rank: int) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    except OSError as e:
        name = tmp.name.removeprefix(".tmp-")
        raise gdist.IOFailure(folder.save_failed(rank, "write", name, root, e)) from None


def _publish(step, root, tmp, future, state, rng, meta, tied, info, group, threads):
    """Collective (io group): wait for this rank's shards and hash them, gather every rank's
    records and errors; rank 0 checks that it sees every file, writes state.pt and meta.json and
    renames the folder into place (folder.publish), then tells every rank how that went. A write,
    hash or publish that fails on any rank is one IOFailure on every rank, naming the rank, the
    path and the OS error; a shard rank 0 cannot see (no shared filesystem) is a UserError on
    every rank. Either way the temporary folder is removed and the previous checkpoint stays
    `latest`."""
    records, error = _own_part(step, root, tmp, future, info, threads)
    gathered = [(records, rng, error)]
    if group is not None:
        gathered = [None] * info.world_size
        tdist.all_gather_object(gathered, (records, rng, error), group=group)
    # the outcome, decided by rank 0: None, or (failing rank, "io" or "user", its line)
    outcome = next(((r, "io", g[2]) for r, g in enumerate(gathered) if g[2]), None)
    path = lost = None
    if info.is_main and outcome is None:  # every rank's shards must be in rank 0's folder
        missing = [n for g in gathered for n in g[0] if not (tmp / n).is_file()]
        if missing:
            why = f"FSDP2 checkpoint step {step}: {missing[0]} written by another rank is not in {tmp} as rank 0 sees it; sharded checkpoints need run.dir on a filesystem every node sees (shared), or use dist.mode=ddp"
            outcome = (0, "user", why)
    if info.is_main and outcome is None:
        try:
            path = _finish(step, root, tmp, state, gathered, meta, tied)
        except UserError as e:  # the run folder's lock taken over by another job
            outcome, lost = (0, "user", str(e)), e
        except Exception as e:  # noqa: BLE001 a full disk, a refused rename: the peers must hear it
            name = tmp.name.removeprefix(".tmp-")
            outcome = (0, "io", folder.save_failed(info.rank, "publish", name, root, e))
    box = [outcome]
    if group is not None:  # the peers wait here, within the I/O budget, for rank 0's publish
        tdist.broadcast_object_list(box, src=0, group=group)
    if box[0] is None:
        return path
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    rank, kind, message = box[0]
    if lost is not None:
        raise lost
    raise UserError(message) if (rank, kind) == (info.rank, "user") else gdist.peer_error(*box[0])


def _own_part(step, root, tmp, future, info, threads) -> tuple[dict, str]:
    """(records of this rank's shards, its error line or ""): its write waited for, its files
    hashed (GPTRAIN_FAULT=publish_error@STEP/R fires here on a rank R > 0)."""
    from torch.distributed.checkpoint.api import CheckpointException

    name = tmp.name.removeprefix(".tmp-")
    try:
        future.result()
    except (Exception, CheckpointException) as e:  # a full disk, an I/O error, on any rank
        return {}, folder.save_failed(info.rank, "write", name, root, e)
    try:
        if not info.is_main:
            faults.kill_save(step)  # GPTRAIN_FAULT=kill_save@STEP/R, R > 0: shards written
            faults.publish_error(step, tmp / f"__{info.rank}_0.distcp")
        return folder.file_records(sorted(tmp.glob(f"__{info.rank}_*.distcp")), threads), ""
    except OSError as e:
        return {}, folder.save_failed(info.rank, "publish", name, root, e)


def _finish(step, root, tmp, state, gathered, meta, tied) -> Path:
    """Rank 0: state.pt (with every rank's RNG), tokenizer.json, meta.json, then the rename."""
    state["train_state"]["rng"] = [g[1] for g in gathered]
    torch.save(state, tmp / "state.pt")
    folder.fsync_file(tmp / "state.pt")
    tok_file = meta.get("tokenizer", {}).get("path")
    if tok_file and Path(tok_file).is_file():
        folder.fsync_write(tmp / folder.TOKENIZER_FILE, Path(tok_file).read_bytes())
    files = {n: r for g in gathered for n, r in g[0].items()}
    for f in sorted(tmp.iterdir()):  # .metadata, state.pt, tokenizer.json: rank 0's own
        if f.name not in files:
            files[f.name] = folder.file_record(f)
    meta_all = {
        "step": step,
        **meta,
        "format": folder.FORMAT,
        "layout": LAYOUT,
        "tied": tied,
        **folder.timeline_keys(root),  # the timeline this checkpoint belongs to
        "files": files,
    }
    folder.fsync_write(tmp / "meta.json", (_json(meta_all) + "\n").encode())
    return folder.publish(root, tmp.name.removeprefix(".tmp-"), tmp, step)


def restore_training(ckpt_dir, meta: dict, model, optimizer, loader, info) -> dict:
    """Collective: load a DCP checkpoint into (possibly wrapped) parts, resharded onto this world
    size. Returns train_state."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    group = gdist.io_group()
    verify(ckpt_dir, meta, info, group)
    state = gdist.on_main(info, lambda: folder.load_state(ckpt_dir))
    state = gdist.broadcast_from_main(state)
    tensors, _ = _state(model, optimizer)
    _load(ckpt_dir, tensors, group, no_dist=not gdist.active())
    aliases = folder.shared_parameters(model)
    model_state = {**tensors["model"], **{a: tensors["model"][s] for a, s in aliases.items()}}
    opts = StateDictOptions(strict=True)
    set_model_state_dict(model, model_state, options=opts)
    optim_state = {
        "state": _merge(tensors["optim"], state["optimizer"]["state"]),
        "param_groups": state["optimizer"]["param_groups"],
    }
    set_optimizer_state_dict(model, optimizer, optim_state, options=opts)
    loader.load_state_dict(state["data"])
    ts = state["train_state"]
    if ts.get("world_size") == info.world_size:
        folder.set_rng_state(ts["rng"][info.rank], info.device)
    return ts


def load_full_model_state(ckpt_dir, meta: dict, device: str = "cpu") -> dict:
    """The full (unsharded) model state dict of a DCP checkpoint, read on this one process
    (`gptrain export` / `sample`), every file checked first; tied aliases included."""
    model = load_full(ckpt_dir, meta, "model.", device)
    for alias, source in meta.get("tied", {}).items():
        model[alias] = model[source]
    return model


def load_full(ckpt_dir, meta: dict, prefix: str, device: str = "cpu") -> dict:
    """{key without prefix: full tensor} of the DCP entries under `prefix` ("model." or "optim.",
    whose keys are "FQN.exp_avg" and so on), read on this one process after verify()."""
    verify(ckpt_dir, meta, gdist.DistInfo(), None)
    index = _read_index(ckpt_dir).state_dict_metadata
    flat = {
        k: torch.empty(m.size, dtype=m.properties.dtype, device=device)
        for k, m in index.items()
        if k.startswith(prefix) and hasattr(m, "size")
    }
    _load(ckpt_dir, flat, None, no_dist=True)
    return {k.removeprefix(prefix): v for k, v in flat.items()}


def verify(ckpt_dir, meta: dict, info, group) -> None:
    """Every file meta.json records has its recorded size and sha256, checked before any is read;
    the ranks share the hashing (file i on rank i % world size; each rank hashes its share in
    folder.io_threads threads), a failure stops every rank."""
    names = sorted(meta.get("files", {}))
    if ".metadata" not in names:
        raise UserError(
            f"checkpoint {ckpt_dir}: meta.json records no DCP index (.metadata); restore the folder or resume from another step"
        )

    def problem(name: str) -> str:
        try:
            folder.verify_file(Path(ckpt_dir) / name, meta)
        except UserError as e:
            return str(e)
        return ""

    mine = names[info.rank :: max(info.world_size, 1)]
    errors = folder.in_threads(problem, mine, folder.io_threads(info.local_world_size))
    error = next((e for e in errors if e), "")
    failed = torch.tensor([1.0 if error else 0.0])
    if group is not None:
        tdist.all_reduce(failed, group=group)
    if failed.item():
        raise UserError(error or "a checkpoint file is damaged (see another rank's message)")


def _state(model, optimizer) -> tuple[dict, dict]:
    """({"model": sharded tensors, "optim": optimizer tensors}, optimizer's other entries): only
    tensors go to DCP files; tied aliases are stored once (under their first name)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model_state = get_model_state_dict(model)
    for alias in folder.shared_parameters(model):
        model_state.pop(alias, None)
    optim = get_optimizer_state_dict(model, optimizer)  # initialises an empty state (load target)
    tensors, others = {}, {}
    for fqn, entry in optim["state"].items():
        tensors[fqn] = {k: v for k, v in entry.items() if isinstance(v, torch.Tensor)}
        others[fqn] = {k: v for k, v in entry.items() if not isinstance(v, torch.Tensor)}
    return {"model": model_state, "optim": tensors}, {
        "state": others,
        "param_groups": optim["param_groups"],
    }


def _merge(tensors: dict, others: dict) -> dict:
    return {fqn: {**others.get(fqn, {}), **entry} for fqn, entry in tensors.items()}


def _load(ckpt_dir, tensors: dict, group, no_dist: bool = False) -> None:
    import torch.distributed.checkpoint as dcp

    _read_index(ckpt_dir)  # refused here, on every rank, if it names anything but DCP's classes
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                tensors,
                storage_reader=_safe_reader(ckpt_dir),
                process_group=group,
                no_dist=no_dist,
            )
    except Exception as e:  # DCP wraps rank failures in CheckpointException
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise UserError(
            f"checkpoint {ckpt_dir} does not fit this model ({first}); use the same [model] config it was trained with"
        ) from None


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` index is a pickle. This reads it without running code: only the classes
    an index is made of can be named in it (DCP's metadata dataclasses and enum, its storage
    record, torch.Size, dtypes, the layout lookup, a POSIX path); anything else (another class
    of those modules, a function, a class with side effects) is refused before it is called."""

    CLASSES = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "ChunkStorageMetadata",
            "BytesStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        },
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch": {"Size"},
        "torch.serialization": {"_get_layout"},
        "collections": {"OrderedDict"},
        "pathlib": {"PosixPath", "PurePosixPath"},
    }

    def find_class(self, module: str, name: str):
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if name in self.CLASSES.get(module, ()) or dtype:
            found = super().find_class(module, name)
            if not module.startswith("torch.distributed") or found.__module__ == module:
                return found  # (DCP's names: its own classes, never one it imported)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP index")


def _read_index(ckpt_dir):
    """DCP's index of a checkpoint folder, read by _MetadataUnpickler, each storage path a file
    name in the folder; a refusal is one line."""
    index = Path(ckpt_dir) / ".metadata"
    try:
        with open(index, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except (pickle.UnpicklingError, AttributeError, EOFError, ValueError, TypeError) as e:
        raise UserError(
            f"refused {index}: {e} (a checkpoint is data, never code; nothing from it was run); use a checkpoint you trained yourself"
        ) from None
    storage = getattr(metadata, "storage_data", None) or {}
    for info in storage.values() if isinstance(storage, dict) else [None]:
        where = str(getattr(info, "relative_path", ""))
        if not where or Path(where).name != where or where in (".", ".."):
            raise UserError(
                f"refused {index}: it names the storage file {where[:100]!r}, which is not a file of this folder (an absolute path or one with a directory or '..'; nothing was read); use a checkpoint you trained yourself"
            )
    return metadata


def _safe_reader(ckpt_dir):
    """DCP's FileSystemReader, with the index read by _read_index instead of pickle.load (DCP is
    imported here, not with this module: it costs ~0.7 s, and runs that are not sharded never
    need it)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = _read_index(self.path)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(ckpt_dir)


def _json(obj) -> str:
    import json

    return json.dumps(obj, indent=2)

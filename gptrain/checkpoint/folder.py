"""The checkpoint folder contract shared by both backends (full.py, dcp.py), which never import
each other: one folder per step, written into `.tmp-step_XXXXXXXX`, published by a rename and then
named in `latest`; every file's size and sha256 in meta.json, checked before it is read; state.pt
(tensors and plain data, read with weights_only=True); RNG states; tied-parameter aliases.

Layout (a contract, see docs/outputs.md):

    run.dir/checkpoints/
      step_00000100/
        model.safetensors   unwrapped model weights (no `module.` / `_orig_mod.` prefixes);
                            FSDP2 runs instead: .metadata + __RANK_I.distcp (DCP shards,
                            I < the rank's checkpoint.io_threads)
        state.pt            {optimizer, data, train_state (step, RNG of every rank, ...)}
        meta.json           readable: step, model config, tokenizer identity, tokens seen, ...,
                            and the size + sha256 of every other file (checked when loaded)
        tokenizer.json      only for a trained BPE tokenizer: a copy, so the folder stands alone
      latest                name of the newest complete checkpoint folder
      timeline.json         the timeline the run trains on (ids of it and its ancestors)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from gptrain.checkpoint import lock
from gptrain.distributed import faults
from gptrain.distributed.runtime import cpu_cores
from gptrain.errors import UserError, first_line

# Writing a DCP shard and hashing a file are CPU-bound. On a 2-core AMD EPYC (AVX2), 2 GiB took
# 5.4-7.6 s to write by 1 thread, 3.9-4.5 s by 2 and 4.4-5.0 s by 4, and 1.75 s to hash by one,
# 0.92 s by 2 (benchmarks/RESULTS.md, "Checkpoint I/O"): one thread per core.
MAX_IO_THREADS = 8

STEP_PREFIX = "step_"


FORMAT = 2  # 2: state.pt holds only tensors and plain data (loaded with weights_only=True)


TOKENIZER_FILE = "tokenizer.json"  # a copy of a trained BPE tokenizer, so sampling needs no data

TIMELINE = "timeline.json"  # run.dir/checkpoints/timeline.json: the timeline the run trains on


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


def fsync_write(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def fsync_dir(path: Path) -> None:
    if os.name == "posix":
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def publish(root: Path, name: str, tmp: Path, step: int | None = None) -> Path:
    """Rename the complete folder `tmp` to root/name and point `latest` at it (both backends, and
    the mirror's downloads). A failure before `latest` names it (a full disk while writing the
    pointer, a refused rename) undoes the renames and raises: the previous checkpoint is where it
    was and `latest` still names it; the new folder is back at `tmp` (the caller removes it).
    `step`: the checkpoint being saved, where GPTRAIN_FAULT=publish_error@STEP fires. A folder
    whose lock another job took over from this process is left as it is (lock.LockLost)."""
    lock.check_folder(root)
    faults.kill_save(step)  # GPTRAIN_FAULT=kill_save@STEP: SIGKILL, tmp written, not renamed
    final = root / name
    old = root / f".old-{name}"
    moved = renamed = False
    try:
        if final.exists():  # re-saving a step (a run resumed from an earlier one): two renames
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
            moved = True
        fsync_dir(tmp)  # the folder's entries are on disk before it becomes visible
        os.replace(tmp, final)
        renamed = True
        if step is not None:
            faults.publish_error(step, root / ".latest.tmp")
        fsync_write(root / ".latest.tmp", (name + "\n").encode())
        os.replace(root / ".latest.tmp", root / "latest")
    except Exception:
        _undo_publish(root, final, old, tmp, moved, renamed)
        raise
    fsync_dir(root)  # the renames themselves survive a power loss
    shutil.rmtree(old, ignore_errors=True)
    return final


def _undo_publish(root: Path, final: Path, old: Path, tmp: Path, moved: bool, renamed: bool):
    """Each rename of a failed publish backwards, as far as the filesystem lets it."""
    with contextlib.suppress(OSError):
        (root / ".latest.tmp").unlink(missing_ok=True)
    if renamed:
        with contextlib.suppress(OSError):
            os.replace(final, tmp)
    if moved and not final.exists():
        with contextlib.suppress(OSError):
            os.replace(old, final)


def is_step_name(name: str) -> bool:
    """A checkpoint folder's name (step_XXXXXXXX): no path, no `..`."""
    return re.fullmatch(rf"{STEP_PREFIX}[0-9]{{8,}}", name) is not None


def save_failed(rank: int, what: str, name: str, root: Path, e: BaseException) -> str:
    """The one line of a checkpoint that could not be written or published: the rank, the path,
    the OS error, what `latest` names now, and the fix."""
    kept = pointer(root)
    if kept == name:
        kept = f"`latest` names {name}, which is complete"
    elif kept:
        kept = f"the previous checkpoint {kept} is intact and `latest` names it"
    else:
        kept = "no earlier checkpoint exists"
    return (
        f"rank {rank}: cannot {what} checkpoint {name} in {root} ({type(e).__name__}: {first_line(e)}); {kept}; "
        "free disk space (or fix the filesystem) and run the same command to resume"
    )


def pointer(root: Path) -> str:
    """The folder name `latest` holds ("" when there is none)."""
    try:
        return (root / "latest").read_text().strip()
    except OSError:
        return ""


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
    if not is_step_name(name):
        raise UserError(
            f"{pointer} names {name[:100]!r}, which is not a checkpoint folder of this directory (step_XXXXXXXX: no path, no '..'); write the name of one of its checkpoint folders into it, or delete it"
        )
    path = root / name
    if not path.exists() and _complete(root / f".old-{name}"):
        # killed between the two renames of a re-save (see save): the previous copy is complete
        return root / f".old-{name}"
    if not _complete(path):
        raise UserError(
            f"{pointer} names {path.name}, which is incomplete or missing; delete {pointer} or restore the folder"
        )
    return path


def read_timeline(root: Path) -> dict | None:
    """The timeline the run trains on, from root/timeline.json (None when there is none): {"id",
    "from_step" (the step a resume = STEP started it from; None for a fresh start), "command" (a
    hash of that run's whole config), "training" (a hash of its keys that can change training,
    config/identity.py), "keys" (those keys; "training" and "keys" absent in older records),
    "ancestors" (the timelines it descends from, each with "until": the last of its steps this
    one continues)}. See retention.py for how it is used."""
    path = root / TIMELINE
    try:
        t = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise UserError(
            f"cannot read {path} ({first_line(e)}); restore it, or delete it to let resume follow `latest`"
        ) from None
    if not valid_timeline(t):
        raise UserError(
            f"{path} is malformed (no timeline id and ancestors); restore it, or delete it to let resume follow `latest`"
        )
    return t


def valid_timeline(t) -> bool:
    """A timeline record: a string id, and ancestors each with a string id and an int `until`."""
    if not (isinstance(t, dict) and isinstance(t.get("id"), str)):
        return False
    ancestors = t.get("ancestors")
    return isinstance(ancestors, list) and all(
        isinstance(a, dict) and isinstance(a.get("id"), str) and isinstance(a.get("until"), int)
        for a in ancestors
    )


def write_timeline(root: Path, timeline: dict) -> None:
    """root/timeline.json, replaced whole (written, fsynced, renamed)."""
    root.mkdir(parents=True, exist_ok=True)
    fsync_write(root / f".{TIMELINE}.tmp", (json.dumps(timeline, indent=2) + "\n").encode())
    os.replace(root / f".{TIMELINE}.tmp", root / TIMELINE)
    fsync_dir(root)


def point_latest(root: Path, name: str) -> None:
    """`latest` names the checkpoint folder `name` (replaced atomically)."""
    fsync_write(root / ".latest.tmp", (name + "\n").encode())
    os.replace(root / ".latest.tmp", root / "latest")
    fsync_dir(root)


def timeline_keys(root: Path) -> dict:
    """What a checkpoint's meta.json records of the timeline it is saved on (nothing when the run
    directory records none)."""
    t = read_timeline(root)
    return {} if t is None else {"timeline": t, "parent_step": t.get("from_step")}


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


def io_threads(local_processes: int, asked: int = 0) -> int:
    """Threads one process writes and hashes checkpoint files with: checkpoint.io_threads, or for
    0 one per CPU core of its share of the node (local_processes share its cores), at most
    MAX_IO_THREADS."""
    if asked > 0:
        return asked
    return max(1, min(MAX_IO_THREADS, cpu_cores() // max(1, local_processes)))


def in_threads(fn, items, threads: int) -> list:
    """[fn(item) for item in items], `threads` at a time (file I/O and hashlib release the GIL);
    the first error raises here once every call has ended."""
    items = list(items)
    with ThreadPoolExecutor(max(1, min(threads, len(items)))) as pool:
        return list(pool.map(fn, items))


def file_records(paths, threads: int = 1) -> dict:
    """{name: file_record} for several files, hashed `threads` at a time."""
    paths = list(paths)
    return {p.name: r for p, r in zip(paths, in_threads(file_record, paths, threads), strict=True)}


def file_record(path: Path) -> dict:
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
    got = file_record(path) if path.is_file() else {"bytes": -1, "sha256": "missing"}
    if got != want:
        raise UserError(
            f"checkpoint file {path} is damaged ({got['bytes']} bytes, sha256 {got['sha256'][:12]}; meta.json recorded {want['bytes']} bytes, {want['sha256'][:12]}); "
            "restore it, or resume from an earlier checkpoint with --checkpoint.resume=STEP"
        )


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


def rng_state(device: str) -> dict:
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


def set_rng_state(state: dict, device: str) -> None:
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

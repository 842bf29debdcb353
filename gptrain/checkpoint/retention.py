"""Which checkpoint folders count: the one to resume from, and the ones to keep.

- Fallback (`resume_point`): under checkpoint.resume = auto or latest, a newest checkpoint that is
  incomplete, truncated or fails its hashes is skipped with a warning naming it and why, and the
  newest valid one is used; none valid is one error. An explicit step is never replaced.
- Retention (`prune`): after a checkpoint is complete and named in `latest`, keep the newest
  checkpoint.keep_last and every multiple of checkpoint.keep_every; never the newest one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from gptrain.checkpoint import folder
from gptrain.errors import UserError, first_line


def resume_point(run_dir: str | Path, resume: str) -> tuple[Path | None, list[str]]:
    """checkpoint.resume → (the checkpoint to continue from or None to start fresh, warnings).

    auto: the newest valid one when there is one; latest: it must exist; none: start fresh, refused
    when the run directory already has checkpoints (never overwrite a run); a number: that step
    (refused if damaged). Under auto and latest a newest checkpoint that is incomplete or fails its
    hashes is skipped, with a warning naming it and why, for the next older one; none valid is an
    error listing each one's problem."""
    folders = candidates(run_dir)
    if resume == "none":
        if folders:
            raise UserError(
                f"run.dir {run_dir} already has checkpoints (newest {folders[0].name}) and checkpoint.resume = 'none'; choose a new --run.dir or resume with --checkpoint.resume=auto"
            )
        return None, []
    if resume not in ("auto", "latest"):
        path = folder.find(run_dir, int(resume))
        why = problem(path)
        if why:
            raise UserError(
                f"checkpoint {path}: {why}; restore it or choose another --checkpoint.resume"
            )
        return path, []
    skipped = []
    for path in folders:
        why = problem(path)
        if why is None:
            return path, [f"skipped checkpoint {p}: {w}" for p, w in skipped]
        skipped.append((path, why))
    if skipped:
        raise UserError(
            f"no valid checkpoint in {Path(run_dir) / 'checkpoints'}: "
            + "; ".join(f"{p.name}: {w}" for p, w in skipped)
            + "; restore one, or start a new --run.dir"
        )
    if resume == "latest":
        folder.find(run_dir)  # raises: there is none
    return None, []


def _step_of(name: str) -> int | None:
    """step_00000100 (or its moved copy .old-step_00000100) -> 100; None for other names."""
    name = name.removeprefix(".old-")
    digits = name.removeprefix(folder.STEP_PREFIX)
    return int(digits) if name.startswith(folder.STEP_PREFIX) and digits.isdigit() else None


def candidates(run_dir: str | Path) -> list[Path]:
    """Checkpoint folders to resume from, newest first: the one `latest` names (or its moved copy,
    see save), then every folder of an earlier step. Folders of later steps than `latest` belong to
    a timeline that a resume from an earlier step abandoned and are not candidates."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    steps = {
        s: p
        for p in root.iterdir()
        if (s := _step_of(p.name)) is not None and p.name.startswith(folder.STEP_PREFIX)
    }
    named = folder.pointer(root)
    top = _step_of(named) if named else None
    if top is None:
        return [steps[s] for s in sorted(steps, reverse=True)]
    first = root / named
    if not first.exists() and (root / f".old-{named}").exists():
        first = root / f".old-{named}"  # killed between the two renames of a re-save
    return [first] + [steps[s] for s in sorted(steps, reverse=True) if s < top]


def problem(path: Path) -> str | None:
    """Why a checkpoint folder cannot be resumed (incomplete, unreadable meta.json, a file whose
    size or sha256 differs from meta.json), or None when it is valid."""
    if not path.is_dir():
        return "missing"
    if not (path / "meta.json").is_file():
        return "incomplete (no meta.json)"
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as e:
        return f"cannot read meta.json ({first_line(e)})"
    sharded = isinstance(meta, dict) and meta.get("layout") == "dcp"  # FSDP2 shards (sharded.py)
    for name in (".metadata" if sharded else "model.safetensors", "state.pt"):
        if not (path / name).is_file():
            return f"incomplete (no {name})"
    files = meta.get("files", {}) if isinstance(meta, dict) else None
    if not isinstance(files, dict) or not all(
        isinstance(v, dict) and {"bytes", "sha256"} <= v.keys() for v in files.values()
    ):
        return "meta.json is malformed (no valid file records)"
    for name, want in files.items():
        try:
            folder.verify_file(path / name, meta)
        except UserError:
            got = (path / name).stat().st_size if (path / name).is_file() else -1
            same = "; its sha256 differs" if got == want["bytes"] else ""
            return f"{name} is damaged ({got} bytes, meta.json recorded {want['bytes']}{same})"
    return None


def prune(
    run_dir: str | Path, newest: int, keep_last: int, keep_every: int, protect=frozenset()
) -> list[str]:
    """Retention after checkpoint `newest` was written and named in `latest`: of the folders of
    steps <= newest, keep the newest keep_last (newest among them) and every step that is a
    multiple of keep_every (when > 0); delete the rest, each renamed away first so that no
    half-deleted folder is ever visible. Leftovers of interrupted saves go too. Folders named in
    `protect` (the one the mirror is uploading) are kept. Returns the deleted names."""
    root = Path(run_dir) / "checkpoints"
    for p in root.glob(".old-*"):  # a re-save interrupted between its renames: keep the copy
        if not (root / p.name.removeprefix(".old-")).exists() and _step_of(p.name) is not None:
            os.replace(p, root / p.name.removeprefix(".old-"))
    steps = sorted(
        s
        for p in root.glob(f"{folder.STEP_PREFIX}*")
        if (s := _step_of(p.name)) is not None and s <= newest
    )
    keep = set(steps[-keep_last:]) | {newest} | {_step_of(n) for n in protect}
    keep |= {s for s in steps if keep_every > 0 and s % keep_every == 0}
    deleted = []
    for s in steps:
        if s not in keep:
            gone = root / f".del-{folder.step_dir_name(s)}"
            os.replace(root / folder.step_dir_name(s), gone)
            deleted.append(folder.step_dir_name(s))
    for p in [*root.glob(".del-*"), *root.glob(".tmp-*"), *root.glob(".old-*")]:
        shutil.rmtree(p, ignore_errors=True)
    return deleted

"""Which checkpoint folders count: the one to resume from, and the ones to keep.

- Timelines: `checkpoint.resume = STEP` starts a new timeline from that step's checkpoint; the
  checkpoints after it belong to the timeline it left, and resume never returns to them. The run's
  timeline is recorded in checkpoints/timeline.json (written by `begin` once start-up succeeded)
  and in each checkpoint's meta.json (with its ancestors and the step each was left at). The same
  command requeued continues the new timeline instead of going back to STEP, also when keys that
  cannot change training differ (config/identity.py: endpoints, node counts, logging, ...).
- Fallback (`resume_point`): under checkpoint.resume = auto or latest, a newest checkpoint that is
  incomplete, truncated or fails its hashes is skipped with a warning naming it and why, and the
  newest valid one of the timeline is used; none valid is one error. An explicit step is never
  replaced.
- Retention (`kept`, `prune`): after a checkpoint is complete and named in `latest`, keep the
  newest checkpoint.keep_last of the run's timeline and every multiple of checkpoint.keep_every;
  never the newest one. Abandoned timelines' checkpoints only fill slots the run's leaves free.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import tomllib
from dataclasses import dataclass
from pathlib import Path

from gptrain.checkpoint import folder
from gptrain.config.identity import same_training, training_identity, training_keys
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


@dataclass
class Plan:
    """What a start resumes: the checkpoint (None: start fresh), warnings (checkpoints skipped,
    mirror downloads), the timeline the run trains on, whether it branches there (a resume =
    STEP acted on now) and the line that says what resume = STEP did ("" otherwise)."""

    path: Path | None
    warnings: list[str]
    timeline: dict
    branch: bool = False
    line: str = ""


def identities(command: str) -> dict:
    """What a timeline record keeps of the config that started it: `command`, a hash of the whole
    resolved config, `training`, a hash of the keys that can change training, and those keys
    themselves, `keys` (config/identity.py)."""
    whole = hashlib.sha256(command.encode()).hexdigest()[:16]
    try:
        keys = training_keys(command)
    except tomllib.TOMLDecodeError:  # not a resolved config: only the whole text identifies it
        return {"command": whole, "training": whole}
    return {"command": whole, "training": training_identity(command), "keys": keys}


def trains_alike(record: dict, ids: dict) -> bool:
    """Whether a timeline record's config and `ids` (identities) train the same run: by their
    keys (a key added to gptrain since the record, at its default, is no difference), or, for a
    record of a gptrain that kept only the hash, by that hash."""
    saved = record.get("keys")
    if isinstance(saved, dict) and "keys" in ids:
        return same_training(saved, ids["keys"])
    return ids["training"] == record.get("training")


def plan(run_dir: str | Path, resume: str, command: str) -> Plan:
    """checkpoint.resume -> a Plan; writes nothing (begin() does, once start-up succeeded).

    auto, latest, none: as resume_point, on the run's timeline. A step number acts once: the
    first time it starts a new timeline from that step's checkpoint (of any timeline); when the
    run's timeline (or one of its ancestors) was already started from that step with the same
    training config (keys that cannot change training may differ: a requeued job on other nodes),
    it continues that timeline from its newest valid checkpoint instead."""
    root = Path(run_dir) / "checkpoints"
    now = current(root)
    ids = identities(command)
    if resume in ("auto", "latest", "none"):
        path, warnings = resume_point(run_dir, resume)
        t = now if now is not None and path is not None else None
        if t is None and path is not None:
            t = timeline_of(path)
        if not isinstance(t, dict):  # a fresh start, or a checkpoint of an older gptrain
            until = [] if path is None else [{"id": "", "until": _step_of(path.name)}]
            t = {"id": secrets.token_hex(6), "from_step": None, **ids, "ancestors": until}
        return Plan(path, warnings, t)
    step = int(resume)
    started = (
        [] if now is None else [a for a in [now, *now["ancestors"]] if a.get("from_step") == step]
    )
    same = [a for a in started if ids["command"] == a.get("command")]
    if same or any(trains_alike(a, ids) for a in started):
        path, warnings = resume_point(run_dir, "latest")
        how = "config" if same else "training config (the keys that differ cannot change training)"
        line = f"checkpoint.resume = {step} already started this timeline with the same {how}: continuing it from {path.name}, not going back to step {step} (a run with other training settings branches from step {step} again)"
        return Plan(path, warnings, now, line=line)
    return _branch(run_dir, step, ids, again=bool(started))


def _branch(run_dir, step: int, ids: dict, again: bool = False) -> Plan:
    """A new timeline from the checkpoint of `step`, whichever timeline it belongs to."""
    root = Path(run_dir) / "checkpoints"
    if not (root / folder.step_dir_name(step) / "meta.json").is_file():
        have = sorted(
            s for p in root.glob(f"{folder.STEP_PREFIX}*") if (s := _step_of(p.name)) is not None
        )
        raise UserError(
            f"checkpoint.resume = {step}: no checkpoint of step {step} in {root} (steps there: {', '.join(map(str, have)) or 'none'}); choose one of them, or resume = auto"
        )
    path, _ = resume_point(run_dir, str(step))  # refused when damaged
    parent = timeline_of(path)
    parent = parent if isinstance(parent, dict) else {"id": "", "ancestors": []}
    head = {k: parent.get(k) for k in ("id", "from_step", "command", "training")}
    head |= {"keys": parent["keys"]} if "keys" in parent else {}
    t = {"id": secrets.token_hex(6), "from_step": step, **ids}
    t["ancestors"] = [*parent["ancestors"], {**head, "until": step}]
    left = [p.name for p in candidates(run_dir) if _step_of(p.name) > step]
    line = f"checkpoint.resume = {step}: a new timeline starts from {path.name}"
    if again:
        line += f" (the timeline step {step} started before has other training settings: it is left as well)"
    if left:
        line += f"; the checkpoints after it ({', '.join(reversed(left))}) stay on the timeline it leaves: resume = auto will not return to them"
    return Plan(
        path,
        [],
        t,
        branch=True,
        line=line + "; requeued, the same command continues the new timeline",
    )


def begin(run_dir: str | Path, p: Plan) -> None:
    """Main process, once start-up succeeded: the run's timeline recorded in timeline.json; a
    branch also points `latest` at the checkpoint it starts from (so that a crash before its first
    checkpoint resumes there, never on the timeline it left)."""
    root = Path(run_dir) / "checkpoints"
    if folder.read_timeline(root) != p.timeline:
        folder.write_timeline(root, p.timeline)
    if p.branch and folder.pointer(root) != p.path.name:
        folder.point_latest(root, p.path.name)


def _step_of(name: str) -> int | None:
    """step_00000100 (or its moved copy .old-step_00000100) -> 100; None for other names."""
    name = name.removeprefix(".old-")
    digits = name.removeprefix(folder.STEP_PREFIX)
    return int(digits) if name.startswith(folder.STEP_PREFIX) and digits.isdigit() else None


def candidates(run_dir: str | Path) -> list[Path]:
    """Checkpoint folders to resume from, newest first: those on the run's timeline (`current`):
    its own checkpoints and its ancestors' up to the step it continues from. Without any timeline
    record (checkpoints of an older gptrain): the one `latest` names (or its moved copy, see
    folder.publish), then every folder of an earlier step. Either way, folders of a timeline that a
    resume from an earlier step abandoned are not candidates."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    steps = {
        s: p
        for p in root.iterdir()
        if (s := _step_of(p.name)) is not None and p.name.startswith(folder.STEP_PREFIX)
    }
    named = folder.pointer(root)
    top = _step_of(named) if folder.is_step_name(named) else None
    if top is not None and top not in steps and (root / f".old-{named}").exists():
        steps[top] = root / f".old-{named}"  # killed between the two renames of a re-save
    now = current(root)
    if now is None:
        return [steps[s] for s in sorted(steps, reverse=True) if top is None or s <= top]
    return [steps[s] for s in sorted(steps, reverse=True) if on_timeline(now, steps[s], s, top)]


def current(root: Path) -> dict | None:
    """The timeline the run trains on: timeline.json, else the one of the checkpoint `latest`
    names; None for a run directory of an older gptrain (no timeline recorded anywhere)."""
    t = folder.read_timeline(root)
    named = folder.pointer(root)
    if t is None and folder.is_step_name(named):
        t = timeline_of(root / named)
    return t if isinstance(t, dict) else None


def timeline_of(path: Path):
    """The timeline recorded in a checkpoint's meta.json: a dict, None for a checkpoint of an
    older gptrain (no timeline), or "?" when meta.json cannot be read."""
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return "?"
    t = meta.get("timeline") if isinstance(meta, dict) else "?"
    return t if t is None or folder.valid_timeline(t) else "?"


def in_history(now: dict, timeline: dict | None, step: int) -> bool:
    """Whether a checkpoint of `timeline` (None: of an older gptrain) at `step` is part of the
    history of timeline `now`: one of its own, or an ancestor's up to the step `now` continues."""
    tid = "" if timeline is None else timeline["id"]
    return tid == now["id"] or any(a["id"] == tid and step <= a["until"] for a in now["ancestors"])


def on_timeline(now: dict, path: Path, step: int, top: int | None) -> bool:
    t = timeline_of(path)
    if t == "?":  # unreadable: a candidate (skipped as damaged) unless newer than `latest`
        return top is None or step <= top
    return in_history(now, t, step)


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


def kept(folders: dict, now: dict | None, newest: int, keep_last: int, keep_every: int) -> set[int]:
    """The steps retention keeps after checkpoint `newest` was published, of `folders`: {step: its
    timeline (timeline_of: a dict, None for an older gptrain's, "?" unreadable)}; `now`: the run's
    timeline (None: none recorded). Local and mirror retention both ask this.

    - keep_last counts only the run's timeline (its own checkpoints and its ancestors' up to the
      step it continues, steps <= newest; an unreadable folder counts as one of them): its newest
      keep_last are kept, `newest` always.
    - A folder of an abandoned timeline (left by a resume = STEP) never takes the place of one of
      the run's: abandoned folders are kept, newest first, only in the keep_last slots the run's
      timeline does not fill yet; the others are deleted.
    - Every step that is a multiple of keep_every (> 0) is kept, whichever timeline.
    - Folders of the run's timeline after `newest` (damaged ones it resumed past) stay until it
      saves those steps again; without a timeline record every folder after `newest` stays."""

    def mine(s: int) -> bool:
        t = folders[s]
        return now is None or t == "?" or in_history(now, t, s)

    own = sorted(s for s in folders if s <= newest and mine(s))
    ahead = {s for s in folders if s > newest and (now is None or mine(s))}
    left = sorted(s for s in folders if s not in ahead and not (s <= newest and mine(s)))
    keep = {newest, *ahead, *own[-keep_last:]}
    spare = keep_last - len(own[-keep_last:])
    keep |= set(left[len(left) - spare :] if spare > 0 else [])
    return keep | {s for s in folders if keep_every > 0 and s % keep_every == 0}


def prune(
    run_dir: str | Path, newest: int, keep_last: int, keep_every: int, protect=frozenset()
) -> list[str]:
    """Retention after checkpoint `newest` was written and named in `latest`: the folders `kept`
    says stay; the rest are deleted, each renamed away first so that no half-deleted folder is
    ever visible. Leftovers of interrupted saves go too. Folders named in `protect` (the one the
    mirror is uploading) are kept. Returns the deleted names."""
    root = Path(run_dir) / "checkpoints"
    for p in root.glob(".old-*"):  # a re-save interrupted between its renames: keep the copy
        if not (root / p.name.removeprefix(".old-")).exists() and _step_of(p.name) is not None:
            os.replace(p, root / p.name.removeprefix(".old-"))
    folders = {
        s: timeline_of(p)
        for p in root.glob(f"{folder.STEP_PREFIX}*")
        if (s := _step_of(p.name)) is not None
    }
    keep = kept(folders, current(root), newest, keep_last, keep_every)
    keep |= {_step_of(n) for n in protect}
    deleted = []
    for s in sorted(folders):
        if s not in keep:
            gone = root / f".del-{folder.step_dir_name(s)}"
            os.replace(root / folder.step_dir_name(s), gone)
            deleted.append(folder.step_dir_name(s))
    for p in [*root.glob(".del-*"), *root.glob(".tmp-*"), *root.glob(".old-*")]:
        shutil.rmtree(p, ignore_errors=True)
    return deleted

"""The restart ledger, run.dir/attempts.jsonl, and the crash-loop stop (run.max_failed_attempts).

Every start of `gptrain train` appends one JSON line, every end that the process lives to see
another (the main process writes them; only it owns run.dir):

    {"event": "start", "attempt": 3, "time": ..., "hosts": ["node0", "node1"], "world_size": 16,
     "start_step": 400, "last_checkpoint": "step_00000400", "max_failed_attempts": 3}
    {"event": "signal", "attempt": 3, "time": ..., "signal": "SIGTERM"}      (preemption notice)
    {"event": "progress", "attempt": 3, "time": ..., "step": 420, ...}        (after each save)
    {"event": "end", "attempt": 3, "time": ..., "exit": "preempted", "code": 0, "step": 431,
     "last_checkpoint": "step_00000431", "reason": "...", "startup_s": ..., "step_s": ...}

Progress and end lines carry the attempt's time accounting (the watchdog's phase totals), from
which `goodput` (summary.json) is computed across all attempts.

`exit` is finished, preempted, interrupted (Ctrl-C), hung (the watchdog, code 3), stopped (the
non-finite or spike policy), error (code 1), bad input (code 2) or crash loop (code 4). A start
with no end line died without a word (a segfault, an OOM kill, SIGKILL, `crash`).

An attempt *failed* when it ended without a new checkpoint (the checkpoint `latest` names at the
next start is the one it started from) and was not finished, preempted (a signal line, or exit
preempted: a preemption never counts, even when the grace period was too short to save),
interrupted by a person, refused for bad input (which the Slurm recipe does not requeue), or a
crash-loop refusal. When the last run.max_failed_attempts attempts each failed, the next start
writes its refusal and raises CrashLoop (exit 4, "do not requeue") before loading anything. A
start with run.max_failed_attempts = 0 checks nothing, and the count begins again after it.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import torch

from gptrain.cache import atomic_write_bytes
from gptrain.checkpoint import manager as checkpoint
from gptrain.config.sections import RunConfig
from gptrain.distributed import runtime as dist
from gptrain.distributed.failures import EXIT_DIVERGED, ReplicaMismatch
from gptrain.distributed.watchdog import EVAL_PHASES
from gptrain.errors import UserError, first_line
from gptrain.training.guards import NonFiniteStop

LEDGER = "attempts.jsonl"
EXIT_CRASH_LOOP = 4
NEVER_FAILED = ("finished", "preempted", "interrupted", "bad input", "crash loop")


class CrashLoop(Exception):
    """The last run.max_failed_attempts starts each ended without a new checkpoint: exit 4."""

    exit_code = EXIT_CRASH_LOOP


def read(run_dir: str | Path) -> list[dict]:
    """The attempts in attempts.jsonl, oldest first: {"attempt", "start", "signal", "end"}
    (a line cut short by a crash is skipped)."""
    path = Path(run_dir) / LEDGER
    attempts: dict[int, dict] = {}
    lines = path.read_text().splitlines() if path.is_file() else []
    for line in lines:
        try:
            row = json.loads(line)
            n, event = int(row["attempt"]), row["event"]
        except (ValueError, KeyError, TypeError):
            continue
        a = attempts.setdefault(
            n, {"attempt": n, "start": None, "signal": None, "end": None, "progress": None}
        )
        a[event] = row
    return [attempts[n] for n in sorted(attempts) if attempts[n]["start"] is not None]


def outcome(a: dict) -> str:
    """How an attempt ended, in words: its exit, or how it must have ended."""
    if a["end"] is not None:
        return a["end"]["exit"]
    return "preempted" if a["signal"] else "died (no exit recorded)"


def failed_streak(attempts: list[dict], latest_now: str) -> list[dict]:
    """The newest attempts that each failed (see the module's docstring), newest first; stops at
    an attempt that did not fail and after one that was started with the check off."""
    streak = []
    after = latest_now  # what `latest` named when the attempt after this one started
    for a in reversed(attempts):
        start = a["start"]
        refused = outcome(a) == "crash loop"
        progressed = (start.get("last_checkpoint") or "") != after
        after = start.get("last_checkpoint") or ""
        if refused:
            continue  # a refusal is not an attempt: look past it
        if outcome(a) in NEVER_FAILED or progressed:
            break
        streak.append(a)
        if start.get("max_failed_attempts") == 0:
            break
    return streak


def describe(a: dict) -> str:
    end = a["end"] or {}
    where = f" at step {end['step']}" if end.get("step") is not None else ""
    why = f": {end['reason']}" if end.get("reason") else ""
    return f"attempt {a['attempt']} {outcome(a)}{where}{why}"[:200]


class Ledger:
    """This start's lines in attempts.jsonl (main process; a no-op elsewhere). A context:
    entering it records the start or refuses it (CrashLoop, every rank); leaving it records the
    end from the exception that left (or `outcome`, default finished). `undo()` before training
    begins (bad input): the start line, and the file or run.dir if it made them, are removed."""

    def __init__(self, run_cfg: RunConfig, info: dist.DistInfo, watchdog=None) -> None:
        self.run_dir, self.limit, self.info = Path(run_cfg.dir), run_cfg.max_failed_attempts, info
        self.path = self.run_dir / LEDGER
        self.attempt, self.outcome, self.run = 0, "finished", None  # run: its step at the end
        self.watchdog = watchdog  # its phase totals are this attempt's time accounting (goodput)
        self.resumed_step = 0  # the step this attempt started training from
        self.training = False  # set once start-up succeeded: a bad input after it is recorded
        self._undo = None
        self._ended = False

    def started(self, state) -> None:
        """Start-up succeeded: training begins at `state.step` (a bad input after this is a
        failed attempt, no longer undone)."""
        self.run, self.training, self.resumed_step = state, True, state.step

    def __enter__(self) -> Ledger:
        host = socket.gethostname()
        hosts = [host] * self.info.world_size
        if dist.active():
            torch.distributed.all_gather_object(hosts, host)
        self.attempt, refusal = dist.from_main(self.info, lambda: self._begin(hosts))
        if refusal:
            raise CrashLoop(refusal)
        return self

    def _begin(self, hosts: list[str]) -> tuple[int, str | None]:
        try:
            return self._check_and_record(hosts)
        except OSError as e:
            raise UserError(
                f"run.dir = {str(self.run_dir)!r}: cannot write {LEDGER} ({first_line(e)}); use a writable run.dir"
            ) from None

    def _check_and_record(self, hosts: list[str]) -> tuple[int, str | None]:
        attempts = read(self.run_dir)
        latest = checkpoint.pointer(self.run_dir / "checkpoints")
        made_dir = not self.run_dir.exists()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        size = self.path.stat().st_size if self.path.exists() else None
        self._undo = (made_dir, size)
        self.attempt = (attempts[-1]["attempt"] if attempts else 0) + 1
        step = int(latest.removeprefix("step_")) if latest.startswith("step_") else 0
        self._write(
            event="start",
            time=self.watchdog.born if self.watchdog else time.time(),
            hosts=list(dict.fromkeys(hosts)),
            world_size=self.info.world_size,
            start_step=step,
            last_checkpoint=latest or None,
            max_failed_attempts=self.limit,
        )
        streak = failed_streak(attempts, latest) if self.limit > 0 else []
        if len(streak) < self.limit or self.limit == 0:
            return self.attempt, None
        reason = (
            f"{self.run_dir}: the last {len(streak)} starts each ended without a new checkpoint "
            f"({'; '.join(describe(a) for a in reversed(streak))}; run.max_failed_attempts = {self.limit}); "
            f"stopped before training, exit {EXIT_CRASH_LOOP}: do not requeue. Fix the cause, then start once with "
            f"--run.max_failed_attempts=0 (the count starts again after it); the history is in {self.path}"
        )
        self._end("crash loop", EXIT_CRASH_LOOP, reason)
        return self.attempt, reason

    def __exit__(self, kind, e, tb) -> None:
        if kind is None:
            self._end(self.outcome, 0)
        elif isinstance(e, CrashLoop):
            pass  # recorded by _begin
        elif isinstance(e, checkpoint.LockLost):
            pass  # run.dir is another job's now: its ledger is not this attempt's to write
        elif isinstance(e, UserError) and not self.training:
            self.undo()  # bad input before training: nothing written
        elif isinstance(e, UserError):
            self._end("bad input", 2, first_line(e))
        elif isinstance(e, KeyboardInterrupt):
            self._end("interrupted", 130)
        elif isinstance(e, ReplicaMismatch):
            self._end("diverged", EXIT_DIVERGED, first_line(e))
        else:
            self._end("stopped" if isinstance(e, NonFiniteStop) else "error", 1, first_line(e))

    def hung(self, line: str) -> None:
        """The watchdog's expiry (from its thread)."""
        self._end("hung", 3, line)

    def signal(self, name: str) -> None:
        """A preemption signal arrived (from the signal handler): never counted as a failure."""
        if self.info.is_main and self.attempt:
            self._write(event="signal", signal=name)

    def undo(self) -> None:
        if not self.info.is_main or self._undo is None:
            return
        made_dir, size = self._undo
        if size is None:
            self.path.unlink(missing_ok=True)
        else:
            os.truncate(self.path, size)
        if made_dir and not any(self.run_dir.iterdir()):
            self.run_dir.rmdir()
        self._undo, self._ended = None, True

    def _end(self, exit: str, code: int, reason: str = "") -> None:
        if not self.info.is_main or self._ended or not self.attempt:
            return
        self._ended = True
        latest = checkpoint.pointer(self.run_dir / "checkpoints") or None
        self._write(
            event="end",
            exit=exit,
            code=code,
            last_checkpoint=latest,
            reason=reason,
            **self.accounting(),
        )

    def progress(self) -> None:
        """After a save: this attempt's accounting so far, for goodput if it later dies unheard."""
        if self.info.is_main and self.attempt:
            self._write(event="progress", **self.accounting())

    def accounting(self) -> dict:
        """Where this attempt's time went so far (seconds), from the watchdog's phase totals."""
        wd, step = self.watchdog, getattr(self.run, "step", None)
        if wd is None or step is None:  # ended before training began: nothing to account
            return {"step": step}
        t = wd.totals
        return {
            "step": step,
            "resumed_step": self.resumed_step,
            "steps_trained": wd.counts["step"],
            "startup_s": t["start"],
            "step_s": t["step"],
            "first_step_s": wd.first_step_s,
            "save_s": t["save"] + t["rollback"] + t["upload"],
            "eval_s": sum(t[p] for p in EVAL_PHASES),
        }

    def add_goodput(self, summary: dict, logger) -> None:
        """Main process, at the end: the goodput across every attempt in the ledger (this one up
        to now) into summary.json, and one line in train.log."""
        if not self.info.is_main or not self.attempt:
            return
        rows = read(self.run_dir)
        rows[-1]["end"] = {"time": time.time(), **self.accounting()}  # this attempt, live
        g = summary["goodput"] = goodput(rows)
        atomic_write_bytes(self.run_dir / "summary.json", json.dumps(summary, indent=2).encode())
        lost = ", ".join(f"{k.removesuffix('_s')} {g[k]:.0f} s" for k in (*PARTS, "other_s"))
        logger.text(
            f"goodput {g['goodput']:.1%} of {g['wall_s']:.0f} s over {g['attempts']} attempt(s) ({lost})"
        )

    def _write(self, **row) -> None:
        row = {
            "event": row.pop("event"),
            "attempt": self.attempt,
            "time": row.pop("time", time.time()),
            **row,
        }
        line = json.dumps(row)
        with open(self.path, "a") as f:
            f.write(line + "\n")


PARTS = ("startup_s", "compile_s", "save_s", "eval_s", "recomputed_s", "gaps_s")


def goodput(attempts: list[dict]) -> dict:
    """Productive step time over wall time across the attempts (their last accounting each: the
    end line, else the last progress line), with where the rest went:

    - wall: from the first start to the last attempt's last accounting;
    - productive: the steps that are in the final model, each once, at its attempt's steady step
      time (the first step of an attempt counts as one steady step; the rest of it is compile);
    - startup, compile, save (blocking), eval (and samples);
    - recomputed: steps trained again (after a crash or a rollback);
    - gaps: between an attempt's last accounting and the next start (queueing, restarting, and for
      an attempt that died unheard, its time after its last checkpoint);
    - other: what no phase covers (logging, the final plot)."""
    out = dict.fromkeys(("productive_s", *PARTS), 0.0)
    for i, a in enumerate(attempts):
        r = a["end"] if a["end"] and "step_s" in a["end"] else a.get("progress")
        nxt = attempts[i + 1] if i + 1 < len(attempts) else None
        known = a["start"]["time"]
        if r is not None and "step_s" in r:
            known = r["time"]
            n, steps_s, first = r["steps_trained"], r["step_s"], r["first_step_s"]
            per = (steps_s - first) / (n - 1) if n > 1 else steps_s
            compile_s = max(first - per, 0.0) if n > 0 else 0.0
            steady = steps_s - compile_s
            until = r["step"] if nxt is None else min(r["step"], _resumed(nxt))
            productive = min(max(until - r["resumed_step"], 0) * per, steady)
            out["productive_s"] += productive
            out["recomputed_s"] += steady - productive
            out["compile_s"] += compile_s
            for key in ("startup_s", "save_s", "eval_s"):
                out[key] += r[key]
        if nxt is not None:
            out["gaps_s"] += max(nxt["start"]["time"] - known, 0.0)
    wall = max(known - attempts[0]["start"]["time"], 1e-9) if attempts else 1e-9
    out["other_s"] = max(wall - sum(out.values()), 0.0)
    out = {k: round(v, 3) for k, v in out.items()}
    return {
        "goodput": round(out["productive_s"] / wall, 4),
        "wall_s": round(wall, 3),
        **out,
        "attempts": len(attempts),
    }


def _resumed(a: dict) -> int:
    """The step an attempt resumed from: its own accounting's, else what `latest` named."""
    for r in (a.get("progress"), a["end"]):
        if r and "resumed_step" in r:
            return r["resumed_step"]
    return a["start"].get("start_step") or 0

"""A run folder has one owner: `with RunLock(folder, "gptrain train"): ...`.

The lock is FOLDER/.lock, JSON {host, pid, what, started, heartbeat, beats, mono, boot, job,
token}, created whole (a complete file hard-linked into place) and rewritten by a background
thread every HEARTBEAT_S (`beats` counts the rewrites, `mono` is this host's monotonic clock).
Another job finds it and stops with one line (UserError, exit 2) unless its holder has stopped:

- same host (same boot, pid and time namespaces): its pid is not running, or it runs but `mono`
  is more than STALE_S old on this host's clock (another program has that pid, or a frozen job);
- otherwise (another host or container, this host restarted): the lock does not change for
  STALE_S watched on this host's monotonic clock (read every POLL_S; any change: a live holder,
  refused). The other host's timestamps are never compared with ours: clock skew cannot make a
  live lock look stale. An earlier round of this multi-node job is watched for ROUND_STALE_S
  (torch's agents stop every worker before a round re-forms); a reused rendezvous id never takes
  over a lock whose heartbeat moves;
- its content is not a lock (malformed).

A stale lock is taken over with one warning line (host, pid, why), safely without flock too:
the taker creates FOLDER/.lock.claim-HASH-N (HASH: of the stale content it judged; a hard link,
so one starter gets it), re-reads the lock (changed: judged again), replaces it, re-reads it for
its own token and removes its claims. A rival finding the claim waits for the lock to change
and judges again (the new holder is live: its refusal); a claim whose lock does not change for
CLAIM_WAIT_S (its taker died) is passed over for N + 1. The job taken over (alive after all) writes
no more there: its heartbeat notices and calls `on_lost` (the loop stops at the next step
boundary), and a checkpoint it would publish is refused (`check_folder`, from
checkpoint/folder.py): `LockLost`, one line, exit 2. Every change of the lock also holds flock on
the folder where the filesystem has it; the watching does not.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import json
import os
import secrets
import socket
import sys
import threading
import time
from pathlib import Path

from gptrain.errors import UserError, first_line

LOCK = ".lock"
CLAIM = ".lock.claim-"  # a takeover's claim: CLAIM + HASH-N
HEARTBEAT_S = 10.0  # how often the holder rewrites the lock
STALE_S = 60.0  # a heartbeat that has not moved for this long: its holder stopped
ROUND_STALE_S = 30.0  # the same for a lock of an earlier round of this job (three beats)
POLL_S = 0.5  # how often a watched lock is read
CLAIM_WAIT_S = 10.0  # a claim whose lock has not changed for this long: its taker died
GUARD_WAIT_S = 10.0  # the longest wait for flock on the folder (held for milliseconds)
JOB_ENV = "GPTRAIN_JOB"  # RDZV_ID@ENDPOINT, exported by distributed/launch.py to its workers

_monotonic = time.monotonic  # this host's own clock for watching (a test may replace both)
_sleep = time.sleep


class LockLost(UserError):
    """Another job took over the lock of a folder this process held: this one writes no more."""


_held: list[RunLock] = []  # the locks this process holds now (check_folder)


def check_folder(path: str | Path) -> None:
    """LockLost when `path` is in a folder whose lock this process held and another job took
    over; nothing for a folder this process holds no lock on."""
    path = Path(path).absolute()
    for held in list(_held):
        if path == held.folder.absolute() or held.folder.absolute() in path.parents:
            held.check()


def _boot_id() -> str:
    """Where a pid and the monotonic clock mean something (Linux): this boot of the machine, this
    pid namespace and this time namespace (two containers may share a host name); "" elsewhere."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        spaces = [os.readlink(f"/proc/self/ns/{ns}") for ns in ("pid", "time") if os.path.exists(f"/proc/self/ns/{ns}")]  # fmt: skip
        return " ".join([boot, *spaces])
    except OSError:
        return ""


def _pid_running(pid: int) -> bool:
    try:
        with contextlib.suppress(PermissionError):  # another user's process runs too
            os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


@contextlib.contextmanager
def _guard(folder: Path):
    """flock on the folder for one change of the lock; given up after GUARD_WAIT_S (a holder that
    is stopped mid-change) or where the filesystem has no flock: the claims keep it safe."""
    try:
        import fcntl

        fd = os.open(folder, os.O_RDONLY)
    except (ImportError, OSError):
        yield
        return
    try:
        deadline = time.monotonic() + GUARD_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            except OSError:  # no flock on this filesystem
                break
        yield
    finally:
        os.close(fd)  # releases the flock


def _job() -> str:
    """The multi-node job this process is a worker of ("" outside one): gptrain's launcher
    exports its rendezvous id and endpoint; under torchrun alone, torch's rendezvous id (unless
    left at torchrun's default, "none", which many jobs share)."""
    job = os.environ.get(JOB_ENV, "")
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return job or (run_id if run_id not in ("", "none") else "")


def local_verdict(holder: dict) -> str | None:
    """A lock taken on this host (this boot): why its holder has stopped, None while it runs."""
    pid, host = holder["pid"], holder["host"]
    if not _pid_running(pid):
        return f"pid {pid} is not running on {host}"
    # this host's monotonic clock (wall-clock steps do not count); the wall clock where none
    mono, age = holder["mono"], time.time() - holder["heartbeat"]
    age = age if mono is None else _monotonic() - mono
    if age <= STALE_S:
        return None
    return f"pid {pid} is running on {host} but the lock's heartbeat stopped {age:.0f} s ago (stale after {STALE_S:.0f} s): another program has that pid now, or the job is frozen"  # fmt: skip


def parse(raw: bytes) -> dict | None:
    """A lock's content, None when it is not a lock (malformed)."""
    try:
        d = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    types = {"host": str, "pid": int, "what": str, "started": float, "heartbeat": float}
    if not isinstance(d, dict) or not all(
        isinstance(d.get(k), t) or (t is float and isinstance(d.get(k), int))
        for k, t in types.items()
    ):
        return None
    extra = {k: str(d.get(k, "")) for k in ("boot", "token", "job")}
    mono = d.get("mono")
    extra["mono"] = float(mono) if isinstance(mono, int | float) else None
    return {**d, **extra}


def read(path: Path) -> dict | None:
    """The lock's content, None when it is not a lock (malformed); FileNotFoundError when absent."""
    return parse(path.read_bytes())


class RunLock:
    """The exclusive lock of a run folder (created if needed) for the `with` block; see the module
    docstring. `what` names the command in the refusal another job prints."""

    def __init__(self, folder: str | Path, what: str):
        self.folder = Path(folder)
        self.path = self.folder / LOCK
        self.what = what
        self.token = ""
        self.beats = 0
        self.lost: str | None = None  # the line saying another job took the lock over
        self.on_lost = None  # called once with that line, from the heartbeat's thread
        self._losing = threading.Lock()  # the heartbeat and a publish may both notice
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _content(self, started: float) -> bytes:
        me = {"host": socket.gethostname(), "pid": os.getpid(), "what": self.what}
        me |= {"started": started, "heartbeat": time.time(), "beats": self.beats}
        me |= {"mono": _monotonic(), "boot": _boot_id(), "job": _job()}
        return json.dumps({**me, "token": self.token}).encode()

    def _write_tmp(self, data: bytes) -> Path:
        tmp = self.folder / f"{LOCK}.tmp-{self.token}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def acquire(self) -> None:
        self.made = not self.folder.exists()
        self.token = secrets.token_hex(8)
        self.started = time.time()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._claim()
        except OSError as e:  # a folder that cannot be written: bad input, one line
            raise UserError(
                f"run folder {self.folder}: cannot take its lock {self.path.name} ({type(e).__name__}: {first_line(e)}); check that the folder can be written, or choose another folder"
            ) from None
        self.lost = None
        _held.append(self)
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="run-lock", daemon=True)
        self._thread.start()

    def _claim(self) -> None:
        """Create the lock, or take over one whose holder stopped; a UserError while another job
        holds it."""
        while True:
            with _guard(self.folder):
                if self._create():
                    return
            try:
                raw = self.path.read_bytes()
                holder = parse(raw)
                why = self._verdict(raw, holder)
                if why is None:  # named as it is now: it may have changed while watched
                    raise UserError(self.refusal(parse(self.path.read_bytes()) or holder))
                if self._take_over(raw, holder, why):
                    return
            except FileNotFoundError:
                continue  # released in between: try again

    def _verdict(self, raw: bytes, holder: dict | None) -> str | None:
        """Why the lock `raw` may be taken over, None while its holder runs (may watch it for
        up to STALE_S); FileNotFoundError when it is released meanwhile."""
        if holder is None:
            return "its content is not a lock"
        if holder["host"] == socket.gethostname() and holder["boot"] == _boot_id():
            return local_verdict(holder)
        limit = ROUND_STALE_S if holder["job"] and holder["job"] == _job() else STALE_S
        if self._changes(raw, limit):
            return None
        why = f"its heartbeat did not move for {limit:.0f} s, watched on this host's clock (a running job's moves every {HEARTBEAT_S:.0f} s)"  # fmt: skip
        if limit == ROUND_STALE_S:
            why = f"it was taken in an earlier round of this job ({holder['job']}), whose workers torch's agents stopped: {why}"  # fmt: skip
        return why

    def _changes(self, raw: bytes, limit_s: float) -> bool:
        """Whether the lock's content changes from `raw` within `limit_s` seconds of this host's
        monotonic clock (read every POLL_S); FileNotFoundError when it is removed."""
        start = _monotonic()
        while _monotonic() - start < limit_s:
            _sleep(POLL_S)
            if self.path.read_bytes() != raw:
                return True
        return False

    def _link(self, tmp: Path, dest: Path) -> bool:
        """`dest` created whole from `tmp` (a hard link); False when it exists."""
        try:
            os.link(tmp, dest)
            return True
        except FileExistsError:
            return False
        except OSError as e:  # no hard links here: exclusive create, written under the guard
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise
            try:
                fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(tmp.read_bytes())
            return True

    def _create(self) -> bool:
        """The lock created whole; False when it exists."""
        tmp = self._write_tmp(self._content(self.started))
        try:
            return self._link(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)

    def refusal(self, holder: dict) -> str:
        return (
            f"run folder {self.folder} is in use by {holder['what']} (host {holder['host']}, pid "
            f"{holder['pid']}, since {_when(holder['started'])}); wait for it or choose another folder"
        )

    def _take_over(self, raw: bytes, holder: dict | None, why: str) -> bool:
        """Take over the stale lock `raw`: True once it is this job's; False when it changed
        meanwhile (judge it again)."""
        name = f"{CLAIM}{hashlib.sha256(raw).hexdigest()[:16]}-"
        tmp = self._write_tmp(self._content(self.started))
        claimed = False
        try:
            for n in itertools.count():
                with _guard(self.folder):
                    if claimed := self._link(tmp, self.folder / f"{name}{n}"):
                        return self._replace(raw, holder, why, tmp)
                # another starter is taking it over: its lock comes within milliseconds; one
                # that does not come (that starter died) is passed over for the next claim
                if self._changes(raw, CLAIM_WAIT_S):
                    return False
        finally:
            tmp.unlink(missing_ok=True)
            if claimed:  # the lock is replaced (a late rival re-reads it): every claim of it goes
                for claim in self.folder.glob(f"{name}*"):
                    claim.unlink(missing_ok=True)

    def _replace(self, raw: bytes, holder: dict | None, why: str, tmp: Path) -> bool:
        """Holding the claim: replace the lock if it is still `raw`, then confirm it is ours."""
        if self.path.read_bytes() != raw:
            return False
        os.replace(tmp, self.path)
        if not self._mine():  # its holder wrote again after all: judged again
            return False
        who = "a malformed lock"
        if holder is not None:
            who = f"the lock of {holder['what']} (host {holder['host']}, pid {holder['pid']})"
        print(
            f"gptrain: warning: run folder {self.folder}: taking over {who}: {why}",
            file=sys.stderr,
            flush=True,
        )
        return True

    def _mine(self) -> bool:
        try:
            holder = read(self.path)
        except FileNotFoundError:
            return False
        return holder is not None and holder["token"] == self.token

    def check(self) -> None:
        """LockLost when another job holds this lock now (read under the folder's flock)."""
        if self.lost is None:
            with _guard(self.folder):
                if not self._mine():
                    self._lose()
        if self.lost is not None:
            raise LockLost(self.lost)

    def drill_take_over(self) -> None:
        """GPTRAIN_FAULT=lock_taken: another host's job takes the lock over, and this holder
        notices at once, as its next heartbeat would."""
        content = json.loads(self._content(self.started))
        content |= {"host": f"{socket.gethostname()}-drill", "what": "a drill's job"}
        content |= {"pid": 1, "token": secrets.token_hex(8), "job": ""}
        with _guard(self.folder):
            os.replace(self._write_tmp(json.dumps(content).encode()), self.path)
        self._lose()

    def _lose(self) -> None:
        """Record (once) that another job took the lock over; tell `on_lost`, else warn."""
        with self._losing:
            if self.lost is not None:
                return
            try:
                holder = read(self.path)
            except OSError:
                holder = None
            who = "another job"
            if holder is not None:
                who = f"{holder['what']} (host {holder['host']}, pid {holder['pid']})"
            self.lost = (
                f"run folder {self.folder}: {who} took over its lock while this job's heartbeat "
                "was late; this job stops and writes nothing more there (its checkpoints stay for "
                "that job); to go on with this one instead, stop that job and run the same command"
            )
        if self.on_lost is not None:  # it ends the job with the line
            self.on_lost(self.lost)
        else:
            print(f"gptrain: warning: {self.lost}", file=sys.stderr, flush=True)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                with _guard(self.folder):
                    if not self._mine():
                        self._lose()
                        return
                    self.beats += 1  # the content changes every beat: watchers see it move
                    os.replace(self._write_tmp(self._content(self.started)), self.path)
            except OSError as e:  # a filesystem hiccup: the next beat tries again
                print(f"gptrain: warning: run folder lock heartbeat: {e}", file=sys.stderr)

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still this process's; the folder too
        when the lock created it and nothing else was written there."""
        self._stop.set()
        if self in _held:
            _held.remove(self)
        if self._thread is not None:  # bounded: a beat stuck on the filesystem is left behind
            self._thread.join(timeout=GUARD_WAIT_S + 5)
            self._thread = None
        with _guard(self.folder):
            if self._mine():
                self.path.unlink(missing_ok=True)
        if self.made:  # a start that wrote nothing leaves no folder behind
            with contextlib.suppress(OSError):
                self.folder.rmdir()

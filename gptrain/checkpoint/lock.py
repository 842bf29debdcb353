"""A run folder has one owner: `with RunLock(folder, "gptrain train"): ...`.

The lock is FOLDER/.lock, a JSON object {host, pid, what, started, heartbeat, boot, job, token}, created
atomically (a complete temporary file hard-linked into place: it exists whole or not at all). While
it is held a background thread rewrites its heartbeat every HEARTBEAT_S seconds. Another job finds
it and stops with one line (a UserError, exit 2) unless the lock is stale:

- same host (the same boot of it, the same pid namespace): the pid recorded is not running any more;
- otherwise (another host, this host restarted, another container): its heartbeat is older than STALE_S;
- its content is not a lock (malformed): data, not a holder;
- it was taken by an earlier round of this same multi-node job (the same rendezvous): torch's
  agents stop every worker before a round re-forms, and rank 0 may now be on another node.

A stale lock is taken over with one warning line on stderr (host, pid, heartbeat age), so a job
killed by SIGKILL, or requeued on another node after its node died, continues. The job whose lock
was taken over (alive after all: its heartbeat was only late) writes no more there: its heartbeat
notices and calls `on_lost` (the training loop stops at its next step boundary), and a checkpoint
it would publish is refused (`check_folder`, called by checkpoint/folder.py): `LockLost`, one
line, exit 2.

Every change of the lock (create, take over, heartbeat, release) happens while holding flock on
the folder itself, so two jobs starting at once on one host (or on a filesystem whose flock spans
hosts) never both win; where flock is not available the atomic creation still admits only one of
two new owners.
"""

from __future__ import annotations

import contextlib
import errno
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
HEARTBEAT_S = 10.0  # how often the holder refreshes its heartbeat
STALE_S = 60.0  # a lock of another host not refreshed for this long is stale (its node died)
GUARD_WAIT_S = 10.0  # the longest wait for flock on the folder (held for milliseconds)
JOB_ENV = "GPTRAIN_JOB"  # RDZV_ID@ENDPOINT, exported by distributed/launch.py to its workers


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
    """Where a pid means something (Linux): this boot of the machine and this pid namespace (two
    containers may share a host name); "" elsewhere."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot} {os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


@contextlib.contextmanager
def _guard(folder: Path):
    """flock on the folder for one change of the lock; given up after GUARD_WAIT_S (a holder that
    is stopped mid-change) or where the filesystem has no flock: the link stays atomic."""
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


def stale_reason(holder: dict | None, now: float | None = None) -> str | None:
    """Why a lock's content does not stop this process taking it (None: a live holder)."""
    now = time.time() if now is None else now
    if holder is None:
        return "its content is not a lock"
    me = (socket.gethostname(), os.getpid())
    if holder["job"] and holder["job"] == _job() and (holder["host"], holder["pid"]) != me:
        # one rank 0 per round, and torch's agents stop every worker before a new round starts
        return f"it was taken in an earlier round of this job ({holder['job']}), whose workers torch's agents stopped"
    if holder["host"] == socket.gethostname() and holder["boot"] == _boot_id():
        if _pid_running(holder["pid"]):
            return None
        return f"pid {holder['pid']} is not running on {holder['host']}"
    age = now - holder["heartbeat"]
    if age > STALE_S:
        return f"its heartbeat stopped {age:.0f} s ago (stale after {STALE_S:.0f} s)"
    return None


def read(path: Path) -> dict | None:
    """The lock's content, None when it is not a lock (malformed); FileNotFoundError when absent."""
    try:
        d = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError):
        return None
    types = {"host": str, "pid": int, "what": str, "started": float, "heartbeat": float}
    if not isinstance(d, dict) or not all(
        isinstance(d.get(k), t) or (t is float and isinstance(d.get(k), int))
        for k, t in types.items()
    ):
        return None
    extra = {k: str(d.get(k, "")) for k in ("boot", "token", "job")}
    return {**d, **extra}


class RunLock:
    """The exclusive lock of a run folder (created if needed) for the `with` block; see the module
    docstring. `what` names the command in the refusal another job prints."""

    def __init__(self, folder: str | Path, what: str):
        self.folder = Path(folder)
        self.path = self.folder / LOCK
        self.what = what
        self.token = ""
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
        me |= {"started": started, "heartbeat": time.time(), "boot": _boot_id(), "job": _job()}
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
            with _guard(self.folder):
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
        """Create the lock, or take over a stale one; a UserError while another job holds it."""
        while not self._create():
            try:
                holder = read(self.path)
            except FileNotFoundError:
                continue  # released in between: try again
            why = stale_reason(holder)
            if why is None:
                raise UserError(self.refusal(holder))
            self._take_over(holder, why)
            return

    def _create(self) -> bool:
        """The lock created whole (a hard link of a complete file); False when it exists."""
        tmp = self._write_tmp(self._content(self.started))
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        except OSError as e:  # no hard links here: exclusive create, written under the guard
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
                raise
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as f:
                f.write(tmp.read_bytes())
            return True
        finally:
            tmp.unlink(missing_ok=True)

    def refusal(self, holder: dict) -> str:
        return (
            f"run folder {self.folder} is in use by {holder['what']} (host {holder['host']}, pid "
            f"{holder['pid']}, since {_when(holder['started'])}); wait for it or choose another folder"
        )

    def _take_over(self, holder: dict | None, why: str) -> None:
        if holder is None:
            who = "a malformed lock"
        else:
            age = time.time() - holder["heartbeat"]
            who = f"the lock of {holder['what']} (host {holder['host']}, pid {holder['pid']}, last heartbeat {age:.0f} s ago)"
        print(
            f"gptrain: warning: run folder {self.folder}: taking over {who}: {why}",
            file=sys.stderr,
            flush=True,
        )
        os.replace(self._write_tmp(self._content(self.started)), self.path)

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

"""When the run-folder lock's holder counts as stopped, against fake clocks and heartbeats: another
host's lock is live while its content moves, whatever its wall clock says, and stale once it
stands still for STALE_S of this host's own clock; on this host a running pid whose heartbeat
stopped is taken over (a reused pid, a frozen job); an earlier round of this job is taken over
only once its heartbeat stands still; and starters racing to take over a stale lock where the
folder cannot be flocked: exactly one wins, the others get the one-line refusal."""

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from gptrain.checkpoint import lock
from gptrain.checkpoint.lock import RunLock
from gptrain.errors import UserError

HOST = socket.gethostname()


class Clock:
    """This host's monotonic clock, moved only by the lock's own sleeps; at each sleep
    `on_sleep(t)` runs (another host's job beating)."""

    def __init__(self):
        self.t = 1000.0
        self.on_sleep = None

    def monotonic(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s
        if self.on_sleep is not None:
            self.on_sleep(self.t)


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(lock, "_monotonic", c.monotonic)
    monkeypatch.setattr(lock, "_sleep", c.sleep)
    return c


def holder(**fields) -> dict:
    now = time.time()
    out = {"host": "node-elsewhere", "pid": 1, "what": "gptrain train", "started": now - 100}
    out |= {"heartbeat": now, "beats": 0, "mono": 5.0, "boot": "x", "job": "", "token": "t"}
    return out | fields


def write(folder, content: dict) -> None:
    """The lock replaced whole, as another job writes it (never read half-written)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".lock.test-tmp").write_text(json.dumps(content))
    os.replace(folder / ".lock.test-tmp", folder / ".lock")


def beating(folder, clock: Clock, content: dict) -> None:
    """Another host's job: it rewrites its lock every HEARTBEAT_S of this host's clock, with its
    own wall clock (whatever its skew) advanced as much."""
    write(folder, content)
    last = [clock.t]

    def beat(t):
        if t - last[0] >= lock.HEARTBEAT_S:
            last[0] = t
            content["beats"] += 1
            content["heartbeat"] += lock.HEARTBEAT_S
            write(folder, content)

    clock.on_sleep = beat


def ours(folder) -> bool:
    return json.loads((folder / ".lock").read_text())["pid"] == os.getpid()


def taken_over(folder, capsys) -> str:
    """The one line of a takeover, the lock then this process's."""
    with RunLock(folder, "gptrain train"):
        assert ours(folder)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def refused(folder) -> str:
    before = (folder / ".lock").read_text()
    with pytest.raises(UserError) as e:
        RunLock(folder, "gptrain train").acquire()
    assert e.value.exit_code == 2 and "\n" not in str(e.value)
    after = json.loads((folder / ".lock").read_text())
    assert after["token"] == json.loads(before)["token"]  # untouched: still the other job's
    return str(e.value)


@pytest.mark.parametrize("skew_s", [-3600, -90, 0, 90, 3600])
def test_another_hosts_lock_is_live_while_its_heartbeat_moves_whatever_its_clock(
    tmp_path, clock, skew_s
):
    """Its wall clock an hour behind ours or ahead: refused within one beat of ours."""
    beating(tmp_path, clock, holder(heartbeat=time.time() + skew_s))
    start = clock.t
    assert "is in use by gptrain train (host node-elsewhere, pid 1, since " in refused(tmp_path)
    assert clock.t - start <= lock.HEARTBEAT_S + lock.POLL_S


@pytest.mark.parametrize("skew_s", [0, 3600])
def test_another_hosts_lock_that_stands_still_is_taken_over_after_stale_s(
    tmp_path, clock, capsys, skew_s
):
    """A heartbeat that looks fresh to our wall clock (or is in our future) but never moves."""
    write(tmp_path, holder(heartbeat=time.time() + skew_s))
    start = clock.t
    line = taken_over(tmp_path, capsys)
    assert lock.STALE_S <= clock.t - start <= lock.STALE_S + lock.POLL_S
    assert line == (
        f"gptrain: warning: run folder {tmp_path}: taking over the lock of gptrain train (host node-elsewhere, pid 1): "
        f"its heartbeat did not move for {lock.STALE_S:.0f} s, watched on this host's clock (a running job's moves every {lock.HEARTBEAT_S:.0f} s)"
    )  # fmt: skip


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_a_pid_of_another_boot_or_namespace_is_judged_by_its_heartbeat(tmp_path, clock, capsys):
    """This host's name, another boot (or container): its pid is not ours to check."""
    content = holder(host=HOST, pid=dead_pid(), boot="another-boot")
    beating(tmp_path, clock, content)
    refused(tmp_path)
    clock.on_sleep = None  # that job stops beating
    start = clock.t
    assert "its heartbeat did not move for" in taken_over(tmp_path, capsys)
    assert clock.t - start >= lock.STALE_S


@pytest.fixture
def running_pid():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p.pid
    p.kill()
    p.wait()


def test_a_running_pid_whose_heartbeat_stopped_is_taken_over(tmp_path, clock, capsys, running_pid):
    """On this host a pid that runs counts only while its heartbeat (on this host's monotonic
    clock; the wall clock where a lock has none) moved within STALE_S: otherwise another
    program has that pid now, or the job is frozen."""
    mine = {"host": HOST, "pid": running_pid, "boot": lock._boot_id()}
    write(tmp_path, holder(**mine, mono=clock.t - 30))
    refused(tmp_path)
    for stalled in (
        holder(**mine, mono=clock.t - 7200),
        {k: v for k, v in holder(**mine, heartbeat=time.time() - 7200).items() if k != "mono"},
    ):
        write(tmp_path, stalled)
        line = taken_over(tmp_path, capsys)
        assert line.endswith(
            f"pid {running_pid} is running on {HOST} but the lock's heartbeat stopped 7200 s ago "
            f"(stale after {lock.STALE_S:.0f} s): another program has that pid now, or the job is frozen"
        )  # fmt: skip


def test_an_earlier_round_of_this_job_is_taken_over_once_its_heartbeat_stands_still(
    tmp_path, clock, capsys, monkeypatch
):
    """The same rendezvous (a round re-formed with rank 0 on another node): refused while the
    lock's heartbeat moves (a reused rendezvous id), taken over after ROUND_STALE_S without a
    move; another job's lock, or one outside any job, waits STALE_S."""
    job = "gptrain@node0:29500"
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv(lock.JOB_ENV, job)
    beating(tmp_path, clock, holder(job=job))
    refused(tmp_path)
    clock.on_sleep = None
    start = clock.t
    line = taken_over(tmp_path, capsys)
    assert lock.ROUND_STALE_S <= clock.t - start <= lock.ROUND_STALE_S + lock.POLL_S
    assert f"it was taken in an earlier round of this job ({job}), whose workers" in line
    for mine in ("", "another@node0:29500"):
        monkeypatch.setenv(lock.JOB_ENV, mine)
        write(tmp_path, holder(job=job))
        start = clock.t
        assert "earlier round" not in taken_over(tmp_path, capsys)
        assert clock.t - start >= lock.STALE_S


def without_flock(monkeypatch) -> None:
    monkeypatch.setattr(lock, "_guard", lambda folder: contextlib.nullcontext())


def race(folder, starters: int, monkeypatch) -> tuple[list[RunLock], list[str]]:
    """`starters` RunLocks acquiring `folder` at once (threads), each held before its takeover
    until every one has judged the lock stale: the locks and "won" or the refusal of each."""
    real, barrier, waited = RunLock._take_over, threading.Barrier(starters), set()

    def racing(self, *args):
        if id(self) not in waited:
            waited.add(id(self))
            barrier.wait(timeout=30)
        return real(self, *args)

    monkeypatch.setattr(RunLock, "_take_over", racing)
    locks = [RunLock(folder, "gptrain train") for _ in range(starters)]
    results = [""] * starters

    def start(i):
        try:
            locks[i].acquire()
            results[i] = "won"
        except UserError as e:
            results[i] = str(e)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(starters)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    monkeypatch.setattr(RunLock, "_take_over", real)
    return locks, results


@pytest.mark.parametrize("starters", [2, 4])
def test_starters_racing_a_takeover_without_flock_one_wins(tmp_path, monkeypatch, capsys, starters):
    """A stale lock (its pid gone), no flock on the folder, and every starter judging it stale
    before any of them takes it over: one holds the lock, the others get the refusal naming it;
    no claim or temporary file is left."""
    without_flock(monkeypatch)
    monkeypatch.setattr(lock, "POLL_S", 0.005)
    refusal = f"run folder {tmp_path} is in use by gptrain train (host {HOST}, pid {os.getpid()}, since "  # fmt: skip
    for _ in range(5):
        write(tmp_path, holder(host=HOST, pid=dead_pid(), boot=lock._boot_id()))
        locks, results = race(tmp_path, starters, monkeypatch)
        winners = [i for i, r in enumerate(results) if r == "won"]
        assert len(winners) == 1, results
        assert all(r == "won" or r.startswith(refusal) for r in results), results
        won = locks[winners[0]]
        assert json.loads((tmp_path / ".lock").read_text())["token"] == won.token
        assert sorted(p.name for p in tmp_path.iterdir()) == [".lock"]
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "taking over" in err[0], err
        won.release()


def test_a_claim_left_by_a_taker_that_died_is_passed_over(tmp_path, monkeypatch, clock, capsys):
    """A starter died between its claim and its takeover: the next waits CLAIM_WAIT_S for the lock
    to change, then takes it over with the next claim, removing both."""
    without_flock(monkeypatch)
    write(tmp_path, holder(host=HOST, pid=dead_pid(), boot=lock._boot_id()))
    raw = (tmp_path / ".lock").read_bytes()
    left = tmp_path / f".lock.claim-{hashlib.sha256(raw).hexdigest()[:16]}-0"
    left.write_text(json.dumps(holder(host=HOST, pid=dead_pid())))
    start = clock.t
    assert "is not running on" in taken_over(tmp_path, capsys)
    assert lock.CLAIM_WAIT_S <= clock.t - start <= lock.CLAIM_WAIT_S + lock.POLL_S
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # released, no claim left

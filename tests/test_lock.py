"""The run-folder lock: one owner at a time; a lock of a dead process, of a node whose heartbeat
stopped, or a malformed one is taken over with one line; released on exit, also on an error.
How a lock is judged stale (heartbeats watched on this host's clock, pids reused, rounds of a
job) and takeovers racing without flock: tests/test_lock_stale.py."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gptrain.checkpoint import lock
from gptrain.checkpoint.lock import RunLock
from gptrain.errors import UserError

ROOT = Path(__file__).resolve().parents[1]


def write_lock(folder: Path, **fields) -> None:
    now = time.time()
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "what": "gptrain train"}
    holder |= {"started": now - 100, "heartbeat": now, "boot": lock._boot_id(), "token": "t"}
    holder |= {"beats": 0, "mono": lock._monotonic()}
    folder.mkdir(parents=True, exist_ok=True)
    # replaced whole, as another job writes it: a heartbeat never reads it half-written
    tmp = folder / ".lock.test-tmp"
    tmp.write_text(json.dumps(holder | fields))
    os.replace(tmp, folder / ".lock")


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def held_by_me(folder: Path) -> bool:
    return json.loads((folder / ".lock").read_text())["pid"] == os.getpid()


def test_a_second_holder_is_refused_with_one_line(tmp_path):
    run = tmp_path / "run"
    with RunLock(run, "gptrain train"):
        assert held_by_me(run)
        with pytest.raises(UserError) as e, RunLock(run, "gptrain race"):
            pass
    assert e.value.exit_code == 2 and "\n" not in str(e.value)
    msg = str(e.value)
    assert msg.startswith(
        f"run folder {run} is in use by gptrain train (host {socket.gethostname()}, pid {os.getpid()}, since "
    )
    assert msg.endswith("); wait for it or choose another folder")
    assert not run.exists()  # released: the folder it created, empty, is gone too


def test_the_folder_and_what_was_written_in_it_stay(tmp_path):
    with RunLock(tmp_path / "run", "gptrain train"):
        (tmp_path / "run" / "config.toml").write_text("")
    assert os.listdir(tmp_path / "run") == ["config.toml"]
    with RunLock(tmp_path, "gptrain train"):
        pass
    assert tmp_path.is_dir()  # not created by the lock: kept although empty of a lock


def test_released_on_an_error_and_taken_again_by_the_same_process(tmp_path):
    run = tmp_path / "a" / "run"  # created with its parents
    with pytest.raises(RuntimeError), RunLock(run, "gptrain train"):
        raise RuntimeError("boom")
    assert not (run / ".lock").exists()
    with RunLock(run, "gptrain race"):
        assert json.loads((run / ".lock").read_text())["what"] == "gptrain race"
    assert not (run / ".lock").exists()
    assert (tmp_path / "a").is_dir()


def test_a_dead_process_lock_is_taken_over_with_a_line(tmp_path, capsys):
    pid = dead_pid()
    write_lock(tmp_path, pid=pid)
    with RunLock(tmp_path, "gptrain train"):
        assert held_by_me(tmp_path)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0] == (
        f"gptrain: warning: run folder {tmp_path}: taking over the lock of gptrain train (host {socket.gethostname()}, pid {pid}): "
        f"pid {pid} is not running on {socket.gethostname()}"
    )


def test_a_folder_that_cannot_be_written_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError) as e, RunLock(tmp_path / "file" / "run", "gptrain train"):
        pass
    assert str(e.value).startswith(
        f"run folder {tmp_path / 'file' / 'run'}: cannot take its lock .lock ("
    )
    assert str(e.value).endswith("check that the folder can be written, or choose another folder")


@pytest.mark.parametrize("content", [b"", b"{not json", b'{"host": "h"}', b"\xff\xfe", b"[1]"])
def test_a_malformed_lock_is_taken_over_with_a_line(tmp_path, capsys, content):
    (tmp_path / ".lock").write_bytes(content)
    with RunLock(tmp_path, "gptrain train"):
        assert held_by_me(tmp_path)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"gptrain: warning: run folder {tmp_path}: taking over a malformed lock: its content is not a lock"
    ]


def test_the_heartbeat_is_refreshed_and_notices_a_takeover(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(lock, "HEARTBEAT_S", 0.05)
    with RunLock(tmp_path, "gptrain train"):
        first = json.loads((tmp_path / ".lock").read_text())
        deadline = time.time() + 10
        while json.loads((tmp_path / ".lock").read_text())["heartbeat"] == first["heartbeat"]:
            assert time.time() < deadline, "the heartbeat was never refreshed"
            time.sleep(0.02)
        now = json.loads((tmp_path / ".lock").read_text())
        beat = ("heartbeat", "mono", "beats")
        assert now["beats"] == first["beats"] + 1 and now["mono"] > first["mono"]
        assert {k: v for k, v in now.items() if k not in beat} == {
            k: v for k, v in first.items() if k not in beat
        }
        write_lock(tmp_path, host="node-elsewhere", pid=1, boot="x")  # another job took it
        time.sleep(0.3)
    assert "node-elsewhere, pid 1) took over its lock" in capsys.readouterr().err
    assert json.loads((tmp_path / ".lock").read_text())["host"] == "node-elsewhere"  # not removed


def test_a_takeover_is_told_once_to_on_lost_and_then_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(lock, "HEARTBEAT_S", 0.05)
    told = []
    with RunLock(tmp_path, "gptrain train") as held:
        held.on_lost = told.append
        held.check()  # still its own: nothing
        write_lock(tmp_path, host="node-elsewhere", pid=1, boot="x", token="theirs")
        deadline = time.time() + 10
        while not told:
            assert time.time() < deadline, "the heartbeat never noticed the takeover"
            time.sleep(0.02)
        time.sleep(0.2)  # later beats tell nobody again
        with pytest.raises(lock.LockLost) as e:
            held.check()
    assert told == [str(e.value)] and "node-elsewhere" in told[0]
    assert capsys.readouterr().err == ""  # on_lost ends the job with the line: no warning too
    assert json.loads((tmp_path / ".lock").read_text())["token"] == "theirs"


def test_a_checkpoint_is_not_published_into_a_folder_another_job_took_over(tmp_path):
    from gptrain.checkpoint import folder

    root = tmp_path / "run" / "checkpoints"
    published = []
    for step in (2, 4):
        tmp = root / f".tmp-{folder.step_dir_name(step)}"
        tmp.mkdir(parents=True)
        (tmp / "meta.json").write_text("{}")
        published.append(tmp)
    other = tmp_path / "elsewhere"
    (other / ".tmp-step_00000002").mkdir(parents=True)
    with RunLock(tmp_path / "run", "gptrain train"):
        folder.publish(root, "step_00000002", published[0], 2)
        write_lock(tmp_path / "run", host="node-elsewhere", pid=1, boot="x", token="theirs")
        with pytest.raises(lock.LockLost, match="took over its lock"):
            folder.publish(root, "step_00000004", published[1], 4)
        # a folder whose lock this process does not hold is not its business
        folder.publish(other, "step_00000002", other / ".tmp-step_00000002", 2)
    assert (root / "latest").read_text() == "step_00000002\n"
    assert not (root / "step_00000004").exists() and published[1].is_dir()
    assert (other / "latest").read_text() == "step_00000002\n"


HOLD = """
import sys, time
from gptrain.checkpoint.lock import RunLock
from gptrain.errors import UserError
start = float(sys.argv[2])
while time.time() < start:
    pass
try:
    with RunLock(sys.argv[1], "gptrain race"):
        print("won", flush=True)
        time.sleep(float(sys.argv[3]))
except UserError as e:
    print("refused:", e, flush=True)
"""


def holders(folder: Path, n: int, hold_s: float, start_in: float = 1.5):
    start = time.time() + start_in
    return [
        subprocess.Popen(
            [sys.executable, "-c", HOLD, str(folder), str(start), str(hold_s)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(n)
    ]


@pytest.mark.slow
def test_processes_racing_for_the_lock_one_wins(tmp_path):
    outs = [p.communicate(timeout=60)[0] for p in holders(tmp_path / "run", 4, 3.0)]
    assert sorted(o.split(":")[0].strip() for o in outs) == ["refused"] * 3 + ["won"], outs
    assert all("wait for it or choose another folder" in o for o in outs if o.startswith("ref"))
    assert not (tmp_path / "run" / ".lock").exists()


@pytest.mark.slow
def test_a_sigkilled_holder_is_taken_over(tmp_path, capsys):
    (p,) = holders(tmp_path, 1, 60.0, start_in=0)
    assert p.stdout.readline() == "won\n"
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert (tmp_path / ".lock").exists()  # SIGKILL leaves the lock behind
    with RunLock(tmp_path, "gptrain train"):
        assert held_by_me(tmp_path)
    assert f"pid {p.pid} is not running" in capsys.readouterr().err

"""tests/forked.py, the tests' process launcher, against subprocess: the same output, exit
codes, signals, sessions, environment and working directory, and a training run whose weights
equal a fresh process's bit for bit; the interpreter torch.distributed.run starts its workers
with in forked children stands in for them as a fresh worker would."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import forked
import pytest
import torch
from train_helpers import DEBUG, REPO, weights

SCRIPT = """
import os, sys
print("argv", sys.argv, "cwd", os.getcwd(), "X", os.environ.get("X"), "path0", sys.path[0])
print("name", __name__, file=sys.stderr)
sys.exit(int(sys.argv[-1]))
"""


def both(args, **kw):
    """(subprocess.run, forked.run) of the same command."""
    return [run(args, capture_output=True, text=True, timeout=120, **kw) for run in (subprocess.run, forked.run)]  # fmt: skip


def test_code_and_script_give_what_a_fresh_interpreter_gives(tmp_path):
    env = {**os.environ, "X": "y", "PYTHONPATH": str(REPO)}
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    for args in ([sys.executable, "-c", SCRIPT, "a", "3"], [sys.executable, str(script), "b", "0"], [sys.executable, "-u", str(script), "7"]):  # fmt: skip
        fresh, fork = both(args, env=env, cwd=tmp_path)
        assert forked._parse(args) is not None  # forked, not handed to subprocess
        assert (fork.returncode, fork.stdout, fork.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)  # fmt: skip
    fresh, fork = both([sys.executable, "-m", "gptrain", "fly"], env=env)
    assert (fork.returncode, fork.stdout, fork.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr) == (2, "", fresh.stderr)  # fmt: skip
    assert "unknown command 'fly'" in fork.stderr


def test_the_fault_handler_follows_pythonfaulthandler_as_in_a_fresh_interpreter():
    """PYTHONFAULTHANDLER is read when an interpreter starts; children of one zygote, with it
    and without it, get what a fresh interpreter gets (one zygote serves both)."""
    on, off = ({**os.environ, "PYTHONFAULTHANDLER": v} for v in ("1", ""))
    assert forked._zygote(on) is forked._zygote(off)
    code = "import faulthandler; print(faulthandler.is_enabled())"
    for value, enabled in (("1", "True"), ("", "False"), ("1", "True")):
        env = {**os.environ, "PYTHONFAULTHANDLER": value}
        fresh, fork = both([sys.executable, "-c", code], env=env)
        assert fresh.stdout == fork.stdout == enabled + "\n", (value, fresh, fork)


# short sleeps: see WORKER below
SLEEPER = [sys.executable, "-c", "import time\nprint('up', flush=True)\nfor _ in range(1200):\n    time.sleep(0.05)"]  # fmt: skip


@contextlib.contextmanager
def sigint(handler):
    """This process's SIGINT disposition set to `handler` meanwhile: its children start with it
    (a suite run as a background job of a non-interactive shell starts with SIGINT ignored)."""
    before = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM])
def test_signals_end_it_as_they_end_a_fresh_process(sig):
    codes = []
    with sigint(signal.default_int_handler):  # as from an interactive shell, however pytest runs
        for popen in (subprocess.Popen, forked.Popen):
            p = popen(SLEEPER, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            assert p.stdout.readline() == "up\n"
            p.send_signal(sig)
            codes.append(p.wait(timeout=30))
    assert codes == [-sig, -sig]


def test_a_sigint_its_caller_ignores_is_ignored_as_by_a_fresh_process():
    """A caller that ignores SIGINT starts children that ignore it: a fresh interpreter inherits
    that, and a forked child follows the caller at the time of the call, not the zygote."""
    for handler in (signal.SIG_IGN, signal.default_int_handler, signal.SIG_IGN):
        ignored = handler is signal.SIG_IGN
        with sigint(handler):
            for popen in (subprocess.Popen, forked.Popen):
                p = popen(SLEEPER, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
                assert p.stdout.readline() == "up\n"
                p.send_signal(signal.SIGINT)
                if ignored:
                    with pytest.raises(subprocess.TimeoutExpired):
                        p.wait(timeout=1)
                    p.kill()
                assert p.wait(timeout=30) == (-signal.SIGKILL if ignored else -signal.SIGINT)


# A Python handler runs when the main thread next checks for signals: a signal that lands after
# the last check before a long sleep waits for the sleep's end, in a fresh interpreter too. Short
# sleeps bound that wait; a signal that never arrives still ends in the test's time-out.
WORKER = """import os, signal, sys, time
signal.signal(signal.SIGUSR1, lambda *_: sys.exit(5))
print(os.getpid(), "torch" in sys.modules, flush=True)
for _ in range(1200):
    time.sleep(0.05)
"""


@pytest.mark.parametrize(
    "sig, code, ignored",
    [
        (signal.SIGUSR1, 5, False),
        (signal.SIGUSR1, 5, True),  # ignored by the launcher: the worker's own handler still runs
        (signal.SIGTERM, -signal.SIGTERM, False),
        (signal.SIGKILL, -signal.SIGKILL, False),
    ],
)
def test_the_workers_interpreter_forks_them_and_stands_in_for_them(sig, code, ignored):
    """PYTHON_EXEC of forked children, the `python` torch.distributed.run starts each worker
    with, started as torch's launcher starts it (its own session) and signalled as it signals
    (the process group): the worker is forked (torch already imported), the signal reaches it,
    its exit code or signal is the launcher's child's, and a SIGKILL of the child ends the
    worker too. A signal its launcher ignores, the worker starts ignoring, as a fresh one would,
    and handles once it installs a handler."""
    env = dict(os.environ)  # as the launcher passes it (pytest's own has COLUMNS and LINES too)
    python = os.path.join(forked._zygote(env).dir, "python")
    before = signal.signal(sig, signal.SIG_IGN) if ignored else None
    try:
        p = subprocess.Popen([python, "-u", "-c", WORKER], env=env, stdout=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    finally:
        if ignored:
            signal.signal(sig, before)
    pid, preloaded = p.stdout.readline().split()
    assert preloaded == "True" and int(pid) != p.pid
    started = start_time(pid)
    os.killpg(p.pid, sig)
    assert p.wait(timeout=30) == code
    deadline = time.monotonic() + 10
    while start_time(pid) == started:  # the same process (a pid is soon reused)
        assert time.monotonic() < deadline, "the worker outlived its launcher's child"
        time.sleep(0.01)


def start_time(pid) -> str | None:
    """/proc/PID/stat's start time: with the pid, names one process; None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def test_the_workers_interpreter_gives_what_a_fresh_interpreter_gives(tmp_path):
    """Its output and exit code; an environment that imports differently (a variable no zygote
    has) or a command the zygote does not run is a fresh interpreter, as asked."""
    env = dict(os.environ)
    python = os.path.join(forked._zygote(env).dir, "python")
    code = "import sys; print('torch' in sys.modules); sys.exit(7)"
    for other, args, preloaded in (({}, ["-c", code], "True"), ({"FORKED_TEST_OTHER_IMPORTS": "1"}, ["-c", code], "False"), ({}, ["-I", "-c", code], "False")):  # fmt: skip
        done = subprocess.run([python, *args], env={**env, **other}, capture_output=True, text=True)  # fmt: skip
        assert (done.returncode, done.stdout) == (7, preloaded + "\n")


def test_own_session_own_pid_and_time_out():
    p = forked.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)  # fmt: skip
    assert os.getsid(p.pid) == p.pid != os.getpid()
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=0.2)
    assert p.poll() is None
    os.killpg(p.pid, signal.SIGKILL)
    assert p.wait(timeout=30) == -signal.SIGKILL
    with pytest.raises(subprocess.TimeoutExpired):
        forked.run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=0.5)


def test_a_forked_training_run_equals_a_fresh_process(byte_data, tmp_path):
    """`python -m gptrain train` (5 debug steps, dropout on): forked and fresh, the same exit
    code, the same losses in metrics.jsonl and the same final weights, bit for bit; the fork
    starts in a fraction of the fresh process's time."""
    seconds = {}
    for name, popen in (("fresh", subprocess.Popen), ("forked", forked.Popen)):
        cmd = [sys.executable, "-m", "gptrain", "train", "--config", DEBUG, f"--data.dir={byte_data}"]  # fmt: skip
        cmd += [f"--run.dir={tmp_path / name}", "--train.max_steps=5", "--log.every=1", "--model.dropout=0.1"]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        forked.run([sys.executable, "-c", "pass"], env=env)  # the zygote is up before timing
        t0 = time.perf_counter()
        p = popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _, err = p.communicate(timeout=300)
        seconds[name] = time.perf_counter() - t0
        assert p.returncode == 0, err[-2000:]
    a, b = weights(tmp_path / "fresh"), weights(tmp_path / "forked")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows = [[json.loads(x) for x in (tmp_path / n / "metrics.jsonl").read_text().splitlines()] for n in ("fresh", "forked")]  # fmt: skip
    losses = [[r["loss"] for r in rs if "loss" in r] for rs in rows]
    assert losses[0] == losses[1] and len(losses[0]) == 5
    print(f"fresh {seconds['fresh']:.2f} s, forked {seconds['forked']:.2f} s")

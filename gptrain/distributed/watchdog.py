"""The hang watchdog (`dist.hang_timeout_s = auto | seconds | 0`): one thread per rank.

The loop only marks phase boundaries, `watchdog.enter("step", step)`, `"save"`, `"val"`, ...: one
time.monotonic() and one tuple assignment, no host sync, nothing on the device. The thread
wakes up about once a second (10 times per budget when the budget is under 10 s) and compares the
time spent in the current phase with that phase's budget:

- a number of seconds: that budget for every instance of every phase;
- auto: 10x the slowest completed instance of the phase in this process, never below 60 s;
- start-up (data, resume, model, speed choices), the first step of a process (which compiles)
  and, under auto, the first instance of any phase: FIRST_S (1 h) or the number, if more;
- 0: no thread at all.

Time the whole process was not running (SIGSTOP, a scheduler's suspend, a paused VM) is no
phase's: the thread wakes every poll, and a wake-up later than that by over SLACK_S is counted
as suspended (`_suspended`), outside every budget and every phase's measured time.

A step covers everything from the top of one loop iteration to the next, except the saves and
evals it marks; on a GPU, a step's device work is waited for on logging steps (their `.item()`),
so the slowest steps seen are logging steps and their budget covers the queue draining.

On expiry: one line on stderr naming the rank, the host, the phase (and step) and the time spent;
every thread's Python stack (faulthandler) appended to run.dir/train.log on the main process
(on stderr on the other ranks); on CUDA the NCCL flight recorder dumped through its pipe
(`flight_recorder_env` arranges it before the process group starts; files
run.dir/nccl_trace_rank_R); `on_expiry(line)` (the restart ledger); then the process exits with
EXIT_CODE (3), documented as "hung: safe to restart". Each of those steps is bounded in time (a
stuck filesystem, the usual cause of a hung save, must not stop the exit).
"""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
import tempfile
import threading
import time

EXIT_CODE = 3
FIRST_S = 3600.0  # start-up, the first step (compile), and any phase not yet measured (auto)
MIN_S = 60.0  # auto never goes below this
FACTOR = 10.0  # auto: this times the slowest instance seen
BOUNDED_S = 10.0  # each expiry action (stack dump, flight recorder, ledger) gets this long
SLACK_S = 1.0  # a wake-up later than its poll by more than this: the process was not running
SAY_S = 5.0  # a suspension this long or longer gets a line on stderr

# Each kind of work has its own budget: a first HellaSwag pass is not judged by validation's
# time, nor a rollback's checkpoint read by a save's. upload: waiting for the mirror at the end.
PHASES = ("start", "step", "save", "rollback", "val", "hellaswag", "sample", "upload")
EVAL_PHASES = ("val", "hellaswag", "sample")


def parse(setting: int | str) -> float | None:
    """'auto' -> None; a number of seconds (0 = off) -> float. Raises ValueError otherwise."""
    if setting == "auto":
        return None
    value = float(setting)
    if not value >= 0 or value == float("inf"):
        raise ValueError(setting)
    return value


class Watchdog:
    """One per process. `start()` (phase 'start'), `enter(phase, step)` at each boundary, `stop()`."""

    def __init__(
        self, setting: int | str, rank: int, log_path=None, on_expiry=None, clock=time.monotonic
    ):
        self.setting, self.rank, self.log_path, self.on_expiry = setting, rank, log_path, on_expiry
        self.fixed = parse(setting)
        self.enabled = self.fixed != 0
        self._clock = clock
        self._paused = 0.0  # seconds this process was suspended, summed (_suspended)
        self._poll = 1.0 if self.fixed is None else min(1.0, max(0.05, self.fixed / 10))
        self._woke = 0.0  # the clock at the watchdog thread's last wake-up (or a phase's entry)
        self._lock = threading.Lock()
        # (phase, step, since, _paused then): replaced in one assignment
        self._now = ("start", None, clock(), 0.0)
        self.born = time.time()  # wall-clock start of this process's accounting (the ledger's)
        self._first_step = None  # the step number of this process's first step (it compiles)
        self.slowest: dict[str, float] = {}  # phase -> slowest completed instance (auto budgets)
        self.totals: dict[str, float] = dict.fromkeys(PHASES, 0.0)  # seconds spent per phase
        self.counts: dict[str, int] = dict.fromkeys(PHASES, 0)  # instances completed per phase
        self.first_step_s = 0.0
        self._stop = threading.Event()
        self._thread = None

    def start(self) -> Watchdog:
        if self.enabled:
            self._woke = self._clock()
            self._thread = threading.Thread(
                target=self._watch, name="gptrain-watchdog", daemon=True
            )
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (the loop is over, or it ended with an error)."""
        self.enter(None)
        self._stop.set()

    def __enter__(self) -> Watchdog:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def enter(self, phase: str | None, step: int | None = None) -> None:
        """The loop enters `phase` (None: nothing is watched) and leaves the current one."""
        now = self._clock()
        if self._thread is not None:
            self._suspended(now)
        paused = self._paused
        left, left_step, since, paused_then = self._now
        self._now = (phase, step, now, paused)
        if left is None:
            return
        spent = now - since - (paused - paused_then)
        self.totals[left] = self.totals.get(left, 0.0) + spent
        self.counts[left] = self.counts.get(left, 0) + 1
        if left == "step" and left_step == self._first_step:
            self.first_step_s += spent  # the compile: not a measure of later steps
        elif spent > self.slowest.get(left, 0.0):
            self.slowest[left] = spent
        if phase == "step" and self._first_step is None:
            self._first_step = step

    def budget(self, phase: str, step: int | None) -> float:
        """Seconds the current instance of `phase` may take."""
        first = phase == "start" or (phase == "step" and step == self._first_step)
        if self.fixed is not None:
            return max(self.fixed, FIRST_S) if first else self.fixed
        if first or phase not in self.slowest:
            return FIRST_S
        return max(MIN_S, FACTOR * self.slowest[phase])

    def _watch(self) -> None:
        """Wakes every `poll` s. A wake-up much later than that means the whole process was not
        running (SIGSTOP: Ctrl-Z, a scheduler's suspend such as Slurm's; a paused VM): that time
        is no phase's, and the phase's budget is not spent by it. A hung step leaves this thread
        waking on time."""
        while not self._stop.wait(self._poll):
            now = self._clock()
            self._suspended(now)
            phase, step, since, paused_then = self._now
            if phase is None:
                continue
            elapsed = now - since - (self._paused - paused_then)
            budget = self.budget(phase, step)
            if elapsed > budget:
                self._expire(phase, step, elapsed, budget)
                return

    def _suspended(self, now: float) -> None:
        """Account the time since the watchdog thread last woke beyond its poll (and SLACK_S) as
        suspended: the thread wakes on time unless the process stops running. Called by the
        thread at each wake-up and by enter(), whichever sees the gap first (the other then sees
        none)."""
        with self._lock:
            late = now - self._woke - self._poll
            self._woke = max(self._woke, now)
            if late <= SLACK_S:
                return
            self._paused += late
        if late >= SAY_S:
            print(f"gptrain: rank {self.rank}: this process was suspended for {late:.0f} s; the hang watchdog does not count it", file=sys.stderr, flush=True)  # fmt: skip

    def _expire(self, phase: str, step: int | None, elapsed: float, budget: float) -> None:
        what = {
            "start": "start-up",
            "step": f"step {step}",
            "save": f"the checkpoint save at step {step}",
        }
        what = what.get(phase, f"the {phase} at step {step}")
        where = self.log_path if self.log_path else "stderr"
        line = (
            f"rank {self.rank} on {socket.gethostname()} hung: {what} has made no progress for {elapsed:.0f} s "
            f"(budget {budget:.0f} s, dist.hang_timeout_s = {self.setting}); every thread's stack is in {where}; "
            f"exit {EXIT_CODE}: hung, safe to restart (run the same command)"
        )
        print(f"gptrain: error: {line}", file=sys.stderr, flush=True)
        _bounded(lambda: self._dump_stacks(line))
        _bounded(lambda: dump_flight_recorder(self.rank))
        if self.on_expiry is not None:
            _bounded(lambda: self.on_expiry(line))
        os._exit(EXIT_CODE)

    def _dump_stacks(self, line: str) -> None:
        if self.log_path is None:
            sys.stderr.write(f"watchdog: {line}; stacks:\n")
            sys.stderr.flush()
            faulthandler.dump_traceback(sys.stderr, all_threads=True)
            return
        with open(self.log_path, "a") as f:
            f.write(f"watchdog: {line}; stacks of every thread (most recent call first):\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)


def _bounded(fn, timeout_s: float = BOUNDED_S) -> None:
    """Run fn in a daemon thread for at most timeout_s (it may block on a stuck filesystem)."""

    def guarded():
        try:
            fn()
        except Exception as e:  # an expiry action that fails must not stop the exit
            print(f"gptrain: watchdog: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    t = threading.Thread(target=guarded, daemon=True)
    t.start()
    t.join(timeout_s)


# --- the NCCL flight recorder (CUDA) -------------------------------------------------------------

PIPE_VAR, DUMP_VARS = (
    "TORCH_NCCL_DEBUG_INFO_PIPE_FILE",
    ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE"),
)
BUFFER_VARS = ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE")


def flight_recorder_env(run_dir: str, env=os.environ) -> None:
    """Before an NCCL process group starts: keep the last 2000 collectives in the flight recorder,
    dump them on an NCCL time-out, and create the pipe through which the watchdog asks for a dump
    (torch's documented TORCH_NCCL_* variables; values the user set are kept)."""
    for var in BUFFER_VARS:
        env.setdefault(var, "2000")
    env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    for var in DUMP_VARS:
        env.setdefault(var, os.path.join(os.path.abspath(run_dir), "nccl_trace_rank_"))
    env.setdefault(PIPE_VAR, os.path.join(tempfile.gettempdir(), f"gptrain-fr-{os.getpid()}-"))


def dump_flight_recorder(rank: int, env=os.environ, wait_s: float = 8.0) -> str | None:
    """Ask the NCCL flight recorder for a dump through its pipe (written by torch's NCCL
    watchdog within a second or so); the dump file's path, or None where there is no pipe
    (not CUDA, or no NCCL group yet). Not run on a GPU yet (no machine); follows torch's
    ProcessGroupNCCL DumpPipe (<stem><rank>.pipe, any byte triggers a dump)."""
    stem = env.get(PIPE_VAR)
    pipe = f"{stem}{rank}.pipe" if stem else None
    if pipe is None or not os.path.exists(pipe):
        return None
    target = f"{env.get(DUMP_VARS[0], '')}{rank}"
    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(fd, b"1")
    finally:
        os.close(fd)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not os.path.exists(target):
        time.sleep(0.2)
    if os.path.exists(target):
        print(
            f"gptrain: watchdog: NCCL flight recorder dump in {target}", file=sys.stderr, flush=True
        )
        return target
    return None

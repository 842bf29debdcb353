"""The train state: every counter a resume needs, one stateful part of the checkpoint.

    state = TrainState(nonfinite, spikes, scaler)
    state.load_state_dict(saved)        # resume: step, tokens, clock, guards, GradScaler, W&B id
    ...; state.advance(tokens)          # after each optimizer step
    stop, timed = state.agree(stop, timed)   # every step: one all-reduce; the clock agreed too
    checkpoint["train_state"] = state.state_dict()

The training-time clock (train.time_budget's) is one number every rank agrees on: each step
adds this rank's step time to the agreed total, and `agree` (one small all-reduce the step
boundary makes anyway, with the stop flags) replaces it by the maximum over the ranks, so the lr
schedule of the next step and the stop decision read the same number on every rank.

Every step counts, the first step of every attempt the same way: under torch.compile an
attempt's first step compiles, so its own time is not training time and it counts as long as the
step before it (restored from the checkpoint by a resume); the run's first step, with no step
before it, counts as long as the next one (it is added with that one, and a checkpoint written
between them carries it as `owed_steps`). So a run killed and resumed reads the lr schedule at the
points the uninterrupted run does, given the same step times (tests/test_time_budget.py).

Its keys are the checkpoint's `train_state` entries; a checkpoint that lacks one of them (written
before it existed) resumes with that part's fresh value, which is what the run it came from had.
"""

from __future__ import annotations

import time

import torch

from gptrain.distributed import faults
from gptrain.distributed import runtime as dist
from gptrain.training.guards import NonFinite, Spikes

clock = time.perf_counter  # the training-time clock (a test may replace it)


class TrainState:
    """Step, tokens, training time, skipped and rolled-back steps, the spike detector's window,
    the float16 GradScaler and the experiment tracker's run id, saved and restored as one."""

    def __init__(self, nonfinite: NonFinite, spikes: Spikes, scaler: torch.amp.GradScaler):
        self.nonfinite, self.spikes, self.scaler = nonfinite, spikes, scaler
        self.step = 0
        self.tokens = 0
        self.rollbacks = 0
        self.wandb_run_id: str | None = None
        self.train_s = 0.0  # time in optimizer steps, every attempt, agreed by every rank
        self._elapsed_before = 0.0  # loop time of the attempts before this one
        self._started: float | None = None  # when this attempt's loop started
        self._step_began: float | None = None
        self._last_step_s = 0.0  # 0.0: no step timed yet
        self._untimed = 0  # steps of this attempt whose own time is not training time
        self._owed = 0  # steps counted with the next timed one (none timed before them)

    def start_clock(self, compiles: bool = False) -> None:
        """The loop begins; with torch.compile its first step compiles and is not training time."""
        self._started = time.perf_counter()
        self._untimed = 1 if compiles else 0

    def elapsed(self) -> float:
        """Loop seconds of every attempt so far (start-up excluded; evaluations and saves in)."""
        now = time.perf_counter() - self._started if self._started is not None else 0.0
        return self._elapsed_before + now

    def step_begins(self) -> None:
        self._step_began = clock()

    def advance(self, tokens: int) -> None:
        """After an optimizer step: its time counts as training time; an attempt's first step
        when it compiles counts as the step before it, or with the next one when none was timed
        before it (see the module docstring; GPTRAIN_FAULT=step_time: every step a fixed time)."""
        fixed = faults.step_seconds()
        if self._untimed:
            self._untimed -= 1
            counted = self._last_step_s if fixed is None else fixed
            if counted > 0:
                self._last_step_s = counted
                self.train_s += counted
            else:
                self._owed += 1
        elif self._step_began is not None:
            self._last_step_s = clock() - self._step_began if fixed is None else fixed
            self.train_s += self._last_step_s * (1 + self._owed)
            self._owed = 0
        self.step += 1
        self.tokens += tokens

    def agree(self, *flags: bool) -> tuple[bool, ...]:
        """Collective (every rank, every step boundary): for each flag, whether it holds on any
        rank; and the training time and the last step's time become the maximum over the ranks,
        in one all-reduce of a small CPU tensor (gloo; under nccl the process group sends CPU
        tensors over gloo: no device sync)."""
        values = torch.tensor([*flags, self.train_s, self._last_step_s], dtype=torch.float64)
        if dist.active():
            torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
        *agreed, self.train_s, self._last_step_s = values.tolist()
        return tuple(bool(f) for f in agreed)

    def schedule_step(self, max_steps: int, budget_s: float | None) -> float:
        """The point (in steps) the lr schedule is read at: the step itself; with a time budget,
        the further along of the step and the share of the budget spent times max_steps. So the
        whole schedule, warmup included, is stretched over the budget (step k of a run without
        one at k / max_steps of it), and it ends with whichever limit comes first."""
        if budget_s is None:
            return self.step
        return max(float(self.step), min(1.0, self.train_s / budget_s) * max_steps)

    def out_of_time(self, budget_s: float | None) -> bool:
        """Would one more step like the last one end past the budget?"""
        return budget_s is not None and self.train_s + self._last_step_s > budget_s

    def replicated(self) -> dict:
        """The counters every rank holds alike (the replica check compares them at each
        checkpoint); the loop time and the tracker's run id are the main process's own."""
        spikes = self.spikes.state_dict()
        out = {
            "step": self.step,
            "tokens": self.tokens,
            "train_s": self.train_s,
            "last_step_s": self._last_step_s,
            "owed_steps": self._owed,
            "skipped": self.nonfinite.count(),
            "rollbacks": self.rollbacks,
            "spikes.count": spikes["count"],
            "spikes.losses": spikes["losses"],
            "spikes.norms": spikes["norms"],
        }
        if self.scaler.is_enabled():
            out["scaler.scale"] = self.scaler.get_scale()
        return out

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "tokens": self.tokens,
            "elapsed_s": self.elapsed(),
            "train_s": self.train_s,
            "last_step_s": self._last_step_s,
            "owed_steps": self._owed,
            "skipped": self.nonfinite.count(),
            "rollbacks": self.rollbacks,
            "spikes": self.spikes.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
            "wandb_run_id": self.wandb_run_id,
        }

    def load_state_dict(self, saved: dict, rollback: bool = False) -> None:
        """A resume restores every counter. A rollback (`rollback=True`) keeps the clock, the
        rollback count and the spikes seen since, which happened and stay counted."""
        self.step, self.tokens = saved["step"], saved["tokens"]
        self.nonfinite.set_count(saved.get("skipped", 0))
        if saved.get("scaler") and self.scaler.is_enabled():
            self.scaler.load_state_dict(saved["scaler"])
        if rollback:
            self.spikes.rewind(saved.get("spikes"))
            return
        self.spikes.load_state_dict(saved.get("spikes"))
        self._elapsed_before = saved.get("elapsed_s", 0.0)
        self.train_s = saved.get("train_s", 0.0)
        self._last_step_s = saved.get("last_step_s", 0.0)
        self._owed = saved.get("owed_steps", 0)
        self.rollbacks = saved.get("rollbacks", 0)
        self.wandb_run_id = saved.get("wandb_run_id")

"""Unattended runs: the pieces the training loop calls at each step boundary (no callbacks).

- `Preemption`: SIGTERM and SIGUSR1 (Slurm, Kubernetes, spot instances) only set a flag; at the
  next step boundary every rank agrees on it through one all-reduce of a one-element CPU tensor
  (gloo; under nccl the process group routes CPU tensors to gloo, so the GPU is not synced). The
  loop then saves a checkpoint and exits 0. A second signal only sets the flag again, so it
  cannot interrupt the save. SIGINT (Ctrl-C) is left alone.
- `NonFinite`: a step whose gradient norm is NaN or inf never updates the weights or the
  optimizer state. Where the optimizer can skip on the device (a fused AdamW: the decision goes
  to the kernel through torch.amp.GradScaler's public API, with the scale held at 1.0, which is
  exact), nothing waits for the device; other optimizers (foreach AdamW, Muon) are stepped only
  after a host-side check (free on a CPU; one sync per step on a GPU). Counters live on the
  device and are read on the loop's sync points (logging, saving, stopping), where the policy
  (train.nonfinite) is applied; `roll_back` is the rollback policy's phase. Under float16 the
  GradScaler's overflow steps are routine (it skips them and lowers its scale while it
  calibrates, and again each time it tries a higher scale): they are counted as skipped, and
  stop / rollback act only when max_skips consecutive steps overflow (the scaler cannot recover).
- `Spikes`: finite loss spikes (train.spike): a z-score of the global loss and gradient norm over
  a window of steps, decided on the same sync points; rollback reuses `roll_back`.
"""

from __future__ import annotations

import math
import signal
import threading
from collections import deque

import torch

from gptrain.checkpoint import manager as checkpoint
from gptrain.distributed import parallelize
from gptrain.distributed import runtime as dist


class Preemption:
    """SIGTERM / SIGUSR1 set a flag; `agreed()` tells every rank whether any rank got one."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self) -> None:
        self.received: str | None = None
        self.lost: str | None = None  # the run folder's lock taken over by another job: its line
        self._previous: dict = {}
        self.on_signal = None  # called with the first signal's name (the restart ledger's mark)

    def install(self) -> Preemption:
        if (
            threading.current_thread() is threading.main_thread()
        ):  # signals reach only the main thread
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def _handler(self, signum, frame) -> None:
        if self.received is None and self.on_signal is not None:
            self.on_signal(signal.Signals(signum).name)
        self.received = self.received or signal.Signals(signum).name

    def connect(self, on_signal) -> None:
        """Have on_signal told the first signal's name: from the handler, or right now when a
        signal already arrived before there was anyone to tell (start-up, before the restart
        ledger existed: its signal line must not be lost, or a later hard kill of this attempt
        would count as a failure). A signal landing between the two lines below is told twice:
        harmless, the ledger keeps one signal line per attempt."""
        self.on_signal = on_signal
        if self.received is not None:
            on_signal(self.received)

    def restore(self) -> None:
        """The previous handlers; after a stop, further signals are ignored while the process
        exits (a second SIGTERM must not kill it in the middle of tearing down)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, signal.SIG_IGN if self.received else handler)
        self._previous = {}

    def lose(self, line: str) -> None:
        """The run folder's lock was taken over (from the lock's heartbeat thread): the loop
        stops at its next step boundary, saving nothing (`stop_if_lost`)."""
        self.lost = line

    def stop_if_lost(self, lost_anywhere: bool) -> None:
        """After the step boundary's agreement: LockLost on every rank when any rank's lock was
        taken over (the main process's own line; a peer names the main process)."""
        if lost_anywhere:
            raise checkpoint.LockLost(
                self.lost
                or "rank 0: another job took over the run folder's lock; this job stops and writes nothing more there"
            )

    def agreed(self) -> bool:
        """Collective (every rank, every step): True when any rank received a signal."""
        return dist.any_rank(self.received is not None)


class NonFiniteStop(Exception):
    """train.nonfinite = stop (or max_skips reached): the run ends without saving anything new."""


class NonFinite:
    """Skips non-finite steps and keeps their counts on the device; `check` applies the policy."""

    def __init__(self, policy: str, max_skips: int, optimizer, scaler, device: str, sharded: bool):
        self.policy, self.max_skips = policy, max_skips
        self.scaled = scaler.is_enabled()  # float16: isolated overflows are the scaler's business
        self.device_side = bool(
            optimizer.defaults.get("fused") and not scaler.is_enabled() and not sharded
        )
        self.scaler = None
        if self.device_side:  # scale fixed at 1.0: scaling and unscaling are exact no-ops
            self.scaler = torch.amp.GradScaler(torch.device(device).type, init_scale=1.0)
            self.scaler.scale(torch.zeros((), device=device))  # creates its scale tensor
        zero = torch.zeros((), dtype=torch.int64, device=device)
        self.skipped = zero.clone()  # non-finite steps in this run (restored on resume)
        self.streak = zero.clone()  # consecutive non-finite steps now
        self.longest = zero.clone()  # longest streak since the last check
        self.last_bad = zero - 1  # step number of the newest non-finite step since the last check

    def step(self, optimizer, scaler, grad_norm: torch.Tensor, step: int) -> None:
        """The optimizer step, unless grad_norm (global: identical on every rank) is NaN/inf."""
        grad_norm = parallelize.full_value(grad_norm)
        bad = ~torch.isfinite(grad_norm)
        if self.device_side:
            self.scaler.unscale_(optimizer)  # x 1.0; records whether any gradient is NaN/inf
            self.scaler.step(optimizer)  # the fused kernel skips the update on the device
            self.scaler.update(1.0)
        elif scaler.is_enabled():  # float16: the scaler skips such a step and lowers its scale
            scaler.step(optimizer)
            scaler.update()
        elif not bad.item():  # host-side check: the only way for an optimizer without found_inf
            scaler.step(optimizer)
            scaler.update()
        bad = bad.to(torch.int64)
        self.skipped += bad
        self.streak = (self.streak + 1) * bad
        self.longest = torch.maximum(self.longest, self.streak)
        self.last_bad = torch.where(bad.bool(), step, self.last_bad)

    def check(self, step: int) -> int | None:
        """At a sync point: the policy for the non-finite steps since the last check. Returns
        the bad step to roll back past (rollback), None to go on; raises NonFiniteStop."""
        skipped, longest, last_bad = torch.stack(
            [self.skipped, self.longest, self.last_bad]
        ).tolist()
        self.longest.copy_(self.streak)
        self.last_bad.fill_(-1)
        if last_bad < 0 or (self.scaled and longest < self.max_skips):
            return None
        if self.policy == "stop":
            raise NonFiniteStop(
                f"step {last_bad}: the loss or gradient norm is not finite and train.nonfinite = stop; nothing was saved after it. "
                "Resume from the last checkpoint with a lower optim.lr, or use train.nonfinite=skip or rollback"
            )
        if self.policy == "rollback":
            return last_bad
        if longest >= self.max_skips:
            raise NonFiniteStop(
                f"{longest} consecutive steps up to step {step} had a non-finite loss or gradient norm "
                f"(train.max_skips = {self.max_skips}; {skipped} skipped in all); nothing was saved after them. "
                "Resume from the last checkpoint with a lower optim.lr"
            )
        return None

    def count(self) -> int:
        """Skipped steps so far (a host sync: logging and saving steps only)."""
        return int(self.skipped.item())

    def set_count(self, n: int) -> None:
        self.skipped.fill_(n)


class Spikes:
    """train.spike: a finite loss spike is a step whose global loss or gradient norm lies more
    than train.spike_z standard deviations above the mean of the last train.spike_window
    accepted steps (only upwards; decided once the window is full; spikes and non-finite steps
    never enter it). `record` keeps each step's loss and norm tensors (no sync); `check`, on the
    loop's sync points, averages the pending losses over the ranks in one all-reduce, reads
    them once, and applies the policy: log (a line per spike), stop (NonFiniteStop) or rollback
    (returns the first spike's step). The window is part of the checkpoint (`state_dict`)."""

    def __init__(self, policy: str, z: float, window: int) -> None:
        self.policy, self.z, self.window = policy, z, window
        self.losses: deque[float] = deque(maxlen=window)
        self.norms: deque[float] = deque(maxlen=window)
        self.count = 0  # spikes seen in this run (restored on resume)
        self._pending: list = []  # (step, loss tensor, grad norm tensor) since the last check

    def record(self, step: int, loss_sum: torch.Tensor, grad_norm: torch.Tensor) -> None:
        if self.policy != "off":
            self._pending.append((step, loss_sum, grad_norm))

    def check(self, logger) -> int | None:
        """Collective, at a sync point (before step_metrics, which reduces the loss in place)."""
        if not self._pending:
            return None
        steps = [s for s, _, _ in self._pending]
        losses = dist.all_reduce_mean(torch.stack([loss.float() for _, loss, _ in self._pending]))
        norms = [parallelize.full_value(g) for _, _, g in self._pending]
        values = torch.stack([losses, torch.stack(norms).float().to(losses.device)]).tolist()
        self._pending.clear()
        first = None
        for step, loss, norm in zip(steps, *values, strict=True):
            if not (math.isfinite(loss) and math.isfinite(norm)):
                continue  # the non-finite guard's business
            z_loss, z_norm = _z(loss, self.losses), _z(norm, self.norms)
            if max(z_loss, z_norm) <= self.z:
                self.losses.append(loss)
                self.norms.append(norm)
                continue
            self.count += 1
            first = step if first is None else first
            logger.text(
                f"step {step}: loss spike: loss {loss:.4f} (z = {z_loss:.1f}), grad norm {norm:.4g} (z = {z_norm:.1f}) "
                f"against the last {self.window} steps (train.spike_z = {self.z}, train.spike = {self.policy})"
            )
        if first is None or self.policy == "log":
            return None
        if self.policy == "stop":
            raise NonFiniteStop(
                f"step {first}: loss spike (more than train.spike_z = {self.z} standard deviations above the last {self.window} steps) and train.spike = stop; nothing was saved after it. "
                "Resume from the last checkpoint with a lower optim.lr, or use train.spike=rollback"
            )
        return first

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "norms": list(self.norms), "count": self.count}

    def load_state_dict(self, state: dict | None) -> None:
        """A checkpoint's window (none: an older checkpoint, or the detector was off)."""
        state = state or {}
        self.losses = deque(state.get("losses", []), maxlen=self.window)
        self.norms = deque(state.get("norms", []), maxlen=self.window)
        self.count = state.get("count", 0)
        self._pending.clear()

    def rewind(self, state: dict | None) -> None:
        """A rollback: the checkpoint's window; the spikes seen since still count."""
        count = self.count
        self.load_state_dict(state)
        self.count = count


def _z(x: float, history: deque) -> float:
    """How many standard deviations x lies above the window's mean (0 until the window is full)."""
    if len(history) < history.maxlen:
        return 0.0
    mean = sum(history) / len(history)
    std = math.sqrt(sum((h - mean) ** 2 for h in history) / len(history))
    return (x - mean) / std if std > 0 else (math.inf if x > mean else 0.0)


def rollback_point(nonfinite: NonFinite, spikes: Spikes, step: int, logger) -> tuple | None:
    """Collective, at a sync point: the non-finite and spike policies together. Returns (the
    earliest bad step to roll back past, why) under rollback, None to go on; raises
    NonFiniteStop under stop."""
    bad = nonfinite.check(step)
    spike = spikes.check(logger)
    if spike is not None and (bad is None or spike < bad):
        return spike, "loss spike"
    return None if bad is None else (bad, "non-finite loss or gradient norm")

"""`train.micro_split = halves`: each micro-batch's two row halves at once, on two CPU threads.

On a CPU every op of a step otherwise runs on all intra-op threads (an OpenMP team), and Python
issues the next op only when the team has finished this one. With halves, the main thread runs
the first half of the micro-batch's rows and one worker thread the second half, at the same time,
each with half of the intra-op threads: no op waits for a team, and one half's Python and
dispatch overlap the other half's kernels. Measured (benchmarks/bench_split.py, docs/benchmarks.md,
AMD EPYC with AVX512-BF16, 2 cores): at the bench shapes 2-11% faster while the host's neighbours
take CPU time (a team waits at every op for its slowest thread; one half does not wait for the
other), within ~3% on a quiet host, and slower on small ops (a one-block model of 6 sequences).
So it is a setting, off by default, not a measured choice: a start-up timing on a quiet moment
would not see the gain, and one on a busy moment would cache it for every later run.

Exact and reproducible: the main half's backward() accumulates into .grad as any micro-step
does; the worker's half is differentiated with torch.autograd.grad and added to .grad after it,
always in that order, so the sum never depends on which thread finishes first (reruns and
resumed runs stay bit-identical). Against one pass over all rows the gradients differ only by
rounding. Each half's mean loss is weighted by its share of the counted targets, so the two add
up to the micro-batch's mean loss.

Where it may run (`ineligible` names the first reason it may not): a CPU; one process (DDP's
and FSDP2's gradient hooks are not made for two backward passes at once); no torch.compile;
dropout 0 (both halves would draw from the one global generator in an order that depends on
timing); no activation checkpointing; at least 2 intra-op threads; a micro-batch of at least 2.
"""

from __future__ import annotations

import copy
import queue
import threading

import torch
from torch import Tensor

from gptrain.model.losses import IGNORE_INDEX


def ineligible(device_type: str, world_size: int, compile: bool, dropout: float, activation_checkpointing: str, micro_batch: int, threads: int | None = None) -> str | None:  # fmt: skip
    """Why halves cannot run for this run, or None when they can."""
    threads = torch.get_num_threads() if threads is None else threads
    reasons = [
        (device_type != "cpu", "it runs on a GPU"),
        (world_size > 1, "it has more than one process"),
        (compile, "train.compile = true"),
        (dropout > 0, "model.dropout > 0"),
        (activation_checkpointing != "none", "train.activation_checkpointing is on"),
        (threads < 2, f"torch has {threads} intra-op thread"),
        (micro_batch < 2, f"the micro-batch is {micro_batch} sequence"),
    ]
    return next((why for bad, why in reasons if bad), None)


class Halves:
    """Runs two halves' forward + backward concurrently; one worker thread, started on first use."""

    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._worker: threading.Thread | None = None
        self._sent = 0  # jobs handed to the worker; each result comes back with its number

    def _serve(self) -> None:
        while True:
            number, threads, job = self._jobs.get()
            torch.set_num_threads(threads)  # this thread's share, as the main thread's
            try:
                self._done.put((number, job()))
            except BaseException as e:  # raised again on the main thread
                self._done.put((number, e))

    def backward(self, half_loss, n: int, params: list) -> Tensor:
        """half_loss(rows: slice) -> a scalar loss of rows `rows` of range(n); run it and its
        backward for rows :n//2 here and n//2: on the worker, at once, and leave the sum of both
        gradients in the params' .grad (added to what is there). Returns the summed loss,
        detached."""
        if self._worker is None:  # after the main thread has set its own thread count
            self._worker = threading.Thread(target=self._serve, name="gptrain-halves", daemon=True)
            self._worker.start()
        h, threads = n // 2, torch.get_num_threads()
        each = max(1, threads // 2)

        def second():
            loss = half_loss(slice(h, n))
            return loss.detach(), torch.autograd.grad(loss, params, allow_unused=True)

        torch.set_num_threads(each)
        self._sent += 1
        self._jobs.put((self._sent, each, second))
        try:
            first = half_loss(slice(0, h))
            first.backward()
        finally:
            # always wait: the worker's graph holds the same parameters
            number, out = self._done.get()
            while number != self._sent:  # a result an interrupted call left behind
                number, out = self._done.get()
            torch.set_num_threads(threads)
        if isinstance(out, BaseException):
            raise out
        loss, grads = out
        with torch.no_grad():
            for p, g in zip(params, grads, strict=True):  # in a fixed order, after the first
                if g is not None:
                    p.grad = g if p.grad is None else p.grad.add_(g)
        return first.detach() + loss

    def micro_step(self, model, params: list, x: Tensor, y: Tensor, autocast, accum: int) -> Tensor | None:  # fmt: skip
        """One micro-step of train_step in halves: forward + backward of model(x, y)'s mean loss
        divided by `accum`; returns that loss, detached. None (nothing done) when a half has no
        counted target (its mean would be 0/0): the caller runs the micro-batch whole."""
        counted = (y != IGNORE_INDEX).sum(dim=1)  # (B,)
        h = x.size(0) // 2
        first, total = int(counted[:h].sum()), int(counted.sum())
        if first == 0 or first == total:
            return None

        def half_loss(rows: slice) -> Tensor:
            with copy.copy(autocast):  # one context object per thread: it keeps state on itself
                _, loss = model(x[rows], y[rows])
            share = first if rows.start == 0 else total - first
            return loss * (share / (total * accum))

        return self.backward(half_loss, x.size(0), params)

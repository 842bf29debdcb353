"""`gptrain train`: the training loop, top to bottom, for one process or many.

    gptrain train --config configs/debug.toml                          # one process (CPU or a GPU)
    gptrain train --config configs/default.toml --optim.lr=1e-3        # overrides: --section.key=value
    gptrain train --config configs/default.toml --dist.nproc_per_node=auto   # one worker per GPU
    torchrun --nproc_per_node=8 -m gptrain train --config configs/gpt2_124m.toml
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \\
        --rdzv_endpoint=HOST:29500 -m gptrain train --config configs/gpt2_124m.toml   # on each node

One optimizer step consumes exactly train.total_batch_size tokens whatever the world size:
accumulation = total_batch_size / (micro_batch_size * seq_len * world_size). Gradients are
synchronised only on the last micro-step (FSDP2: on each, unless dist.fsdp_reduce = last).
`.item()` (a host sync) happens only on logging steps.

At each step boundary the loop asks gptrain/training/guards.py whether a rank was signalled to stop (then it
saves and exits 0) and, on steps that sync anyway, applies the non-finite policy. A step that both
saves and evaluates writes its checkpoint first. What happens before the loop and on its
logging, eval and checkpoint steps is in gptrain/training/run.py, one named function per phase.

The main process holds run.dir's lock throughout. Any exception leaving the loop publishes a
pending background save first (unless a peer cannot join in). A start that finds the run at its
end but not finished (killed after its last checkpoint: in the final evaluation, or before
summary.json) completes it, as the uninterrupted run would have.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from gptrain.checkpoint import manager as checkpoint
from gptrain.config.cli import parse_cli
from gptrain.config.fields import duration_s
from gptrain.config.load import Config, load_config
from gptrain.config.sections import TrainConfig
from gptrain.distributed import failures, faults, launch
from gptrain.distributed import runtime as dist
from gptrain.distributed.watchdog import Watchdog, flight_recorder_env
from gptrain.errors import UserError, first_line
from gptrain.training import attempts, batch
from gptrain.training import run as phases
from gptrain.training.evaluator import Due
from gptrain.training.guards import NonFiniteStop, Preemption, rollback_point
from gptrain.training.meter import carried, carry
from gptrain.training.precision import nondeterministic_op


def train(cfg: Config, info: dist.DistInfo) -> dict:
    """Run one training job; returns the summary dict (also written to run.dir/summary.json)."""
    log_path = os.path.join(cfg.run.dir, "train.log") if info.is_main else None
    preemption = Preemption().install()  # from the first moment: a signal in start-up counts too
    lock = None
    try:
        # run.dir has one owner from before anything is written to the end: the main process
        # holds its lock (the other ranks write nothing there); another live job's lock stops
        # every rank with one line (UserError, exit 2), a dead one's is taken over with a line
        lock = checkpoint.RunLock(cfg.run.dir, "gptrain train") if info.is_main else None
        dist.on_main(info, lambda: lock.acquire())
        if lock is not None:  # taken over by another job later: stop at the next step boundary
            lock.on_lost = preemption.lose
            faults.register_lock(lock.drill_take_over)  # GPTRAIN_FAULT=lock_taken
        # the hang watchdog (phase: start), then the restart ledger: a start in a crash loop
        # ends here (CrashLoop, exit 4); the ledger records how this attempt ends
        with (
            Watchdog(cfg.dist.hang_timeout_s, info.rank, log_path) as watchdog,
            attempts.Ledger(cfg.run, info, watchdog) as ledger,
        ):
            watchdog.on_expiry = ledger.hung
            preemption.connect(ledger.signal)  # a signal already received is recorded now
            return _train(cfg, info, watchdog, ledger, preemption)
    finally:
        if lock is not None:  # after a refusal too: it removes only a lock that is its own
            faults.register_lock(None)
            lock.release()
        preemption.restore()


def _train(cfg: Config, info, watchdog: Watchdog, ledger, preemption: Preemption) -> dict:
    t, budget_s = cfg.train, duration_s(cfg.train.time_budget)  # None: no time budget
    run = phases.start(cfg, info)  # data, resume, model, loader, logger: every bad input fails here
    ledger.started(run.state)
    if (early := _before_loop(run, cfg, preemption, watchdog, ledger)) is not None:
        return early
    state, meter, checkpointer, evaluator = run.state, run.meter, run.checkpointer, run.evaluator
    state.start_clock(compiles=t.compile)
    meter.restart(state.step)
    stopped_by = None
    with _on_error(run, cfg, watchdog):
        while state.step < t.max_steps:
            # one optimizer step at this step's learning rate
            watchdog.enter("step", state.step + 1)
            state.step_begins()
            lr = run.set_lr(cfg.optim, t.max_steps, budget_s)  # by steps, or by time spent
            with faults.in_step(state.step + 1, run.model):  # GPTRAIN_FAULT drills; else nothing
                loss, grad_norm = run.train_step(cfg.optim.grad_clip, timed=bool(budget_s))
            state.spikes.record(state.step + 1, loss, grad_norm)  # train.spike: no sync here
            state.advance(t.total_batch_size)
            meter.tick()
            step, last_step = state.step, state.step == t.max_steps
            # at the step boundary each part says whether it is due (the last step: max_steps or
            # the time budget spent, agreed by every rank)
            save, stop, last_step = checkpointer.due(step, last_step, preemption)
            evals = evaluator.due(step, last_step)
            log = meter.due(step, last_step, save) or bool(evals)  # measured before them
            # steps that sync anyway: the non-finite and spike policies; rollback past a bad step
            if log or save or stop:
                if bad := rollback_point(state.nonfinite, state.spikes, step, run.logger):
                    watchdog.enter("rollback", step)
                    checkpointer.roll_back(*bad, windows_per_step=t.total_batch_size // t.seq_len)
                    meter.restart(state.step)
                    continue
            metrics = meter.measure(state, loss, grad_norm, lr) if log else None
            # the checkpoint before evaluation: an evaluation that fails cannot cost it
            if save:
                watchdog.enter("save", step)
                checkpointer.meta["logged"] = carry(step, metrics)  # a killed eval loses none
                saved = checkpointer.save(wait=last_step or stop)  # complete before a stop
                ledger.progress()  # the attempt's time accounting so far (goodput), main only
            # once in a while: evaluate, then log the step
            if log:
                meter.report(step, {**metrics, **run.evaluate(step, evals, watchdog)})
            if stop and not last_step:  # (a signal at the last step: the run simply finishes)
                stopped_by = preemption.received or "a signal to another rank"
                run.logger.text(
                    f"stopped by {stopped_by} at step {step}: checkpoint {saved} is complete; run the same command to resume"
                )
                break
            if last_step:
                break
    return _after_loop(run, cfg, watchdog, ledger, stopped_by)


def _before_loop(run, cfg: Config, preemption: Preemption, watchdog: Watchdog, ledger) -> dict:
    """A summary when there is nothing to train (a stop agreed during start-up, or the run is
    already at train.max_steps); else the untrained baseline's evaluation of a fresh run."""
    state = run.state
    if preemption.agreed():  # signalled during start-up: nothing trained, nothing new to save
        run.logger.text(
            f"stopped by {preemption.received or 'a signal to another rank'} during start-up, before step {state.step + 1}; nothing new to save; run the same command to resume"
        )
        run.close()
        ledger.outcome = "preempted"
        return {**_counts(run), "stopped_by": preemption.received or "signal"}
    if run.resumed_from is None and cfg.eval.every > 0:  # curves start at step 0
        due = Due(val=True, hellaswag=run.evaluator.due(0, False).hellaswag)
        run.logger.log(0, {"tokens": 0, **run.evaluate(0, due, watchdog)})
    t = cfg.train
    if state.step >= t.max_steps or state.out_of_time(duration_s(t.time_budget)):  # nothing to do
        if run.resumed_from is not None:  # ... unless the run was killed before it finished
            row, done = dist.from_main(run.info, lambda: _ended(cfg.run.dir, state))
            if not done:
                return _complete(run, cfg, watchdog, ledger, row)
        spent = state.out_of_time(duration_s(t.time_budget))
        more = (
            "its time budget is spent and a resume keeps it: train further in a new run.dir"
            if spent
            else "raise train.max_steps to continue"
        )
        run.logger.text(
            f"already trained to step {state.step} (train.max_steps = {t.max_steps}, train.time_budget = {t.time_budget!r}); {more}"
        )
        run.close()
        return _counts(run)
    return None


def _ended(run_dir, state) -> tuple[dict | None, bool]:
    """Main process, for a run at its end: (metrics.jsonl's row of its step or None, whether it
    finished: that row logged and summary.json holding this step's summary). Data only."""
    run_dir, row = Path(run_dir), None
    path = run_dir / "metrics.jsonl"
    for line in reversed(path.read_text().splitlines() if path.is_file() else []):
        try:
            row = json.loads(line)
        except ValueError:  # a line cut short by a kill
            continue
        if isinstance(row, dict) and row.get("step") == state.step:
            break
        row = None
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return row, False
    counts = (summary.get("steps"), summary.get("tokens")) if isinstance(summary, dict) else None
    return row, row is not None and counts == (state.step, state.tokens)


def _complete(run, cfg: Config, watchdog: Watchdog, ledger, row: dict | None) -> dict:
    """A run at its end (train.max_steps, or the time budget spent) whose last checkpoint was
    saved but which was killed before it finished: what the uninterrupted run did after that
    save, now. The final evaluations and the step's row (its training metrics from the
    checkpoint's meta.json) unless metrics.jsonl has the row; then summary.json and the plot."""
    state, step = run.state, run.state.step
    parts = ["summary"] if row else ["final evaluation", "summary"]
    what = f"completing it ({', '.join(parts + ['plot'] * cfg.log.plot)})"
    if step > cfg.train.max_steps:  # a rerun with a lower max_steps: the run cannot go back
        what = f"it is past train.max_steps = {cfg.train.max_steps}, so the run ends at step {step}: {what}; to end at another step, train a new run.dir"
    run.logger.text(
        f"step {step} is the end of the run and its checkpoint is saved, but the run did not finish: {what}"
    )
    state.start_clock()
    if row:  # killed after the row was logged, before summary.json
        run.meter.last.update({k: v for k, v in row.items() if k != "step"})
    else:
        saved = dist.from_main(run.info, lambda: checkpoint.load_meta(run.resumed_from))
        trained, problem = carried(saved.get("logged"), step, state.tokens)
        if problem:
            run.logger.text(
                f"warning: step {step}'s training metrics are not logged: {problem} ({run.resumed_from})"
            )
        evals = run.evaluate(step, run.evaluator.due(step, True), watchdog)
        run.meter.report(
            step, {**trained, **({} if trained else {"tokens": state.tokens}), **evals}
        )
    return _after_loop(run, cfg, watchdog, ledger, None)


def _counts(run) -> dict:
    return {"steps": run.state.step, "tokens": run.state.tokens, "world_size": run.info.world_size}


@contextmanager
def _on_error(run, cfg: Config, watchdog: Watchdog):
    """Any exception leaving the loop (Ctrl-C, the non-finite / spike policy's NonFiniteStop, an
    error in a step): a pending background save is published first, unless a peer is dead or
    stuck (then its collectives cannot complete: it stays unpublished, and the line says so)."""
    try:
        yield
    except BaseException as e:
        run.loader.close()
        _publish_pending(run, e, watchdog)
        if isinstance(e, NonFiniteStop):
            run.logger.text(f"stopped: {e}", echo=False)  # main() prints it once
        elif isinstance(e, KeyboardInterrupt) and run.info.is_main:  # only main reads run.dir
            run.logger.text(
                f"interrupted at step {run.state.step}; the last checkpoint is {checkpoint.latest(cfg.run.dir)}; run the same command to resume"
            )
        run.close()
        raise


def _publish_pending(run, e: BaseException, watchdog: Watchdog) -> None:
    """Collective: publish the background save still pending when `e` left the loop. Every rank
    that met `e` checks in on the rendezvous store (failures.failure, a few seconds): a rank
    that does not (dead, stuck, or still training: the error was this rank's alone) means the
    save's collectives cannot complete, so it is left unpublished (resume takes the one
    before), as it is when publishing fails; a line says so. `e` ends the run either way."""
    pending, info = run.checkpointer.pending, run.info
    if pending is None:
        return
    if isinstance(e, checkpoint.LockLost):  # run.dir is another job's now: nothing is written
        run.checkpointer.pending = None
        return
    why = e if isinstance(e, failures.DistFailure) else None
    if why is None and dist.active() and info.world_size > 1:
        why = failures.failure(e, info)
    if why is None:
        watchdog.enter("save", pending.step)
        try:
            run.checkpointer.publish()  # its line: "step N: checkpoint PATH"
            return
        except Exception as error:  # noqa: BLE001 whatever it is, `e` ends the run
            why = f"{type(error).__name__}: {first_line(error)}"
    run.checkpointer.pending = None
    if info.is_main:  # only the main process reads the run directory
        run.logger.text(
            f"step {pending.step}'s checkpoint (written in the background) is not published: {why}; the last complete checkpoint is {checkpoint.latest(run.checkpointer.run_dir)}"
        )


def _after_loop(run, cfg: Config, watchdog: Watchdog, ledger, stopped_by: str | None) -> dict:
    """The last checkpoint reaches checkpoint.mirror; then a stopped run ends as it is, a
    finished one writes its summary and plot."""
    watchdog.enter("upload")
    for failed in checkpoint.wait_mirror():
        run.logger.text(f"warning: mirror upload of {failed}")
    watchdog.stop()
    run.loader.close()
    if stopped_by:  # the run is not finished: no final summary or plot
        ledger.outcome = "preempted"
        run.close()
        return {**_counts(run), "stopped_by": stopped_by}
    if run.meter.bar:
        run.meter.bar.close()
    summary = phases.finish(run, cfg)
    ledger.add_goodput(summary, run.logger)  # across every attempt in attempts.jsonl
    run.logger.close()
    return summary


def check_node_counts(cfg: Config, nproc: int, low: int, high: int) -> None:
    """Every node count the job may run on (dist.nnodes = MIN:MAX) must divide the global batch;
    else one line naming the node counts that do (the nearest ones first)."""
    bad = []
    for n in range(low, high + 1):
        try:
            batch.plan(cfg.train, nproc * n)
        except UserError as e:
            if low == high:
                raise
            bad.append((n, e))
    if bad:
        fits = [
            n
            for n in range(1, 4 * high + 1)
            if n not in dict(bad) and _divides(cfg.train, nproc * n)
        ]
        near = sorted(fits, key=lambda n: (min(abs(n - low), abs(n - high)), n))[:4]
        raise UserError(
            f"dist.nnodes = {cfg.dist.nnodes!r} with {nproc} process(es) per node: world size {nproc * bad[0][0]} ({bad[0][0]} nodes) cannot divide "
            f"train.total_batch_size = {cfg.train.total_batch_size} ({str(bad[0][1]).split(';')[0]}); node counts that can: {', '.join(map(str, sorted(near))) or 'none'}; "
            "choose MIN:MAX among them, or a total_batch_size that every node count divides"
        )


def _divides(train: TrainConfig, world: int) -> bool:
    """Whether `world` processes can share train.total_batch_size (batch.plan accepts it)."""
    try:
        batch.plan(train, world)
        return True
    except UserError:
        return False


def main(argv: list[str]) -> int:
    config_file, overrides = parse_cli(argv, __doc__)
    cfg = load_config(config_file, overrides)
    faults.install(int(os.environ.get("RANK", "0")))  # GPTRAIN_FAULT: malformed is exit 2 here
    if "RANK" not in os.environ:  # not under torchrun: maybe launch the workers ourselves
        nproc, (low, high) = (
            launch.nproc_for(cfg.dist.nproc_per_node),
            launch.node_range(cfg.dist.nnodes),
        )
        if nproc > 1 or high > 1:
            check_node_counts(cfg, nproc, low, high)  # fail before spawning anything
            return launch.launch(nproc, argv, cfg.dist)
    info = dist.DistInfo.from_env(cfg.train.device)
    if info.device_type == "cuda" and cfg.dist.hang_timeout_s != 0:  # before the NCCL group
        flight_recorder_env(cfg.run.dir)  # the watchdog can then dump the NCCL flight recorder
    dist.init(info, cfg.dist.backend, cfg.dist.timeout_s)
    finished = False
    try:
        train(cfg, info)
        finished = True
    except KeyboardInterrupt:
        return 130
    except attempts.CrashLoop as e:  # the last run.max_failed_attempts starts made no progress
        print(f"gptrain: error: {e}", file=sys.stderr)
        return attempts.EXIT_CRASH_LOOP
    except failures.ReplicaMismatch as e:  # replicas differ: the step's checkpoint not written
        print(f"gptrain: error: {e}", file=sys.stderr)
        return failures.EXIT_DIVERGED
    except NonFiniteStop as e:  # train.nonfinite = stop, or train.max_skips reached
        print(f"gptrain: error: {e}", file=sys.stderr)
        return 1
    except checkpoint.IOFailure as e:  # a checkpoint not written or read: every rank, one line
        print(f"gptrain: error: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # a dead or stuck peer: one line naming rank and operation, exit 1
        if cfg.train.deterministic and (line := nondeterministic_op(e)):  # the config, this device
            print(f"gptrain: error: {line}", file=sys.stderr)
            return 2
        failure = failures.failure(e, info) if dist.active() else None
        if failure is None:
            raise
        print(f"gptrain: error: {failure}", file=sys.stderr)
        return 1
    finally:
        dist.teardown(wait_for_peers=finished)
    return 0

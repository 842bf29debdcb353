"""`gptrain train`: the training loop, top to bottom, for one process or many.

    gptrain train --config configs/debug.toml                          # one process (CPU or a GPU)
    gptrain train --config configs/default.toml --optim.lr=1e-3        # overrides: --section.key=value
    gptrain train --config configs/default.toml --dist.nproc_per_node=auto   # one worker per GPU
    torchrun --nproc_per_node=8 -m gptrain train --config configs/gpt2_124m.toml
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \\
        --rdzv_endpoint=HOST:29500 -m gptrain train --config configs/gpt2_124m.toml   # on each node

One optimizer step consumes exactly train.total_batch_size tokens whatever the world size:
accumulation = total_batch_size / (micro_batch_size * seq_len * world_size). Gradients are
synchronised only on the last micro-step. `.item()` (a host sync) happens only on logging steps.

At each step boundary the loop asks gptrain/training/guards.py whether a rank was signalled to stop (then it
saves and exits 0) and, on steps that sync anyway, applies the non-finite policy. A step that both
saves and evaluates writes its checkpoint first. What happens before the loop and on its
logging, eval and checkpoint steps is in gptrain/training/run.py, one named function per phase.
"""

from __future__ import annotations

import os
import sys
import time

from gptrain.checkpoint import manager as checkpoint
from gptrain.config.cli import parse_cli
from gptrain.config.load import Config, load_config
from gptrain.distributed import failures, faults, launch
from gptrain.distributed import runtime as dist
from gptrain.distributed.watchdog import Watchdog, flight_recorder_env
from gptrain.errors import UserError
from gptrain.training import attempts, batch, saving
from gptrain.training import run as phases
from gptrain.training.guards import NonFiniteStop, Preemption
from gptrain.training.optim import lr_at, set_lr
from gptrain.training.precision import nondeterministic_op
from gptrain.training.step import train_step


def train(cfg: Config, info: dist.DistInfo) -> dict:
    """Run one training job; returns the summary dict (also written to run.dir/summary.json)."""
    log_path = os.path.join(cfg.run.dir, "train.log") if info.is_main else None
    preemption = Preemption().install()  # from the first moment: a signal in start-up counts too
    try:
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
        preemption.restore()


def _train(
    cfg: Config, info, watchdog: Watchdog, ledger: attempts.Ledger, preemption: Preemption
) -> dict:
    t, c = cfg.train, cfg.checkpoint
    # checkpoint.mirror: reachable and writable, or one line now (main process; it alone uploads)
    dist.on_main(info, lambda: checkpoint.configure_mirror(c.mirror, c.keep_last, c.keep_every))
    run = phases.start(cfg, info)  # data, resume, model, loader, logger: every bad input fails here
    ledger.run, ledger.training, ledger.resumed_step = run, True, run.step
    if preemption.agreed():  # signalled during start-up: nothing trained, nothing new to save
        ledger.outcome = "preempted"
        run.logger.text(
            f"stopped by {preemption.received or 'a signal to another rank'} during start-up, before step {run.step + 1}; nothing new to save; run the same command to resume"
        )
        run.close()
        return {
            "steps": run.step,
            "tokens": run.tokens,
            "world_size": info.world_size,
            "stopped_by": preemption.received or "signal",
        }
    if run.ckpt is None and cfg.eval.every > 0:  # the untrained baseline: curves start at step 0
        watchdog.enter("eval", 0)
        run.logger.log(0, {"tokens": 0, **phases.eval_and_sample(run, 0, True, False)})
    if run.step >= t.max_steps:  # nothing to do: leave the run's summary and plot as they are
        run.logger.text(
            f"already trained to step {run.step} (train.max_steps = {t.max_steps}); raise train.max_steps to continue"
        )
        run.close()
        return {"steps": run.step, "tokens": run.tokens, "world_size": info.world_size}

    # the loop; the watchdog only hears of phase boundaries (a clock read each, no sync)
    run.t_start = t_log = time.perf_counter()
    steps_since_log, last = 0, {}  # last: the latest logged metrics and eval results
    stopped_by, saved_at, every_s = None, time.monotonic(), cfg.checkpoint.every_minutes * 60
    try:
        while run.step < t.max_steps:
            watchdog.enter("step", run.step + 1)
            lr = lr_at(run.step, cfg.optim, t.max_steps)
            set_lr(run.optimizer, lr, cfg.optim)
            with faults.in_step(run.step + 1, run.model):  # GPTRAIN_FAULT drills; else nothing
                loss_sum, grad_norm = train_step(
                    run.wrapped,
                    run.model,
                    run.optimizer,
                    run.scaler,
                    run.loader.next_batch,
                    run.accum,
                    run.autocast,
                    cfg.optim.grad_clip,
                    guard=run.nonfinite,
                    step=run.step + 1,
                )
            run.spikes.record(run.step + 1, loss_sum, grad_norm)  # train.spike: no sync here
            run.step += 1
            run.tokens += t.total_batch_size
            steps_since_log += 1
            step = run.step

            final = step == t.max_steps
            eval_now = final or (cfg.eval.every > 0 and step % cfg.eval.every == 0)
            sample_now = final or (cfg.eval.sample_every > 0 and step % cfg.eval.sample_every == 0)
            log_now = step % cfg.log.every == 0 or final or eval_now or sample_now
            log_now = log_now or phases.hellaswag_due(run, step)
            if every_s:  # one tiny CPU all-reduce: did any rank get SIGTERM/USR1, or is a save due?
                stop, due = preemption.agreed_with(time.monotonic() - saved_at >= every_s)
            else:
                stop, due = preemption.agreed(), False
            save_now = (
                final or due or (cfg.checkpoint.every > 0 and step % cfg.checkpoint.every == 0)
            )
            if log_now or save_now or stop:  # steps that sync anyway: non-finite and spike policies
                bad_step = run.nonfinite.check(step)  # raises NonFiniteStop (stop, max_skips)
                spike = run.spikes.check(run.logger)  # raises NonFiniteStop (train.spike = stop)
                why = "non-finite loss or gradient norm"
                if spike is not None and (bad_step is None or spike < bad_step):
                    bad_step, why = spike, "loss spike"
                if bad_step is not None:  # rollback: past the first bad step's batch
                    watchdog.enter("save", step)  # reading a checkpoint: the save's budget
                    saving.publish(run)  # a pending save is a checked step's: roll back to it
                    run.rollbacks += 1
                    saving.roll_back(run, bad_step, step, why)
                    steps_since_log, t_log = 0, time.perf_counter()
                    if run.bar:
                        run.bar.n = run.step
                    continue
            if log_now:
                metrics = phases.step_metrics(run, loss_sum, grad_norm, lr, steps_since_log, t_log)
                if t.spike != "off":
                    metrics.update(spikes=run.spikes.count, rollbacks=run.rollbacks)
            if save_now or stop:  # before eval: an eval that fails cannot cost the checkpoint
                watchdog.enter("save", step)
                saved_path = saving.save(run, wait=final or stop)  # complete before exiting
                saved_at = time.monotonic()
                ledger.progress()  # the attempt's time accounting so far (goodput), main only
            if log_now:
                watchdog.enter("eval", step)
                metrics.update(phases.eval_and_sample(run, step, eval_now, sample_now))
                last.update(metrics)
                run.logger.log(step, metrics)
                phases.report(run, metrics)
                steps_since_log = 0
            if run.bar:
                run.bar.update(1)
            if stop and not final:  # (a signal at the last step: the run simply finishes)
                stopped_by = preemption.received or "a signal to another rank"
                run.logger.text(
                    f"stopped by {stopped_by} at step {step}: checkpoint {saved_path} is complete; run the same command to resume"
                )
                break
            if steps_since_log == 0:  # throughput intervals exclude eval, sampling and checkpoints
                t_log = time.perf_counter()
    except (KeyboardInterrupt, NonFiniteStop) as e:
        run.loader.close()
        if isinstance(e, NonFiniteStop):  # every rank stops here: a pending save is published
            saving.publish(run)
            run.logger.text(f"stopped: {e}", echo=False)  # main() prints it once
        elif info.is_main:  # only the main process reads the run directory
            run.logger.text(
                f"interrupted at step {run.step}; the last checkpoint is {checkpoint.latest(cfg.run.dir)}; run the same command to resume"
            )
        run.close()
        raise
    watchdog.enter("upload")  # the last checkpoint reaches checkpoint.mirror before the end
    for failed in checkpoint.wait_mirror():
        run.logger.text(f"warning: mirror upload of {failed}")
    watchdog.stop()
    run.loader.close()
    if stopped_by:  # the run is not finished: no final summary or plot
        ledger.outcome = "preempted"
        run.close()
        return {
            "steps": run.step,
            "tokens": run.tokens,
            "world_size": info.world_size,
            "stopped_by": stopped_by,
        }
    if run.bar:
        run.bar.close()
    summary = phases.finish(run, last)
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
            n for n in range(1, 4 * high + 1) if n not in dict(bad) and _divides(cfg, nproc * n)
        ]
        near = sorted(fits, key=lambda n: (min(abs(n - low), abs(n - high)), n))[:4]
        raise UserError(
            f"dist.nnodes = {cfg.dist.nnodes!r} with {nproc} process(es) per node: world size {nproc * bad[0][0]} ({bad[0][0]} nodes) cannot divide "
            f"train.total_batch_size = {cfg.train.total_batch_size} ({str(bad[0][1]).split(';')[0]}); node counts that can: {', '.join(map(str, sorted(near))) or 'none'}; "
            "choose MIN:MAX among them, or a total_batch_size that every node count divides"
        )


def _divides(cfg: Config, world: int) -> bool:
    try:
        batch.plan(cfg.train, world)
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
    except NonFiniteStop as e:  # train.nonfinite = stop, or train.max_skips reached
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

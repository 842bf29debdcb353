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

At each step boundary the loop asks gptrain/guard.py whether a rank was signalled to stop (then it
saves and exits 0) and, on steps that sync anyway, applies the non-finite policy. A step that both
saves and evaluates writes its checkpoint first.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict

import torch

from gptrain import batch, checkpoint, dist, failures, launch, retention, sharded
from gptrain.build import build_training
from gptrain.cli import parse_cli
from gptrain.config import Config, load_config, to_toml
from gptrain.errors import UserError
from gptrain.evals import evaluate
from gptrain.guard import NonFinite, NonFiniteStop, Preemption, roll_back
from gptrain.hellaswag import task_for
from gptrain.logs import (
    NullLogger,
    RunLogger,
    best_val,
    require_packages,
    scorecard_hparams,
    scorecard_metrics,
)
from gptrain.metrics import format_duration, measure_peak_flops, mfu, synchronize
from gptrain.step import train_step

EVAL_KEYS = ("val_loss", "val_bpb", "hellaswag_acc", "hellaswag_acc_norm")


def train(cfg: Config, info: dist.DistInfo) -> dict:
    """Run one training job; returns the summary dict (also written to run.dir/summary.json)."""
    from gptrain.corpora import resolve_data_dir
    from gptrain.loader import Dataset, TrainLoader
    from gptrain.optim import lr_at, set_lr
    from gptrain.sample import generate_text

    t, run_dir = cfg.train, cfg.run.dir
    dist.check_same_config(to_toml(cfg), info)
    require_packages(cfg.log.tensorboard, cfg.log.wandb)
    mb, accum = batch.plan(t, info.world_size)  # a batch that cannot divide fails here
    dist.check_options(cfg.dist, accum, info)
    sharded.check_async(cfg.checkpoint.async_, cfg.dist.mode, info)  # full checkpoints: refused

    # data: a prepared folder, or a built-in corpus prepared once per machine
    data_dir = dist.local_main_first(
        info, lambda: resolve_data_dir(cfg.data.dir, cfg.data.tokenizer)
    )
    dataset = Dataset(data_dir)
    tokenizer = dataset.tokenizer

    # resume: from the latest checkpoint of this run directory when there is one
    ckpt, skipped_ckpts = dist.from_main(
        info, lambda: retention.resume_point(run_dir, cfg.checkpoint.resume)
    )
    saved = {}  # only the main process reads the run directory (it alone writes it)
    if ckpt is not None:
        saved = dist.from_main(info, lambda: checkpoint.load_meta(ckpt))
        saved_tok = saved.get("tokenizer", {})
        if saved_tok.get("hash") != tokenizer.identity().get("hash"):
            raise UserError(
                f"data in {data_dir} uses tokenizer {tokenizer.identity().get('name')!r} but checkpoint {ckpt} was trained with {saved_tok.get('name')!r}; use the same data.dir/data.tokenizer or a new run.dir"
            )

    model, wrapped, optimizer, ptdtype, autocast, scaler = build_training(
        cfg, info, dataset.vocab_size, t.dtype, t.compile, saved_arch=saved.get("model")
    )
    # micro_batch_size = auto on a GPU: the largest candidate that fits (trial steps)
    mb, accum = batch.resolve(t, info, wrapped, model, autocast, dataset.vocab_size)
    dist.check_options(cfg.dist, accum, info)
    loader = TrainLoader(  # its cursor counts windows, so any micro-batch resumes exactly
        dataset,
        t.seq_len,
        mb,
        info.rank,
        info.world_size,
        t.seed,
        stride=cfg.data.stride or None,
        device=info.device,
    )
    byte_lengths = torch.as_tensor(tokenizer.token_byte_lengths(), device=info.device)
    fsdp = cfg.dist.mode == "fsdp" and info.world_size > 1
    nonfinite = NonFinite(t.nonfinite, t.max_skips, optimizer, scaler, info.device, fsdp)
    hellaswag = task_for(cfg.eval.hellaswag, cfg.eval.hellaswag_limit, tokenizer, model.config.block_size, mb * t.seq_len, info)  # fmt: skip
    best = {k: saved[k] for k in ("best_val_loss", "best_val_step") if k in saved}
    step, tokens_seen, elapsed_before, rollbacks = 0, 0, 0.0, 0
    if ckpt is not None:
        ts = sharded.restore_training(ckpt, saved, model, optimizer, loader, info)
        step, tokens_seen, elapsed_before = ts["step"], ts["tokens"], ts.get("elapsed_s", 0.0)
        nonfinite.set_count(ts.get("skipped", 0))
        rollbacks = ts.get("rollbacks", 0)
        if ts.get("world_size") != info.world_size:
            torch.manual_seed(t.seed + 1000 * info.rank + step)
    else:
        torch.manual_seed(t.seed + 1000 * info.rank)  # dropout streams differ by rank

    # logging: main process only
    peak = measure_peak_flops(info.device, ptdtype) if info.is_main else 1.0
    flops_per_token = model.flops_per_token(t.seq_len)
    bar = None
    logger = dist.on_main(  # a logger that cannot start (e.g. W&B not logged in) stops every rank
        info,
        lambda: RunLogger(
            run_dir,
            tensorboard=cfg.log.tensorboard,
            wandb_project=cfg.log.wandb,
            config={s: asdict(getattr(cfg, s)) for s in ("model", "train", "optim", "data")},
            resume_step=step if ckpt else None,
        ),
        default=NullLogger(),
    )
    if info.is_main:
        if ckpt:  # a checkpoint is written before its step's eval: that eval is in metrics.jsonl
            best = best_val(run_dir, best)
        (open(os.path.join(run_dir, "config.toml"), "w")).write(to_toml(cfg))
        if cfg.log.progress:
            from tqdm import tqdm

            bar = tqdm(
                total=t.max_steps,
                initial=step,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
            )
            logger.echo = bar.write
    logger.text(
        f"{'resumed from ' + str(ckpt) if ckpt else 'starting'}: {model.num_params():,} parameters, world size {info.world_size}, "
        f"micro-batch {mb}{' (auto)' if t.micro_batch_size == 'auto' else ''}, accumulation {accum}, {t.total_batch_size:,} tokens/step, dtype {str(ptdtype).removeprefix('torch.')}, "
        f"device {info.device}, measured peak {peak / 1e12:.2f} TFLOP/s"
    )
    for warning in skipped_ckpts:  # damaged newer checkpoints that resume fell back from
        logger.text(f"warning: {warning}")
    meta = {
        "model": asdict(model.config),
        "tokenizer": tokenizer.identity(),
        "data_dir": str(data_dir),
        "micro_batch_size": mb,
        "config": to_toml(cfg),
    }

    c, pending = cfg.checkpoint, None  # pending: a checkpoint.async save not yet published

    def publish():  # collective: complete the pending save (rename, `latest`), then retention
        nonlocal pending
        done, pending = pending, None
        if done is None:
            return None
        path = done.wait()
        dist.on_main(info, lambda: retention.prune(run_dir, done.step, c.keep_last, c.keep_every))
        logger.text(f"step {done.step}: checkpoint {path}")
        return path

    def save(step: int, wait: bool):
        nonlocal pending
        publish()  # at most one save pending: the previous one first
        meta_now = {**meta, "tokens": tokens_seen, **best}
        state = {
            "step": step,
            "tokens": tokens_seen,
            "elapsed_s": elapsed_before + time.perf_counter() - t_start,
            "skipped": nonfinite.count(),
            "rollbacks": rollbacks,
        }
        pending = sharded.save_training(  # DCP shards under FSDP2, else a full checkpoint
            run_dir, step, model, optimizer, loader, state, meta_now, info, background=c.async_
        )
        return publish() if wait or not c.async_ else None

    def hellaswag_due(step: int) -> bool:
        every = cfg.eval.hellaswag_every
        return hellaswag is not None and (step == t.max_steps or (every > 0 and step % every == 0))

    def run_eval_and_sample(step: int, eval_now: bool, sample_now: bool) -> dict:
        out = {}
        if eval_now:
            out["val_loss"], out["val_bpb"] = evaluate(
                wrapped,
                dataset,
                seq_len=t.seq_len,
                micro_batch_size=mb,
                eval_tokens=cfg.eval.tokens,
                info=info,
                autocast=autocast,
                byte_lengths=byte_lengths,
            )
            logger.text(
                f"step {step}: val loss {out['val_loss']:.4f}, val bpb {out['val_bpb']:.4f}"
            )
            if out["val_loss"] < best.get("best_val_loss", math.inf):
                best.update(best_val_loss=out["val_loss"], best_val_step=step)
        if hellaswag_due(step):
            result = hellaswag.score(wrapped, info, autocast)
            out.update(result.metrics())
            logger.text(
                f"step {step}: hellaswag acc {result.acc:.4f}, acc_norm {result.acc_norm:.4f} ({len(result.labels)} examples"
                + (
                    f", {result.truncated} truncated on the left to the model's context)"
                    if result.truncated
                    else ")"
                )
            )
        if sample_now:  # every rank generates (FSDP needs all ranks in each forward); main prints
            with autocast:
                text = generate_text(
                    wrapped,
                    tokenizer,
                    cfg.eval.sample_prompt,
                    max_new_tokens=cfg.eval.sample_tokens,
                    temperature=0.8,
                    top_k=200,
                    num_samples=1,
                    seed=t.seed,
                    device=info.device,
                )[0]
            logger.text(f"step {step}: sample: {cfg.eval.sample_prompt}{text}")
        return out

    if ckpt is None and cfg.eval.every > 0:  # the untrained baseline: curves start at step 0
        logger.log(0, {"tokens": 0, **run_eval_and_sample(0, eval_now=True, sample_now=False)})
    if step >= t.max_steps:  # nothing to do: leave the run's summary and plot as they are
        logger.text(
            f"already trained to step {step} (train.max_steps = {t.max_steps}); raise train.max_steps to continue"
        )
        if bar:
            bar.close()
        logger.close()
        return {"steps": step, "tokens": tokens_seen, "world_size": info.world_size}

    # the loop
    t_start = t_log = time.perf_counter()
    steps_since_log, last_loss, last_val = 0, float("nan"), {}
    tok_per_s = mfu_now = 0.0
    preemption, stopped_by = Preemption().install(), None
    windows_per_step = t.total_batch_size // t.seq_len  # the data cursor's advance per step
    try:
        while step < t.max_steps:
            lr = lr_at(step, cfg.optim, t.max_steps)
            set_lr(optimizer, lr, cfg.optim)
            loss_sum, grad_norm = train_step(
                wrapped, model, optimizer, scaler, loader.next_batch, accum, autocast,
                cfg.optim.grad_clip, guard=nonfinite, step=step + 1,
            )  # fmt: skip
            step += 1
            tokens_seen += t.total_batch_size
            steps_since_log += 1

            last = step == t.max_steps
            eval_now = last or (cfg.eval.every > 0 and step % cfg.eval.every == 0)
            sample_now = last or (cfg.eval.sample_every > 0 and step % cfg.eval.sample_every == 0)
            log_now = step % cfg.log.every == 0 or last or eval_now or sample_now
            log_now = log_now or hellaswag_due(step)
            save_now = last or (cfg.checkpoint.every > 0 and step % cfg.checkpoint.every == 0)
            stop = preemption.agreed()  # one tiny CPU all-reduce: did any rank get SIGTERM/USR1?
            if log_now or save_now or stop:  # steps that sync anyway: the non-finite policy
                bad_step = nonfinite.check(step)  # raises NonFiniteStop (stop, max_skips)
                if bad_step is not None:  # rollback
                    publish()  # a pending save is a checked step's: roll back to it
                    rollbacks += 1
                    step, tokens_seen = roll_back(
                        bad_step, step, run_dir, model, optimizer, loader, info, windows_per_step,
                        nonfinite, logger,
                    )  # fmt: skip
                    steps_since_log, t_log = 0, time.perf_counter()
                    if bar:
                        bar.n = step
                    continue
            if log_now:
                last_loss = dist.all_reduce_mean(loss_sum).item()  # mean over micro-steps and ranks
                if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor
                    grad_norm = grad_norm.full_tensor()
                synchronize(info.device)
                now = time.perf_counter()
                tok_per_s = steps_since_log * t.total_batch_size / (now - t_log)
                mfu_now = mfu(tok_per_s, flops_per_token, peak * info.world_size)
                metrics = {
                    "loss": last_loss,
                    "lr": lr,
                    "grad_norm": grad_norm.item(),
                    "tokens": tokens_seen,
                    "tok_per_s": tok_per_s,
                    "mfu": mfu_now,
                    "skipped": nonfinite.count(),
                }
                if t.nonfinite == "rollback":
                    metrics["rollbacks"] = rollbacks
            if save_now or stop:  # before eval: an eval that fails cannot cost the checkpoint
                saved_path = save(step, wait=last or stop)  # complete before the process exits
            if log_now:
                metrics.update(run_eval_and_sample(step, eval_now, sample_now))
                last_val.update({k: v for k, v in metrics.items() if k in EVAL_KEYS})
                logger.log(step, metrics)
                if bar:
                    bar.set_postfix(
                        loss=f"{last_loss:.3f}",
                        lr=f"{lr:.2e}",
                        tok_s=f"{tok_per_s:,.0f}",
                        mfu=f"{mfu_now:.1%}",
                    )
                logger.text(  # always in train.log; on the console only without a progress bar
                    f"step {step}/{t.max_steps} loss {last_loss:.4f} lr {lr:.2e} "
                    f"tok/s {tok_per_s:,.0f} mfu {mfu_now:.1%}",
                    echo=bar is None,
                )
                steps_since_log = 0
            if bar:
                bar.update(1)
            if stop and not last:  # (a signal at the last step: the run simply finishes)
                stopped_by = preemption.received or "a signal to another rank"
                logger.text(
                    f"stopped by {stopped_by} at step {step}: checkpoint {saved_path} is complete; run the same command to resume"
                )
                break
            if steps_since_log == 0:  # throughput intervals exclude eval, sampling and checkpoints
                t_log = time.perf_counter()
    except (KeyboardInterrupt, NonFiniteStop) as e:
        loader.close()
        if isinstance(e, NonFiniteStop):  # every rank stops here: a pending save is published
            publish()
            logger.text(f"stopped: {e}", echo=False)  # main() prints it once
        elif info.is_main:  # only the main process reads the run directory
            logger.text(
                f"interrupted at step {step}; the last checkpoint is {checkpoint.latest(run_dir)}; run the same command to resume"
            )
        if bar:
            bar.close()
        logger.close()
        raise
    finally:
        preemption.restore()
    loader.close()
    if bar:
        bar.close()
    if stopped_by:  # the run is not finished: no final summary or plot
        logger.close()
        return {"steps": step, "tokens": tokens_seen, "world_size": info.world_size, "stopped_by": stopped_by}  # fmt: skip

    elapsed = elapsed_before + time.perf_counter() - t_start
    summary = {
        "steps": step,
        "tokens": tokens_seen,
        "train_loss": last_loss,
        **last_val,
        **best,
        "elapsed_s": elapsed,
        "tok_per_s": tok_per_s,
        "mfu": mfu_now,
        "world_size": info.world_size,
        "micro_batch_size": mb,
    }
    if info.is_main:
        from gptrain.plot import plot_run

        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        plot_path = plot_run(run_dir)
        train_tokens = sum(len(s) for s in dataset.shards["train"])
        logger.scorecard(
            scorecard_hparams(cfg, model.config, tokens_seen, train_tokens),
            scorecard_metrics(summary),
        )
        logger.text(
            f"done: {step} steps, {tokens_seen:,} tokens in {format_duration(elapsed)}; train loss {last_loss:.4f}"
            + (
                f", val loss {last_val['val_loss']:.4f}, val bpb {last_val['val_bpb']:.4f}"
                if last_val
                else ""
            )
            + f"; {tok_per_s:,.0f} tok/s, MFU {mfu_now:.1%}; plot {plot_path}"
        )
    logger.close()
    return summary


def main(argv: list[str]) -> int:
    config_file, overrides = parse_cli(argv, __doc__)
    cfg = load_config(config_file, overrides)
    if "RANK" not in os.environ:  # not under torchrun: maybe launch the workers ourselves
        nproc, nnodes = launch.nproc_for(cfg.dist.nproc_per_node), cfg.dist.nnodes
        if nproc > 1 or nnodes > 1:
            batch.plan(cfg.train, nproc * nnodes)  # fail before spawning anything
            return launch.launch(nproc, argv, cfg.dist)
    info = dist.DistInfo.from_env(cfg.train.device)
    dist.init(info, cfg.dist.backend, cfg.dist.timeout_s)
    finished = False
    try:
        train(cfg, info)
        finished = True
    except KeyboardInterrupt:
        return 130
    except NonFiniteStop as e:  # train.nonfinite = stop, or train.max_skips reached
        print(f"gptrain: error: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # a dead or stuck peer: one line naming rank and operation, exit 1
        failure = failures.failure(e, info) if dist.active() else None
        if failure is None:
            raise
        print(f"gptrain: error: {failure}", file=sys.stderr)
        return 1
    finally:
        dist.teardown(wait_for_peers=finished)
    return 0

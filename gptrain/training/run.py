"""The phases around `train()`'s loop (its checkpoint phases: training/saving.py), in the order a run meets them (gptrain/commands/train.py calls them):

    start            data, resume point, model + optimizer, micro-batch, loader, logger, first line
    eval_and_sample  validation loss and bits/byte, HellaSwag, a text sample (every rank takes part)
    save / publish   a checkpoint (DCP shards under FSDP2, else full); with checkpoint.async the
                     previous save is published (renamed, `latest`, retention) before the next
    step_metrics     a logging step's numbers (the only host syncs of the loop)
    report           the progress bar and train.log line of a logging step
    finish           summary.json, the plot, the scorecard, the last line

`Run` holds what `start` builds and the counters a checkpoint saves, so each phase is a function of
it, not a closure inside the loop.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from gptrain.checkpoint import manager as checkpoint
from gptrain.config.load import Config, to_toml
from gptrain.data.loader import Dataset, TrainLoader
from gptrain.data.prepare import resolve_data_dir
from gptrain.distributed import parallelize
from gptrain.distributed import runtime as dist
from gptrain.errors import UserError
from gptrain.evals.hellaswag import HellaSwag, task_for
from gptrain.evals.val import ValLoss
from gptrain.logs.loggers import (
    NullLogger,
    RunLogger,
    best_val,
    require_packages,
    scorecard_hparams,
    scorecard_metrics,
)
from gptrain.logs.mfu import (
    checked_mfu,
    format_duration,
    format_flops,
    synchronize,
)
from gptrain.training import batch
from gptrain.training.build import build_training
from gptrain.training.choices import Choices
from gptrain.training.guards import NonFinite, Spikes
from gptrain.training.timing import cached_peak

EVAL_KEYS = ("val_loss", "val_bpb", "hellaswag_acc", "hellaswag_acc_norm")


@dataclass
class Run:
    """One training job as `start` leaves it; step, tokens, rollbacks and best move as it trains."""

    cfg: Config
    info: dist.DistInfo
    dataset: Dataset
    model: torch.nn.Module  # the plain model: its keys are the checkpoint's
    wrapped: torch.nn.Module  # what forward runs through (compile, DDP or FSDP2 around the model)
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler  # active only for float16
    autocast: AbstractContextManager
    ptdtype: torch.dtype
    mb: int
    accum: int
    loader: TrainLoader
    val: ValLoss  # evals/task.py's shape, like hellaswag
    nonfinite: NonFinite
    spikes: Spikes  # train.spike: the loss-spike detector (guards.py)
    hellaswag: HellaSwag | None
    logger: NullLogger  # a RunLogger on the main process
    bar: tqdm | None  # the progress bar (main process, log.progress)
    meta: dict  # what every checkpoint's meta.json records besides the counters
    ckpt: Path | None  # the checkpoint resumed from
    peak: float = 1.0  # measured peak FLOP/s of this device (main process)
    peak_cached: bool = False  # the peak came from the speed-choice cache
    choices: Choices | None = None  # the measured speed choices (training/choices.py)
    flops_per_token: float = 0.0
    step: int = 0
    tokens: int = 0
    elapsed_before: float = 0.0  # training time of the attempts before this one
    rollbacks: int = 0
    best: dict = field(default_factory=dict)
    t_start: float = 0.0  # when this attempt's loop started
    pending: checkpoint.Pending | None = None  # a checkpoint.async save not yet published

    def close(self) -> None:
        if self.bar:
            self.bar.close()
        self.logger.close()


def start(cfg: Config, info: dist.DistInfo) -> Run:
    """Everything before the first step; every input error surfaces here, before any training."""
    t, run_dir = cfg.train, cfg.run.dir
    dist.check_same_config(to_toml(cfg), info)
    require_packages(cfg.log.tensorboard, cfg.log.wandb)
    mb, accum = batch.plan(t, info.world_size)  # a batch that cannot divide fails here
    dist.check_options(cfg.dist, accum, info)
    checkpoint.check_async(cfg.checkpoint.async_, cfg.dist, info)  # full checkpoints: refused

    # data: a prepared folder, or a built-in corpus prepared once per machine
    data_dir = dist.local_main_first(
        info, lambda: resolve_data_dir(cfg.data.dir, cfg.data.tokenizer)
    )
    dataset = Dataset(data_dir)
    tokenizer = dataset.tokenizer

    # resume: from the latest checkpoint of this run directory when there is one
    ckpt, skipped_ckpts = dist.from_main(
        info, lambda: checkpoint.resume_point(run_dir, cfg.checkpoint.resume)
    )
    saved = {}  # only the main process reads the run directory (it alone writes it)
    if ckpt is not None:
        saved = dist.from_main(info, lambda: checkpoint.load_meta(ckpt))
        saved_tok = saved.get("tokenizer", {})
        if saved_tok.get("hash") != tokenizer.identity().get("hash"):
            raise UserError(
                f"data in {data_dir} uses tokenizer {tokenizer.identity().get('name')!r} but checkpoint {ckpt} was trained with {saved_tok.get('name')!r}; use the same data.dir/data.tokenizer or a new run.dir"
            )

    built = build_training(
        cfg,
        info,
        dataset.vocab_size,
        t.dtype,
        t.compile,
        saved_arch=saved.get("model"),
        saved_choices=saved.get("speed_choices"),
    )
    model, wrapped, optimizer, ptdtype, autocast, scaler = built
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
    fsdp = parallelize.shards(cfg.dist, info)
    run = Run(
        cfg=cfg,
        info=info,
        dataset=dataset,
        model=model,
        wrapped=wrapped,
        optimizer=optimizer,
        scaler=scaler,
        autocast=autocast,
        ptdtype=ptdtype,
        mb=mb,
        accum=accum,
        loader=loader,
        val=ValLoss(
            dataset,
            seq_len=t.seq_len,
            micro_batch_size=mb,
            eval_tokens=cfg.eval.tokens,
            byte_lengths=torch.as_tensor(tokenizer.token_byte_lengths(), device=info.device),
        ),
        nonfinite=NonFinite(t.nonfinite, t.max_skips, optimizer, scaler, info.device, fsdp),
        spikes=Spikes(t.spike, t.spike_z, t.spike_window),
        hellaswag=task_for(
            cfg.eval.hellaswag,
            cfg.eval.hellaswag_limit,
            tokenizer,
            model.config.block_size,
            mb * t.seq_len,
            info,
        ),
        logger=None,
        bar=None,
        meta={
            "model": asdict(model.config),
            "tokenizer": tokenizer.identity(),
            "data_dir": str(data_dir),
            "micro_batch_size": mb,
            "config": to_toml(cfg),
            "speed_choices": built.choices.decisions(),  # a resume computes the same way
        },
        ckpt=ckpt,
        choices=built.choices,
        flops_per_token=model.flops_per_token(t.seq_len),
        best={k: saved[k] for k in ("best_val_loss", "best_val_step") if k in saved},
    )
    if ckpt is not None:
        ts = checkpoint.restore(ckpt, saved, model, optimizer, loader, info)
        run.step, run.tokens = ts["step"], ts["tokens"]
        run.elapsed_before, run.rollbacks = ts.get("elapsed_s", 0.0), ts.get("rollbacks", 0)
        run.nonfinite.set_count(ts.get("skipped", 0))
        run.spikes.load_state_dict(ts.get("spikes"))
        if ts.get("world_size") != info.world_size:
            torch.manual_seed(t.seed + 1000 * info.rank + run.step)
    else:
        torch.manual_seed(t.seed + 1000 * info.rank)  # dropout streams differ by rank
    peak_warnings: list[str] = []
    if info.is_main:
        run.peak, run.peak_cached, peak_warnings = cached_peak(info.device, ptdtype)
    _start_logging(run, skipped_ckpts + peak_warnings)
    return run


def _start_logging(run: Run, warnings: list[str]) -> None:
    """The logger (main process only), config.toml, the progress bar and the first line."""
    cfg, info, t = run.cfg, run.info, run.cfg.train
    run.logger = (
        dist.on_main(  # a logger that cannot start (e.g. W&B not logged in) stops every rank
            info,
            lambda: RunLogger(
                cfg.run.dir,
                tensorboard=cfg.log.tensorboard,
                wandb_project=cfg.log.wandb,
                config={s: asdict(getattr(cfg, s)) for s in ("model", "train", "optim", "data")},
                resume_step=run.step if run.ckpt else None,
            ),
            default=NullLogger(),
        )
    )
    if info.is_main:
        if (
            run.ckpt
        ):  # a checkpoint is written before its step's eval: that eval is in metrics.jsonl
            run.best = best_val(cfg.run.dir, run.best)
        (open(os.path.join(cfg.run.dir, "config.toml"), "w")).write(to_toml(cfg))
        if cfg.log.progress:
            run.bar = tqdm(
                total=t.max_steps,
                initial=run.step,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
            )
            run.logger.echo = run.bar.write
    run.logger.text(
        f"{'resumed from ' + str(run.ckpt) if run.ckpt else 'starting'}: {run.model.num_params():,} parameters, world size {info.world_size}, "
        f"micro-batch {run.mb}{' (auto)' if t.micro_batch_size == 'auto' else ''}, accumulation {run.accum}, {t.total_batch_size:,} tokens/step, dtype {str(run.ptdtype).removeprefix('torch.')}{' (deterministic kernels)' * t.deterministic}, "
        f"device {info.device}, measured peak {format_flops(run.peak)}{' (cached)' * run.peak_cached}; {run.choices.line()}"
    )
    # the speed-choice cache's (choices and peak), and damaged newer checkpoints resume skipped
    for warning in run.choices.warnings + warnings:
        run.logger.text(f"warning: {warning}")


def hellaswag_due(run: Run, step: int) -> bool:
    every = run.cfg.eval.hellaswag_every
    last = step == run.cfg.train.max_steps
    return run.hellaswag is not None and (last or (every > 0 and step % every == 0))


def eval_and_sample(run: Run, step: int, eval_now: bool, sample_now: bool) -> dict:
    """Validation (and best-so-far), HellaSwag when due, a text sample; returns their metrics."""
    from gptrain.evals.generate import generate_text

    cfg, logger, out = run.cfg, run.logger, {}
    if eval_now:
        val = run.val.run(run.wrapped, run.info, run.autocast)
        out.update(val.metrics)
        logger.text(f"step {step}: {val.line}")
        if out["val_loss"] < run.best.get("best_val_loss", math.inf):
            run.best.update(best_val_loss=out["val_loss"], best_val_step=step)
    if hellaswag_due(run, step):
        scored = run.hellaswag.run(run.wrapped, run.info, run.autocast)
        out.update(scored.metrics)
        logger.text(f"step {step}: {scored.line}")
    if sample_now:  # every rank generates (FSDP needs all ranks in each forward); main prints
        with run.autocast:
            text = generate_text(
                run.wrapped,
                run.dataset.tokenizer,
                cfg.eval.sample_prompt,
                max_new_tokens=cfg.eval.sample_tokens,
                temperature=0.8,
                top_k=200,
                num_samples=1,
                seed=cfg.train.seed,
                device=run.info.device,
            )[0]
        logger.text(f"step {step}: sample: {cfg.eval.sample_prompt}{text}")
    return out


def step_metrics(run: Run, loss_sum, grad_norm, lr: float, steps: int, since: float) -> dict:
    """A logging step's metrics over the `steps` steps since `since` (the loop's host syncs)."""
    t = run.cfg.train
    loss = dist.all_reduce_mean(loss_sum).item()  # mean over micro-steps and ranks
    if hasattr(grad_norm, "full_tensor"):  # FSDP: a DTensor
        grad_norm = grad_norm.full_tensor()
    synchronize(run.info.device)
    tok_per_s = steps * t.total_batch_size / (time.perf_counter() - since)
    # MFU <= 1: an achieved rate above the measured peak raises the peak, with a warning
    mfu_now, run.peak, warning = checked_mfu(
        tok_per_s, run.flops_per_token, run.peak, run.info.world_size
    )
    if warning:
        run.logger.text(f"warning: step {run.step}: {warning}")
    metrics = {
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm.item(),
        "tokens": run.tokens,
        "tok_per_s": tok_per_s,
        "mfu": mfu_now,
        "skipped": run.nonfinite.count(),
    }
    if t.nonfinite == "rollback":
        metrics["rollbacks"] = run.rollbacks
    return metrics


def report(run: Run, metrics: dict) -> None:
    """The progress bar's numbers and the step's line (train.log; the console without a bar)."""
    m = metrics
    if run.bar:
        run.bar.set_postfix(
            loss=f"{m['loss']:.3f}",
            lr=f"{m['lr']:.2e}",
            tok_s=f"{m['tok_per_s']:,.0f}",
            mfu=f"{m['mfu']:.1%}",
        )
    run.logger.text(
        f"step {run.step}/{run.cfg.train.max_steps} loss {m['loss']:.4f} lr {m['lr']:.2e} "
        f"tok/s {m['tok_per_s']:,.0f} mfu {m['mfu']:.1%}",
        echo=run.bar is None,
    )


def finish(run: Run, last: dict) -> dict:
    """summary.json, the loss plot, the scorecard and the last line; returns the summary.
    `last`: the last logging step's metrics (train loss, speed) and latest eval results."""
    from gptrain.logs.plot import plot_run

    total = run.elapsed_before + time.perf_counter() - run.t_start
    loss, tok_per_s, mfu_now = (
        last.get("loss", math.nan),
        last.get("tok_per_s", 0.0),
        last.get("mfu", 0.0),
    )
    val = {k: v for k, v in last.items() if k in EVAL_KEYS}
    summary = {
        "steps": run.step,
        "tokens": run.tokens,
        "train_loss": loss,
        **val,
        **run.best,
        "elapsed_s": total,
        "tok_per_s": tok_per_s,
        "mfu": mfu_now,
        "world_size": run.info.world_size,
        "micro_batch_size": run.mb,
        "speed_choices": run.choices.as_dict(),  # each choice, how it was made, its timings
    }
    if run.info.is_main:
        run_dir = run.cfg.run.dir
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        plot_path = plot_run(run_dir)
        train_tokens = sum(len(s) for s in run.dataset.shards["train"])
        run.logger.scorecard(
            scorecard_hparams(
                run.cfg.train, run.cfg.optim, run.model.config, run.tokens, train_tokens
            ),
            scorecard_metrics(summary),
        )
        vals = (
            f", val loss {val['val_loss']:.4f}, val bpb {val['val_bpb']:.4f}"
            if "val_loss" in val
            else ""
        )
        run.logger.text(
            f"done: {run.step} steps, {run.tokens:,} tokens in {format_duration(total)}; train loss {loss:.4f}"
            f"{vals}; {tok_per_s:,.0f} tok/s, MFU {mfu_now:.1%}; plot {plot_path}"
        )
    return summary

"""What `gptrain train` builds before its loop and does after it (the loop itself is
gptrain/commands/train.py):

    start    inputs checked, data, resume point, model + optimizer, micro-batch, loader, the parts
             that decide at each step boundary (checkpointer, evaluator, meter), restore, logger
    finish   summary.json, the plot, the scorecard, the last line

`Run` holds the built parts; the counters a checkpoint saves live in its TrainState.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import tomllib
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tqdm import tqdm

from gptrain.cache import atomic_write_bytes
from gptrain.checkpoint import manager as checkpoint
from gptrain.config.fields import duration_s
from gptrain.config.load import Config, to_toml
from gptrain.config.sections import OptimConfig
from gptrain.data.loader import Dataset, TrainLoader, val_window_count
from gptrain.data.prepare import resolve_data_dir
from gptrain.distributed import parallelize
from gptrain.distributed import runtime as dist
from gptrain.errors import UserError
from gptrain.evals.hellaswag import task_for
from gptrain.evals.val import ValLoss
from gptrain.logs.loggers import (
    NullLogger,
    RunLogger,
    best_val,
    require_packages,
    scorecard_hparams,
    scorecard_metrics,
)
from gptrain.logs.mfu import format_duration, format_flops, synchronize
from gptrain.model.arch import config_to_dict
from gptrain.training import batch, recorded
from gptrain.training.build import build_training
from gptrain.training.choices import Choices
from gptrain.training.evaluator import EVAL_KEYS, Evaluator
from gptrain.training.guards import NonFinite, Spikes
from gptrain.training.meter import Meter
from gptrain.training.optim import lr_at, set_lr
from gptrain.training.saving import Checkpointer
from gptrain.training.state import TrainState
from gptrain.training.step import train_step
from gptrain.training.timing import cached_peak


@dataclass
class Run:
    """One training job's built parts, as `start` leaves them."""

    info: dist.DistInfo
    dataset: Dataset
    model: torch.nn.Module  # the plain model: its keys are the checkpoint's
    wrapped: torch.nn.Module  # what forward runs through (compile, DDP or FSDP2 around the model)
    optimizer: torch.optim.Optimizer
    autocast: AbstractContextManager
    ptdtype: torch.dtype
    plan: tuple[int, int]  # (micro-batch size, accumulation steps)
    loader: TrainLoader
    state: TrainState  # step, tokens, clock, guards, GradScaler: one checkpoint part
    checkpointer: Checkpointer
    evaluator: Evaluator
    meter: Meter
    logger: NullLogger  # a RunLogger on the main process
    choices: Choices  # the measured speed choices (training/choices.py)
    resumed_from: Path | None  # the checkpoint this attempt resumed from

    def train_step(self, grad_clip: float, timed: bool = False):
        """One optimizer step of the run's batch; (loss sum, grad norm) as device tensors.
        `timed` (train.time_budget): the device finishes the step before it returns, so that the
        step's time is its device time, not the time to queue it."""
        s = self.state
        out = train_step(
            self.wrapped,
            self.model,
            self.optimizer,
            s.scaler,
            self.loader.next_batch,
            self.plan[1],
            self.autocast,
            grad_clip,
            guard=s.nonfinite,
            step=s.step + 1,
        )
        if timed:
            synchronize(self.info.device)
        return out

    def set_lr(self, o: OptimConfig, max_steps: int, budget_s: float | None) -> float:
        """This step's learning rate, set on the optimizer: the schedule read at the step, or
        with train.time_budget at the further along of the step and the share of the budget
        spent (TrainState.schedule_step; the training time is agreed by every rank)."""
        lr = lr_at(self.state.schedule_step(max_steps, budget_s), o, max_steps)
        set_lr(self.optimizer, lr, o)
        return lr

    def evaluate(self, step: int, due, watchdog) -> dict:
        """Collective: the due evaluations; a background save is published before them (an
        evaluation that fails cannot cost a finished checkpoint)."""
        if due:
            self.checkpointer.publish()
        e, args = self.evaluator, (self.wrapped, self.info, self.autocast, self.logger, watchdog)
        return e.run(step, due, *args)

    def close(self) -> None:
        if self.meter.bar:
            self.meter.bar.close()
        self.logger.close()


def start(cfg: Config, info: dist.DistInfo) -> Run:
    """Everything before the first step; every input error surfaces here, before any training."""
    dist.check_same_config(to_toml(cfg), info)
    require_packages(cfg.log.tensorboard, cfg.log.wandb)
    options = batch.candidates(cfg.train, info.world_size)  # a batch that cannot divide fails
    c = cfg.checkpoint
    background = checkpoint.background_saves(c.async_, cfg.dist, info)  # checkpoint.async
    # checkpoint.mirror: reachable and writable, or one line now (main process; it alone uploads)
    dist.on_main(info, lambda: checkpoint.configure_mirror(c.mirror, c.keep_last, c.keep_every))
    # data: a prepared folder, or a built-in corpus prepared once per machine
    data_dir = dist.local_main_first(
        info, lambda: resolve_data_dir(cfg.data.dir, cfg.data.tokenizer)
    )
    dataset = Dataset(data_dir)
    val_window_count(dataset, cfg.train.seq_len, cfg.eval.tokens)  # a sample the split holds
    # resume: the newest checkpoint of this run's timeline, or checkpoint.resume's step
    plan = dist.from_main(
        info, lambda: checkpoint.plan_resume(cfg.run.dir, c.resume, _timeline_text(cfg, dataset))
    )
    ckpt, warnings = plan.path, list(plan.warnings)
    saved = dist.from_main(info, lambda: checkpoint.load_meta(ckpt)) if ckpt else {}
    _check_tokenizer(dataset, data_dir, ckpt, saved)
    _check_budget(cfg.train.time_budget, ckpt, saved)
    run = _build(cfg, info, dataset, ckpt, saved, options, background)
    _restore(run, cfg.train.seed, saved)
    if info.is_main:
        run.meter.peak, cached, peak_warnings = cached_peak(info.device, run.ptdtype)
        warnings += peak_warnings
    _start_logging(run, cfg, warnings, cached if info.is_main else False)
    # start-up succeeded: the run's timeline is recorded (resume = STEP acts once)
    dist.on_main(info, lambda: checkpoint.begin(cfg.run.dir, plan))
    if plan.line:
        run.logger.text(plan.line)
    return run


def _timeline_text(cfg: Config, dataset: Dataset) -> str:
    """The config as a timeline knows it: data.dir named by the prepared folder's manifest (its
    tokenizer, shards and their hashes; not the command line that wrote it), not by its path, so
    the same data staged to another folder for a requeued job is the same training."""
    content = {k: v for k, v in dataset.manifest.items() if k != "command"}
    manifest = json.dumps(content, sort_keys=True).encode()
    data = replace(cfg.data, dir="manifest sha256 " + hashlib.sha256(manifest).hexdigest())
    return to_toml(replace(cfg, data=data))


def _restore(run: Run, seed: int, saved: dict) -> None:
    """Every stateful part from the checkpoint resumed (if any); the dropout RNG seeded per rank."""
    info, ckpt = run.info, run.resumed_from
    if ckpt is not None:
        ts = checkpoint.restore(ckpt, saved, run.model, run.optimizer, run.loader, info)
        run.state.load_state_dict(ts)
        if ts.get("world_size") != info.world_size:
            torch.manual_seed(seed + 1000 * info.rank + run.state.step)
    else:
        torch.manual_seed(seed + 1000 * info.rank)  # dropout streams differ by rank
    best = {k: saved[k] for k in ("best_val_loss", "best_val_step") if k in saved}
    run.evaluator.best.update(best)


def _check_tokenizer(dataset: Dataset, data_dir, ckpt, saved: dict) -> None:
    saved_tok, tok = saved.get("tokenizer", {}), dataset.tokenizer.identity()
    if ckpt is not None and saved_tok.get("hash") != tok.get("hash"):
        raise UserError(
            f"data in {data_dir} uses tokenizer {tok.get('name')!r} but checkpoint {ckpt} was trained with {saved_tok.get('name')!r}; use the same data.dir/data.tokenizer or a new run.dir"
        )


def _check_budget(budget: str, ckpt, saved: dict) -> None:
    """A resumed run keeps the train.time_budget its checkpoint was trained under: the lr
    schedule is read at the share of the budget spent, so another budget would move it back or
    forward at once. (A checkpoint whose meta.json has no config is not checked.)"""
    try:
        old = tomllib.loads(saved["config"]).get("train", {}).get("time_budget", "")
    except (KeyError, TypeError, tomllib.TOMLDecodeError):
        return
    was, now = duration_s(old) if old else None, duration_s(budget) if budget else None
    if ckpt is None or was == now or (was and now and math.isclose(was, now, rel_tol=1e-9)):
        return
    said = f"train.time_budget = {old!r}" if old else "no train.time_budget (its lr followed steps)"
    fix = f"--train.time_budget={old}" if old else "no train.time_budget"
    raise UserError(
        f"train.time_budget = {budget!r} but checkpoint {ckpt} was trained under {said}: its lr schedule would jump; rerun with {fix}, or start a new run.dir"
    )


def _micro_batch(cfg: Config, info, built, vocab_size: int, saved: dict, options: list[int]):
    """(micro-batch, accumulation steps): a resumed run keeps its recorded micro-batch; auto on a
    GPU takes the largest candidate that fits (trial steps)."""
    t = cfg.train
    dist.check_options(cfg.dist, 1, info, trial=batch.runs_trials(t, info))
    recorded_mb = batch.recorded_micro_batch(saved)
    model, wrapped, _, _, autocast, _ = built
    args = (wrapped, model, autocast, vocab_size, options, recorded_mb)
    mb, accum = batch.resolve(t, info, *args, built.choices.warnings)
    dist.check_options(cfg.dist, accum, info)
    return mb, accum


def _build(
    cfg: Config, info, dataset: Dataset, ckpt, saved: dict, options: list[int], background: bool
) -> Run:
    """The model, optimizer and loader, and the parts that act at the step boundary."""
    t = cfg.train
    built = build_training(
        cfg,
        info,
        dataset.vocab_size,
        t.dtype,
        t.compile,
        saved_arch=saved.get("model"),
        saved_choices=saved.get("speed_choices"),
        micro_batch=options[0],
    )
    model, wrapped, optimizer, ptdtype, autocast, scaler = built
    mb, accum = _micro_batch(cfg, info, built, dataset.vocab_size, saved, options)
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
    nonfinite = NonFinite(t.nonfinite, t.max_skips, optimizer, scaler, info.device, fsdp)
    state = TrainState(nonfinite, Spikes(t.spike, t.spike_z, t.spike_window), scaler)
    meta = _meta(cfg, model, dataset, mb, built.choices)
    evaluator = _evaluator(cfg, info, dataset, model.config.block_size, mb)
    parts = (model, optimizer, loader)
    budget_s = duration_s(t.time_budget)  # None: no train.time_budget
    checkpointer = Checkpointer(
        cfg.checkpoint, cfg.run.dir, info, parts, state, meta, background, budget_s
    )
    checkpointer.best = evaluator.best  # each checkpoint records the best validation so far
    meter = Meter(cfg.log.every, t, model.flops_per_token(t.seq_len), info)
    return Run(
        info,
        dataset,
        model,
        wrapped,
        optimizer,
        autocast,
        ptdtype,
        (mb, accum),
        loader,
        state,
        checkpointer,
        evaluator,
        meter,
        NullLogger(),
        built.choices,
        ckpt,
    )


def _meta(cfg: Config, model, dataset: Dataset, mb: int, choices) -> dict:
    """What every checkpoint's meta.json records besides the counters."""
    return {
        "model": config_to_dict(model.config),  # with its "arch" (none: gpt2)
        "tokenizer": dataset.tokenizer.identity(),
        "data_dir": str(dataset.data_dir),
        "micro_batch_size": mb,
        "config": to_toml(cfg),
        "speed_choices": recorded.record(choices, cfg.train.compile, mb),  # a resume keeps them
    }


def _evaluator(cfg: Config, info, dataset: Dataset, block_size: int, mb: int) -> Evaluator:
    """The validation loss on eval.tokens of the val split and HellaSwag, at the run's micro-batch."""
    t, e, tokenizer = cfg.train, cfg.eval, dataset.tokenizer
    byte_lengths = torch.as_tensor(tokenizer.token_byte_lengths(), device=info.device)
    val = ValLoss(
        dataset,
        seq_len=t.seq_len,
        micro_batch_size=mb,
        eval_tokens=e.tokens,
        byte_lengths=byte_lengths,
    )
    hellaswag = task_for(
        e.hellaswag, e.hellaswag_limit, tokenizer, block_size, mb * t.seq_len, info
    )
    return Evaluator(e, val, hellaswag, tokenizer, t.seed)


def _start_logging(run: Run, cfg: Config, warnings: list[str], peak_cached: bool) -> None:
    """The logger (main process only), config.toml, the progress bar and the first line."""
    info, t, state = run.info, cfg.train, run.state
    run.logger = (
        dist.on_main(  # a logger that cannot start (e.g. W&B not logged in) stops every rank
            info,
            lambda: RunLogger(
                cfg.run.dir,
                tensorboard=cfg.log.tensorboard,
                wandb_project=cfg.log.wandb,
                config={s: asdict(getattr(cfg, s)) for s in ("model", "train", "optim", "data")},
                resume_step=state.step if run.resumed_from else None,
                wandb_run_id=state.wandb_run_id,
            ),
            default=NullLogger(),
        )
    )
    state.wandb_run_id = getattr(run.logger, "wandb_run_id", None) or state.wandb_run_id
    run.checkpointer.logger = run.meter.logger = run.logger
    if info.is_main:
        if run.resumed_from:  # a checkpoint is written before its step's eval: it is in metrics
            run.evaluator.best.update(best_val(cfg.run.dir, run.evaluator.best))
        # written whole or not at all: users resume with --config RUN/config.toml
        atomic_write_bytes(Path(cfg.run.dir) / "config.toml", to_toml(cfg).encode())
        if cfg.log.progress and sys.stderr.isatty():  # batch logs get plain step lines
            bar = tqdm(
                total=t.max_steps,
                initial=state.step,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
            )
            run.meter.bar, run.logger.echo = bar, bar.write
    mb, accum = run.plan
    how = "resumed from " + str(run.resumed_from) if run.resumed_from else "starting"
    run.logger.text(
        f"{how}: {run.model.num_params():,} parameters, world size {info.world_size}, "
        f"micro-batch {mb}{' (auto)' if t.micro_batch_size == 'auto' else ''}, accumulation {accum}, {t.total_batch_size:,} tokens/step, dtype {str(run.ptdtype).removeprefix('torch.')}{' (deterministic kernels)' * t.deterministic}, "
        f"device {info.device}, measured peak {format_flops(run.meter.peak)}{' (cached)' * peak_cached}; {run.choices.line()}"
    )
    if run.ptdtype == torch.float16 and info.device_type != "cuda":
        warnings.append(
            "train.dtype = float16 on a CPU is emulated and slow; it serves to test the float16 path (loss scaling)"
        )  # noqa: E501
    # the speed-choice cache's (choices and peak), and damaged newer checkpoints resume skipped
    for warning in run.choices.warnings + warnings:
        run.logger.text(f"warning: {warning}")


def finish(run: Run, cfg: Config) -> dict:
    """summary.json, the loss plot, the scorecard and the last line; returns the summary."""
    from gptrain.logs.plot import plot_run

    state, last = run.state, run.meter.last
    total = state.elapsed()
    loss, tok_per_s, mfu = (
        last.get("loss", math.nan),
        last.get("tok_per_s", 0.0),
        last.get("mfu", 0.0),
    )
    val = {k: v for k, v in last.items() if k in EVAL_KEYS}
    summary = {
        "steps": state.step,
        "tokens": state.tokens,
        "train_loss": loss,
        **val,
        **run.evaluator.best,
        "elapsed_s": total,
        "train_s": state.train_s,  # optimizer steps only: train.time_budget's clock
        "tok_per_s": tok_per_s,
        "mfu": mfu,
        "world_size": run.info.world_size,
        "micro_batch_size": run.plan[0],
        "speed_choices": run.choices.as_dict(),  # each choice, how it was made, its timings
    }
    if run.info.is_main:
        text = json.dumps(summary, indent=2)
        atomic_write_bytes(Path(cfg.run.dir) / "summary.json", text.encode())
        plotted = f"; plot {plot_run(cfg.run.dir)}" if cfg.log.plot else ""
        train_tokens = sum(len(s) for s in run.dataset.shards["train"])
        hparams = scorecard_hparams(
            cfg.train, cfg.optim, run.model.config, state.tokens, train_tokens
        )
        run.logger.scorecard(hparams, scorecard_metrics(summary))
        vals = (
            f", val loss {val['val_loss']:.4f}, val bpb {val['val_bpb']:.4f}"
            if "val_loss" in val
            else ""
        )
        budget_s = duration_s(cfg.train.time_budget)
        if budget_s and state.step >= cfg.train.max_steps and not state.out_of_time(budget_s):
            run.logger.text(
                f"warning: train.max_steps = {cfg.train.max_steps} came first, after {state.train_s:.1f} s of train.time_budget = {cfg.train.time_budget!r}: "
                "the lr schedule followed the steps to min_lr; next time, a larger train.max_steps lets the budget end the run (in a new run.dir: this run has ended)"
            )
        run.logger.text(
            f"done: {state.step} steps, {state.tokens:,} tokens in {format_duration(total)}; train loss {loss:.4f}"
            f"{vals}; {tok_per_s:,.0f} tok/s, MFU {mfu:.1%}{plotted}"
        )
    return summary

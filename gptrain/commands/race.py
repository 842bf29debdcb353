"""`gptrain race`: configs x seeds, each run an ordinary run directory, compared with statistics.

    gptrain race --config configs/default.toml --config configs/race.toml --seeds 5 \\
        --data.dir=data/tinyshakespeare --eval.tokens=100000 --out races/shakespeare

    --config FILE            a config to race (one flag per config); the first is the baseline
    --seeds N                runs per config, train.seed = 1..N (initialisation and data order);
                             default 5, at least 2 when there is more than one config
    --target VALUE|baseline  the val loss to reach: a number, or baseline (the baseline's mean
                             final val loss; the default)
    --out DIR                the race's folder (default races/<first>-vs-<second>...)
    --hellaswag              also score HellaSwag at the end of each run (eval.hellaswag)
    --section.key=value      an override applied to every run

The race is frozen at its start: DIR/plan.json holds each config as resolved (file + overrides),
and each run is `gptrain train --config DIR/<config>/config.toml --train.seed=K
--run.dir=DIR/<config>/seed_K`, that config.toml written from the plan (a config file edited
mid-race changes nothing; the next command naming it is refused). The runs are
trained in this process one after another (its output goes to stderr); on a machine with several
GPUs, when every run is one process, one run per GPU at a time (subprocesses, CUDA_VISIBLE_DEVICES).
A race stopped part-way continues when the same command runs again: every run directory resumes,
or says it is already trained, through gptrain train's own resume. At the end: DIR/race.json
(every run's curve and numbers, each config's statistics), DIR/race.png, and the markdown table
on stdout. The statistics are explained in docs/race.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from gptrain.cache import atomic_write_bytes
from gptrain.config.cli import parse_cli
from gptrain.config.load import SECTIONS, Config, key_name, load_config
from gptrain.errors import UserError, first_line
from gptrain.logs.plot import read_metrics
from gptrain.logs.race import analyse, curve_from_metrics
from gptrain.logs.race_report import markdown_table, plot_race

PLAN = "plan.json"  # the race's configs as resolved, checked when the race continues
CONFIG = "config.toml"  # OUT/<label>/config.toml: the plan's config, which its runs train


class Stopped(Exception):
    """A run was stopped by a signal (preemption): the race stops too, and continues next time."""


@dataclass(frozen=True)
class Args:
    configs: list[str]
    seeds: int
    target: float | str
    out: Path
    hellaswag: bool
    overrides: list[str]


@dataclass(frozen=True)
class Job:
    label: str
    seed: int
    run_dir: Path
    argv: tuple[str, ...]  # gptrain train's arguments


def parse_args(argv: list[str]) -> Args:
    """The race's own flags; everything else is an override (`--section.key=value`)."""
    values: dict[str, list[str]] = {"config": [], "seeds": [], "target": [], "out": []}
    hellaswag, rest, i = False, [], 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        name = flag[2:]
        if flag in ("-h", "--help"):
            print(__doc__.strip())
            raise SystemExit(0)
        if flag == "--hellaswag":
            hellaswag = True
        elif name in values:
            if not eq:
                if i + 1 >= len(argv):
                    raise UserError(f"{flag} needs a value; see gptrain race --help")
                value, i = argv[i + 1], i + 1
            values[name].append(value)
        else:
            rest.append(argv[i])
        i += 1
    _, overrides = parse_cli(rest)
    if not values["config"]:
        raise UserError(
            "gptrain race needs --config FILE, the baseline first, then each config to compare, e.g. --config a.toml --config b.toml"
        )
    labels = run_labels(values["config"])
    out = values["out"][-1] if values["out"] else str(Path("races") / "-vs-".join(labels))
    seeds = _seeds(values["seeds"][-1] if values["seeds"] else "5", len(values["config"]))
    target = _target(values["target"][-1] if values["target"] else "baseline")
    return Args(values["config"], seeds, target, Path(out), hellaswag, overrides)


def _seeds(text: str, n_configs: int) -> int:
    try:
        seeds = int(text)
    except ValueError:
        raise UserError(f"--seeds {text!r} is not a whole number; use e.g. --seeds 5") from None
    if seeds < 1 or (seeds < 2 and n_configs > 1):
        raise UserError(
            f"--seeds {seeds}: comparing configs needs a mean and a spread per config (intervals, p-values), so 2 seeds or more; use --seeds 2 or more (5 by default)"
        )
    return seeds


def _target(text: str) -> float | str:
    if text == "baseline":
        return text
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise UserError(
            f"--target {text!r} is neither a val loss nor 'baseline'; use a number (e.g. --target 3.28) or --target baseline (the baseline's mean final val loss)"
        )
    return value


def run_labels(paths: list[str]) -> list[str]:
    """Each config's name in the race: its file's stem, numbered when two stems are the same."""
    labels: list[str] = []
    for path in paths:
        stem, n = Path(path).stem, 2
        label = stem
        while label in labels:
            label, n = f"{stem}-{n}", n + 1
        labels.append(label)
    return labels


def data_identity(cfg: Config) -> tuple:
    """What makes two configs' val losses comparable: a prepared folder's tokenizer and splits
    (from its manifest), or a built-in corpus's name and tokenizer."""
    folder = Path(cfg.data.dir) / "manifest.json"
    if folder.is_file():
        m = json.loads(folder.read_text())
        return (
            "folder",
            m.get("tokenizer", {}).get("hash"),
            json.dumps(m.get("spans"), sort_keys=True),
            json.dumps(m.get("splits"), sort_keys=True),
        )
    return ("built-in", cfg.data.dir, cfg.data.tokenizer)


def check_comparable(paths: list[str], cfgs: list[Config]) -> None:
    """Every config measures the same val loss: same data and tokenizer, same eval.tokens."""
    base = cfgs[0]
    for path, cfg in zip(paths[1:], cfgs[1:], strict=True):
        if data_identity(cfg) != data_identity(base):
            raise UserError(
                f"--config {path} trains on data.dir = {cfg.data.dir!r} (data.tokenizer = {cfg.data.tokenizer!r}) but the baseline {paths[0]} on {base.data.dir!r} ({base.data.tokenizer!r}): their losses cannot be compared; race configs on the same data and tokenizer (or set both for every run with --data.dir=... --data.tokenizer=...)"
            )
        if cfg.eval.tokens != base.eval.tokens:
            raise UserError(
                f"--config {path} validates on eval.tokens = {cfg.eval.tokens} but the baseline {paths[0]} on {base.eval.tokens}: their val losses are not the same measurement; set one for every run with --eval.tokens=N"
            )


@dataclass(frozen=True)
class Plan:
    """The race as resolved before anything runs: each config's label, file and resolved config
    (its TOML text is what every run of it trains), and the runs in order."""

    labels: list[str]
    files: dict[str, str]  # label -> the --config file it was resolved from
    cfgs: list[Config]
    texts: dict[str, str]  # label -> to_toml(resolved config): the plan's config
    jobs: list[Job]
    overrides: list[str]

    def as_json(self) -> dict:
        return {"configs": self.texts, "files": self.files, "overrides": self.overrides}


def plan(args: Args) -> Plan:
    """Every config loaded and checked, and the runs, before anything is written. Each run
    trains from OUT/<label>/config.toml, written from the plan's text (never from the file)."""
    labels = run_labels(args.configs)
    cfgs, jobs = [], []
    for path, label in zip(args.configs, labels, strict=True):
        extra = list(args.overrides)
        if args.hellaswag and not load_config(path, extra).eval.hellaswag:
            extra.append("eval.hellaswag=hellaswag")
        cfgs.append(load_config(path, extra))
        for seed in range(1, args.seeds + 1):
            run_dir = args.out / label / f"seed_{seed}"
            argv = ["--config", str(args.out / label / CONFIG)]
            argv += [f"--train.seed={seed}", f"--run.dir={run_dir}"]
            jobs.append(Job(label, seed, run_dir, tuple(argv)))
    check_comparable(args.configs, cfgs)
    # seed by seed, every config in turn: a drift of the machine's speed falls on every config
    # alike, and a race stopped part-way has as many seeds of each
    jobs.sort(key=lambda j: (j.seed, labels.index(j.label)))
    texts = {label: config_text(cfg) for label, cfg in zip(labels, cfgs, strict=True)}
    files = dict(zip(labels, args.configs, strict=True))
    return Plan(labels, files, cfgs, texts, jobs, list(args.overrides))


def check_plan(out: Path, p: Plan) -> None:
    """A folder that holds a race of other configs, or of the same files edited since, is
    refused: its runs would continue the old ones under the same names."""
    path = out / PLAN
    if not path.is_file():
        return
    theirs = json.loads(path.read_text())
    old = theirs.get("configs", {})
    if list(old) != p.labels:
        raise UserError(
            f"--out {out} holds a race of other configs ({', '.join(old) or 'none'}; this command races {', '.join(p.labels)}); run that race's command to continue it, or choose another --out"
        )
    changed = [label for label in p.labels if old[label] != p.texts[label]]
    if not changed:
        return
    if theirs.get("overrides", p.overrides) != p.overrides:
        raise UserError(
            f"--out {out} holds a race run with other overrides ({' '.join('--' + o for o in theirs['overrides']) or 'none'}); run it with the same overrides to continue it, or choose another --out"
        )
    label = changed[0]
    raise UserError(
        f"--config {p.files[label]} changed since the race in {out} began ({out}/{PLAN} holds {label} as it was, also in {out}/{label}/{CONFIG}); restore the file to continue the race, or race the edited config into a new --out"
    )


def config_text(cfg: Config) -> str:
    """The resolved config as TOML: to_toml's text, with each string written with JSON's
    escapes (valid in a TOML basic string), so a value holding a newline (a sample prompt)
    loads back as it was."""

    def fmt(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
        return repr(v)

    lines = []
    for section in SECTIONS:
        lines.append(f"[{section}]")
        items = dataclasses.asdict(getattr(cfg, section)).items()
        lines += [f"{key_name(k)} = {fmt(v)}" for k, v in items]
        lines.append("")
    return "\n".join(lines)


def write_configs(out: Path, p: Plan) -> None:
    """OUT/plan.json and, from it, each config's OUT/<label>/config.toml that its runs train."""
    atomic_write_bytes(out / PLAN, json.dumps(p.as_json(), indent=2).encode())
    for label in p.labels:
        (out / label).mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(out / label / CONFIG, p.texts[label].encode())


def _train_in_process(argv: list[str]) -> int:
    """One run through gptrain train's own entry point in this process; its output to stderr,
    so that stdout holds only the table."""
    from gptrain.commands import train

    with contextlib.redirect_stdout(sys.stderr):
        return train.main(argv)


def gpu_slots(cfgs: list[Config]) -> list[str | None]:
    """CUDA_VISIBLE_DEVICES values to run on at the same time: one per GPU when there are
    several and every run is one CUDA process; else [None] (one run at a time, in this process)."""
    import torch

    from gptrain.distributed import launch

    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return [None]
    if any(
        c.train.device == "cpu"
        or launch.nproc_for(c.dist.nproc_per_node) != 1
        or str(c.dist.nnodes) != "1"
        for c in cfgs
    ):
        return [None]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        return [d.strip() for d in visible.split(",") if d.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


def run_all(jobs: list[Job], slots: list[str | None], logs: Path) -> dict[Job, int]:
    """Each job's exit code. A run stopped by Ctrl-C stops the race (KeyboardInterrupt)."""
    if slots == [None]:
        codes = {}
        for n, job in enumerate(jobs, 1):
            print(
                f"race: run {n}/{len(jobs)}: {job.label} seed {job.seed} -> {job.run_dir}",
                file=sys.stderr,
            )
            try:
                codes[job] = _train_in_process(list(job.argv))
            except (UserError, KeyboardInterrupt):
                raise
            except Exception as e:  # a bug or a crash in one run: recorded, the race goes on
                print(f"race: {job.run_dir} failed: {first_line(e)}", file=sys.stderr)
                codes[job] = 1
            if codes[job] == 130:
                raise KeyboardInterrupt
            if codes[job] == 0 and not (job.run_dir / "summary.json").is_file():
                raise Stopped(
                    f"{job.run_dir} was stopped by a signal (its checkpoint is saved); run the same command to continue the race"
                )
        return codes
    return _run_parallel(jobs, slots, logs)


def _run_parallel(jobs: list[Job], slots: list[str | None], logs: Path) -> dict[Job, int]:
    """One `python -m gptrain train` subprocess per slot at a time; output in OUT/logs/."""
    logs.mkdir(parents=True, exist_ok=True)
    pending, running, codes = list(jobs), {}, {}  # running: slot index -> (job, process, log)
    try:
        while pending or running:
            for i in [i for i in range(len(slots)) if i not in running and pending]:
                job = pending.pop(0)
                env = {**os.environ, "CUDA_VISIBLE_DEVICES": slots[i]}
                log = open(logs / f"{job.label}_seed_{job.seed}.log", "a")
                cmd = [sys.executable, "-m", "gptrain", "train", *job.argv]
                proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
                running[i] = (job, proc, log)
                print(
                    f"race: GPU {slots[i]}: {job.label} seed {job.seed} -> {job.run_dir}",
                    file=sys.stderr,
                )
            for i, (job, proc, log) in list(running.items()):
                if proc.poll() is not None:
                    log.close()
                    codes[job] = proc.returncode
                    del running[i]
            time.sleep(0.2)
    finally:
        for _job, proc, log in running.values():  # stopped: these runs resume next time
            proc.terminate()
            proc.wait()
            log.close()
    return codes


def flops_per_token(cfg: Config) -> float:
    """The model's training FLOPs per token (the model's own count), built on the meta device."""
    from gptrain.data.prepare import resolve_data_dir
    from gptrain.data.shards import read_manifest
    from gptrain.training.build import build_model

    vocab = int(read_manifest(resolve_data_dir(cfg.data.dir, cfg.data.tokenizer))["vocab_size"])
    return build_model(cfg, vocab, meta=True).flops_per_token(cfg.train.seq_len)


def record(job: Job, code: int, fpt: float) -> dict:
    """A run's entry in race.json: status, curve and final numbers."""
    rec = {"config": job.label, "seed": job.seed, "dir": str(job.run_dir), "status": "done"}
    summary_path = job.run_dir / "summary.json"
    if code != 0 or not summary_path.is_file():
        rec["status"] = f"failed (exit {code})" if code else "not finished"
        return rec
    rows = read_metrics(job.run_dir)
    curve = curve_from_metrics(rows)
    if not curve["tokens"]:
        return {**rec, "status": "no evaluation in metrics.jsonl"}
    if not math.isfinite(curve["val_loss"][-1]):  # diverged: no loss to compare
        return {**rec, "status": f"final val loss {curve['val_loss'][-1]}"}
    summary = json.loads(summary_path.read_text())
    g = summary.get("goodput", {})
    hella = [r["hellaswag_acc_norm"] for r in rows if "hellaswag_acc_norm" in r]
    return {
        **rec,
        "val_loss": curve["val_loss"][-1],
        "val_bpb": curve["val_bpb"][-1],
        "tokens": summary.get("tokens", curve["tokens"][-1]),
        "train_s": curve["seconds"][-1],
        "wall_s": g["wall_s"] - g.get("gaps_s", 0.0) if "wall_s" in g else None,
        "flops_per_token": fpt,
        "hellaswag_acc_norm": hella[-1] if hella else None,
        "curve": curve,
    }


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    p = plan(args)
    check_plan(args.out, p)
    args.out.mkdir(parents=True, exist_ok=True)
    write_configs(args.out, p)
    labels, cfgs, jobs = p.labels, p.cfgs, p.jobs
    try:
        codes = run_all(jobs, gpu_slots(cfgs), args.out / "logs")
    except Stopped as e:
        print(f"gptrain race: {e}", file=sys.stderr)
        return 0
    fpt = {label: flops_per_token(cfg) for label, cfg in zip(labels, cfgs, strict=True)}
    runs = [record(job, codes[job], fpt[job.label]) for job in jobs]
    if not any(r["status"] == "done" for r in runs if r["config"] == labels[0]):
        raise UserError(
            f"no run of the baseline {labels[0]} finished (see {args.out}/{labels[0]}/*/train.log); fix the cause and run the same command to continue"
        )
    race = {"command": ["gptrain", "race", *argv], "seeds": args.seeds}
    race |= analyse(runs, labels, args.target)
    atomic_write_bytes(args.out / "race.json", json.dumps(race, indent=1).encode())
    plot_race(race, args.out / "race.png")
    print(markdown_table(race))
    print(f"\nrace.json and race.png in {args.out}", file=sys.stderr)
    return 0

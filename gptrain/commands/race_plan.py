"""The race's plan (gptrain/commands/race.py runs it): the command line, each config loaded and
checked with the race's overrides, the runs in order, and DIR/plan.json, which freezes the race
at its start:

    parse_args(argv)       the race's flags; everything else is an override for every run
    plan(args)             every config resolved and checked, the runs (seed by seed, every config
                           in turn), before anything is written
    check_plan(out, plan)  a folder holding a race of other configs, other overrides or a config
                           file edited since the race began is refused (one line naming it)
    write_configs(out, p)  DIR/plan.json and each config's DIR/<label>/config.toml, which its
                           runs train (never the --config file itself)
    regime(out, cfg)       the baseline's val tokens' unigram entropy, cached in DIR/unigram.json
    flops_per_token(cfg)   a config's training FLOPs per token
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

from gptrain.cache import atomic_write_bytes
from gptrain.config.cli import parse_cli
from gptrain.config.load import Config, load_config, resolved_again, to_toml
from gptrain.config.sections import DataConfig
from gptrain.errors import UserError

PLAN = "plan.json"  # the race's configs as resolved, checked when the race continues
UNIGRAM = "unigram.json"  # the regime's cache in the race's folder
CONFIG = "config.toml"  # OUT/<label>/config.toml: the plan's config, which its runs train


@dataclass(frozen=True)
class Args:
    configs: list[str]
    seeds: int
    target: float | str
    out: Path
    hellaswag: bool
    overrides: list[str]
    ladder: list[float] | None = None  # multiples of the first config's train.max_steps
    jobs: int = 1  # CPU runs side by side


@dataclass(frozen=True)
class Job:
    label: str
    seed: int
    run_dir: Path
    argv: tuple[str, ...]  # gptrain train's arguments


def parse_args(argv: list[str], usage: str) -> Args:
    """The race's own flags; everything else is an override (`--section.key=value`); --help
    prints `usage`."""
    values: dict[str, list[str]] = {
        "config": [],
        "seeds": [],
        "target": [],
        "out": [],
        "ladder": [],
        "jobs": [],
    }
    hellaswag, rest, i = False, [], 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        name = flag[2:]
        if flag in ("-h", "--help"):
            print(usage.strip())
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
    if any(not c.strip() for c in values["config"]):
        raise UserError(
            "--config is empty; name a config file to race, e.g. --config configs/race.toml (one --config per config, the baseline first)"
        )
    labels = run_labels(values["config"])
    out = _out(values["out"][-1] if values["out"] else str(Path("races") / "-vs-".join(labels)))
    ladder = _ladder(values["ladder"][-1]) if values["ladder"] else None
    n_configs = len(values["config"]) + (len(ladder) - 1 if ladder else 0)  # rungs count
    seeds = _seeds(values["seeds"][-1] if values["seeds"] else "5", n_configs)
    target = _target(values["target"][-1] if values["target"] else "baseline")
    jobs = _jobs(values["jobs"][-1] if values["jobs"] else "1")
    return Args(values["config"], seeds, target, out, hellaswag, overrides, ladder, jobs)


def _jobs(text: str) -> int:
    digits = text.strip()
    if not (digits.isascii() and digits.isdigit()) or int(digits) < 1:
        raise UserError(
            f"--jobs {text!r}: give the number of CPU runs to train at a time, 1 or more, e.g. --jobs 2"
        )
    return int(digits)


def _out(text: str) -> Path:
    """The race's folder: a folder or a path to make one at, never empty (the current folder)."""
    if not text.strip():
        raise UserError(
            "--out is empty; name the race's folder, e.g. --out races/mine (or leave --out out for races/<first>-vs-<second>...)"
        )
    out = Path(text)
    for path in (out, *out.parents):
        if path.exists() and not path.is_dir():
            raise UserError(
                f"--out {text}: {path} is a file, not a folder; choose another --out for the race's folder"
            )
    return out


def _ladder(text: str) -> list[float]:
    """The ladder's multiples of the first config's train.max_steps: 2 or more, increasing, > 0."""
    try:
        rungs = [float(x) for x in text.split(",")]
    except ValueError:
        rungs = [math.nan]
    if not all(math.isfinite(m) for m in rungs):
        raise UserError(
            f"--ladder {text!r} is not a list of multiples; write the multiples of the first config's train.max_steps, e.g. --ladder 1,1.5,2,3"
        )
    if len(rungs) < 2:
        raise UserError(
            f"--ladder {text}: one rung has nothing to interpolate between; give 2 rungs or more (3 or more also fit a power law), e.g. --ladder 1,1.5,2,3"
        )
    if min(rungs) <= 0 or any(b <= a for a, b in zip(rungs, rungs[1:], strict=False)):
        raise UserError(
            f"--ladder {text}: the multiples must be above 0 and increasing, e.g. --ladder 1,1.5,2,3"
        )
    return rungs


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


def data_identity(data: DataConfig) -> tuple:
    """What makes two configs' val losses comparable: a prepared folder's tokenizer and splits
    (from its manifest), or a built-in corpus's name and tokenizer."""
    folder = Path(data.dir) / "manifest.json"
    if folder.is_file():
        m = json.loads(folder.read_text())
        return (
            "folder",
            m.get("tokenizer", {}).get("hash"),
            json.dumps(m.get("spans"), sort_keys=True),
            json.dumps(m.get("splits"), sort_keys=True),
        )
    return ("built-in", data.dir, data.tokenizer)


def check_comparable(paths: list[str], cfgs: list[Config]) -> None:
    """Every config measures the same val loss: same data and tokenizer, same eval.tokens."""
    base = cfgs[0]
    for path, cfg in zip(paths[1:], cfgs[1:], strict=True):
        if data_identity(cfg.data) != data_identity(base.data):
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
    rungs: dict[str, float] | None = None  # the ladder's labels -> multiples, increasing

    def as_json(self) -> dict:
        return {"configs": self.texts, "files": self.files, "overrides": self.overrides}


def plan(args: Args) -> Plan:
    """Every config loaded and checked, and the runs, before anything is written. Each run
    trains from OUT/<label>/config.toml, written from the plan's text (never from the file).
    With a ladder the first config is its rungs, `<label>@<multiple>`."""
    entries = []  # (label, file, overrides)
    for n, (path, label) in enumerate(zip(args.configs, run_labels(args.configs), strict=True)):
        extra = list(args.overrides)
        if args.hellaswag and not load_config(path, extra).eval.hellaswag:
            extra.append("eval.hellaswag=hellaswag")
        if n == 0 and args.ladder:
            entries += rung_entries(path, label, extra, args.ladder)
        else:
            entries.append((label, path, extra))
    labels = [label for label, _, _ in entries]
    for n, (label, path, _) in enumerate(entries):
        if label in labels[:n]:
            raise UserError(
                f"--config {path}: its name in the race, {label}, is also a rung of the ladder of {entries[0][1]}; rename the file (its name without '@')"
            )
    cfgs = [load_config(path, extra) for _, path, extra in entries]
    files = {label: path for label, path, _ in entries}
    check_comparable(list(files.values()), cfgs)
    jobs = []
    for label in labels:
        for seed in range(1, args.seeds + 1):
            run_dir = args.out / label / f"seed_{seed}"
            argv = ["--config", str(args.out / label / CONFIG)]
            argv += [f"--train.seed={seed}", f"--run.dir={run_dir}"]
            jobs.append(Job(label, seed, run_dir, tuple(argv)))
    # seed by seed, every config in turn: a drift of the machine's speed falls on every config
    # alike, and a race stopped part-way has as many seeds of each; within a seed the longest
    # schedule first, so that runs side by side (--jobs) end together, not on one slot
    tokens = {label: cfg.train.max_steps * cfg.train.total_batch_size for label, cfg in zip(labels, cfgs, strict=True)}  # fmt: skip
    jobs.sort(key=lambda j: (j.seed, -tokens[j.label], labels.index(j.label)))
    texts = {label: to_toml(cfg) for label, cfg in zip(labels, cfgs, strict=True)}
    rungs = None
    if args.ladder:
        rungs = {label: m for label, m in zip(labels, args.ladder, strict=False)}
    return Plan(labels, files, cfgs, texts, jobs, list(args.overrides), rungs)


def rung_entries(path: str, label: str, extra: list[str], multiples: list[float]) -> list:
    """The ladder's rungs of the config at `path`: each a complete run with its own schedule,
    train.max_steps and optim.warmup_steps scaled by the multiple (the warmup the same share;
    the decay ends at the rung's last step; a wsd decay_fraction is already a share)."""
    cfg = load_config(path, extra)
    if cfg.train.time_budget:
        raise UserError(
            f"--ladder scales train.max_steps, but {path} stops at train.time_budget = {cfg.train.time_budget!r} and its schedule follows the time; race a ladder without a time budget (--train.time_budget=)"
        )
    steps = [math.floor(m * cfg.train.max_steps + 0.5) for m in multiples]
    for m, n in zip(multiples, steps, strict=True):
        if n < 1:
            raise UserError(
                f"--ladder: rung {m:g} x train.max_steps = {cfg.train.max_steps} of {path} is {n} steps; choose multiples of 1 step or more"
            )
    for i in range(1, len(steps)):
        if steps[i] == steps[i - 1]:
            m1, m2, n1 = multiples[i - 1], multiples[i], steps[i]
            raise UserError(
                f"--ladder: rungs {m1:g} and {m2:g} both train {n1} steps (train.max_steps = {cfg.train.max_steps} of {path}); choose multiples further apart"
            )
    return [
        (
            f"{label}@{m:g}",
            path,
            [
                *extra,
                f"train.max_steps={n}",
                f"optim.warmup_steps={math.floor(m * cfg.optim.warmup_steps + 0.5)}",
            ],
        )
        for m, n in zip(multiples, steps, strict=True)
    ]


def read_plan(path: Path) -> dict:
    """OUT/plan.json: an object whose "configs" maps each label to its resolved TOML text."""
    try:
        plan = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        why = f"not JSON: {e}"
    else:
        configs = plan.get("configs") if isinstance(plan, dict) else None
        overrides = plan.get("overrides", []) if isinstance(plan, dict) else None
        if (
            isinstance(configs, dict)
            and all(isinstance(t, str) for t in configs.values())
            and isinstance(overrides, list)
            and all(isinstance(o, str) for o in overrides)
        ):
            return plan
        why = "not an object whose configs map each config to its TOML text"
    raise UserError(
        f"{path} is not a race's plan ({why}); move it away if the folder holds a race you want to keep, or choose another --out"
    )


def check_plan(out: Path, p: Plan) -> None:
    """A folder that holds a race of other configs, or of the same files edited since, is
    refused: its runs would continue the old ones under the same names. A config saved by an
    older gptrain is compared as this one resolves it: a key added since, at its default, is no
    edit."""
    path = out / PLAN
    if not path.exists() and not path.is_symlink():
        return
    theirs = read_plan(path)  # a folder or a dangling link there: one line too
    old = theirs["configs"]
    if list(old) != p.labels:
        raise UserError(
            f"--out {out} holds a race of other configs ({', '.join(old) or 'none'}; this command races {', '.join(p.labels)}); run that race's command to continue it, or choose another --out"
        )
    changed = [
        label
        for label in p.labels
        if old[label] != p.texts[label] and resolved_again(old[label]) != p.texts[label]
    ]
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


def write_configs(out: Path, p: Plan) -> None:
    """OUT/plan.json and, from it, each config's OUT/<label>/config.toml that its runs train."""
    atomic_write_bytes(out / PLAN, json.dumps(p.as_json(), indent=2).encode())
    for label in p.labels:
        (out / label).mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(out / label / CONFIG, p.texts[label].encode())


def remove_configs(out: Path, p: Plan) -> None:
    """Undo write_configs: a plan that no run has used must not refuse the corrected command."""
    (out / PLAN).unlink(missing_ok=True)
    for label in p.labels:
        (out / label / CONFIG).unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # only when empty
            (out / label).rmdir()


def trained(run_dir: Path) -> bool:
    """Whether a run has trained or evaluated anything (its plan is then in use)."""
    return any(
        (run_dir / name).exists() for name in ("checkpoints", "metrics.jsonl", "summary.json")
    )


def flops_per_token(cfg: Config) -> float:
    """The model's training FLOPs per token (the model's own count), built on the meta device."""
    from gptrain.data.prepare import resolve_data_dir
    from gptrain.data.shards import read_manifest
    from gptrain.training.build import build_model

    vocab = int(read_manifest(resolve_data_dir(cfg.data.dir, cfg.data.tokenizer))["vocab_size"])
    return build_model(cfg, vocab, meta=True).flops_per_token(cfg.train.seq_len)


def regime(out: Path, cfg: Config) -> dict:
    """The unigram entropy of the val tokens the baseline scores, under its train split's counts
    (gptrain/data/unigram.py), computed once: cached in OUT/unigram.json, keyed by the data's
    manifest, seq_len, eval.tokens and how the val windows are chosen."""
    from gptrain.data.prepare import resolve_data_dir
    from gptrain.data.unigram import unigram_entropy

    data_dir = resolve_data_dir(cfg.data.dir, cfg.data.tokenizer)
    manifest = hashlib.sha256((data_dir / "manifest.json").read_bytes()).hexdigest()
    key = {
        "manifest_sha256": manifest,
        "seq_len": cfg.train.seq_len,
        "eval_tokens": cfg.eval.tokens,
        "val_windows": "evenly spaced over the split",  # gptrain/data/loader.py's val_windows
    }
    path = out / UNIGRAM
    with contextlib.suppress(OSError, ValueError, AttributeError, KeyError):
        cached = json.loads(path.read_text())
        if cached["key"] == key:
            return cached["value"]
    value = unigram_entropy(data_dir, cfg.train.seq_len, cfg.eval.tokens)
    atomic_write_bytes(path, json.dumps({"key": key, "value": value}, indent=1).encode())
    return value

"""Fair tuning for the token-efficiency study (docs/study.md): every arm gets the same number of
trials of one seed on the tuning split, by the same search rule.

    python benchmarks/study/tune.py --data.dir=data/study/prose-tune --out tuning/prose [--budget 16]
        [--arms baseline,recipe,ablation,nanochat,nanochat_adamw] [--cap 28] [--jobs 1]
        [--kept DIR] [--section.key=value ...]

The arms and what each searches (its config's values are the search's starting point):

    baseline        configs/study_baseline.toml (llm.c's AdamW recipe) with the recipe's
                    freedoms: lr x warmup share x weight decay (0, 0.1) x final-lr ratio
                    (min_lr / lr) x beta2 (0.95, or BETA2_KEPT: 0.95's half-life in tokens at
                    2^19-token batches kept at the study's 4,096) x embed_lr_factor (the
                    embeddings' and head's lr, optim.embed_lr, as a factor of lr by powers of 2)
    recipe          configs/study_recipe.toml (Muon + wsd): Muon lr x AdamW lr x decay share
    ablation        configs/study_ablation.toml (AdamW with the recipe's wsd, lr and no weight
                    decay): lr x decay share x warmup share (starting at the recipe's 2 steps of
                    the tuning cell's 976, WARMUP_START) x embed_lr_factor (the recipe's AdamW
                    lr for the embeddings is its own: the ablation may differ from it only by Muon)
    nanochat        configs/study_nanochat.toml (the recipe on nanochat's block): as the recipe
                    x head_lr_factor (the untied head's lr, optim.head_lr, as a factor of the
                    embedding's by powers of 2: nanochat gives the two lrs 75x apart)
    nanochat_adamw  configs/study_nanochat_adamw.toml (nanochat's block with the baseline's
                    AdamW): as the baseline, every freedom included, x head_lr_factor

Every axis starts at its arm's config (a factor of 1 leaves optim.embed_lr at 0, which is lr),
except the ablation's warmup share, which starts at its 2 steps at the tuning cell's length.

The rule, the same for every arm: a coordinate search on a lattice per axis (learning rates by
factors of 2, shares by fixed steps, weight decay its two values), axes in a fixed order. Each
proposal changes one axis of the best point so far: first the best's missing neighbours on each
axis, in order; when the best sits at the end of an axis, that axis is extended by one step past
it (a learning rate may grow or shrink without limit; a share stops at its bounds, where the best
is "at a bound", not at an edge). Only when the best has tried neighbours on every side of every
axis does the search refine: it halves the spacing around the best on the axis refined least so
far (at most 6 times). So every best is strictly inside its grid unless a bound stops it.

Budget: each arm runs `--budget` trials; an arm whose best is still at an edge then runs up to
`--cap` more trials that only extend and fill neighbours; then every arm is brought to the same
count, the largest, with more trials by the same rule. Where such a trial moves an arm's best to
an edge, that arm fills again and the others are brought level again, until no arm short of
budget + cap is at an edge. Every arm ends with the same number of trials (unless one runs out
of points to try: the table says so). `--jobs 2` runs two arms' searches side by side (give each
trial one thread: OMP_NUM_THREADS=1); each arm's search depends on its own results only, so it
tries the same points as one arm at a time.

Each trial is an ordinary run directory, OUT/<arm>/<point> (`gptrain train --config ARM
[overrides] --train.seed=1 --run.dir=...`): it resumes itself, and a finished one is read from
its summary.json. The search is a function of the results, so running the same command again
replays it and trains only what is missing. With `--kept DIR` each finished trial is also kept in
DIR/<arm>/<point> (benchmarks/study/study_saved.py), and a trial missing from OUT but kept there
with the config it would train is copied back instead of trained: a tuning continues on another
machine from what the repository holds. OUT/tune.json holds every trial and each arm's best;
the table goes to stdout.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from gptrain.cache import atomic_write_bytes
from gptrain.config.cli import parse_cli
from gptrain.config.load import load_config, to_toml
from gptrain.errors import UserError, first_line

sys.path.insert(0, str(Path(__file__).resolve().parent))
import study_reuse  # noqa: E402
import study_saved  # noqa: E402
from search import Axis, Search, tune  # noqa: E402, F401  (tune: the search over every arm)
from study_cells import batch_tokens, tune_cell  # noqa: E402

from gptrain.distributed.watchdog import EXIT_CODE as HUNG  # noqa: E402  (a run that hung)
from gptrain.training.optim import beta2_at  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SEED = 1
BETA2_KEPT = beta2_at(batch_tokens())  # 0.95 at 2^19 tokens per step, the same half-life here
WARMUP_START = 2 / tune_cell("prose").steps  # the recipe's 2 warmup steps at the tuning cell


@dataclass(frozen=True)
class Arm:
    config: str
    axes: tuple[Axis, ...]

    def overrides(self, point: dict[str, float], max_steps: int) -> list[str]:
        """The point as `section.key=value` overrides of the arm's config."""
        out = []
        for name, value in point.items():
            if name == "warmup_share":
                out.append(f"optim.warmup_steps={round(value * max_steps)}")
            elif name == "final_lr_ratio":
                out.append(f"optim.min_lr={value * point['lr']:.6g}")
            elif name == "embed_lr_factor":  # 1: optim.embed_lr 0, which is lr itself
                out.append(f"optim.embed_lr={0 if value == 1 else value * point['lr']:.6g}")
            elif name == "head_lr_factor":  # 1: optim.head_lr 0, the embedding's lr itself
                embed = point["lr"] * point.get("embed_lr_factor", 1.0)
                out.append(f"optim.head_lr={0 if value == 1 else value * embed:.6g}")
            elif name == "beta2":  # every digit: 1 - beta2 is the half-life
                out.append(f"optim.beta2={value!r}")
            else:
                out.append(f"optim.{name}={value:.6g}")
        return out


ADAMW_AXES = (  # the baseline's: llm.c's recipe's values and the recipe's freedoms
    Axis("lr", 8e-3, 2.0),
    Axis("warmup_share", 0.05, 0.05, "lin", 0.0, 0.5),
    Axis("weight_decay", 0.1, 0.0, "cat", choices=(0.0, 0.1)),
    Axis("final_lr_ratio", 0.1, 0.1, "lin", 0.0, 1.0),
    Axis("beta2", 0.95, 0.0, "cat", choices=(0.95, BETA2_KEPT)),
    Axis("embed_lr_factor", 1.0, 2.0),
)
MUON_AXES = (
    Axis("muon_lr", 0.02, 2.0),
    Axis("lr", 8e-3, 2.0),
    Axis("decay_fraction", 0.4, 0.2, "lin", 0.1, 1.0),
)
HEAD_AXIS = Axis("head_lr_factor", 1.0, 2.0)  # nanochat's untied head: its own lr
ARMS = {
    "baseline": Arm("configs/study_baseline.toml", ADAMW_AXES),
    "recipe": Arm("configs/study_recipe.toml", MUON_AXES),
    "ablation": Arm(
        "configs/study_ablation.toml",
        (
            Axis("lr", 8e-3, 2.0),
            Axis("decay_fraction", 0.4, 0.2, "lin", 0.1, 1.0),
            Axis("warmup_share", WARMUP_START, 0.05, "lin", 0.0, 0.5),
            Axis("embed_lr_factor", 1.0, 2.0),  # the recipe's two lrs, as the baseline has
        ),
    ),
    "nanochat": Arm("configs/study_nanochat.toml", (*MUON_AXES, HEAD_AXIS)),
    "nanochat_adamw": Arm("configs/study_nanochat_adamw.toml", (*ADAMW_AXES, HEAD_AXIS)),
}


class Stopped(Exception):
    """A trial was stopped by a signal, or hung twice: tuning stops too, and continues next time
    (a trial ends in a result, its val loss, or diverged: inf)."""


def label(arm: Arm, point: tuple[float, ...]) -> str:
    return ",".join(f"{a.name}={v:.6g}" for a, v in zip(arm.axes, point, strict=True))


def point_dict(arm: Arm, point: tuple[float, ...]) -> dict[str, float]:
    return {a.name: v for a, v in zip(arm.axes, point, strict=True)}


def read_loss(run_dir: Path) -> float | None:
    """A finished run's final val loss (nan when it logged none); None while unfinished."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return None
    return float(json.loads(path.read_text()).get("val_loss", math.nan))


def restore(arm: Arm, run_dir: Path, overrides: list[str], kept: Path) -> None:
    """The kept trial `kept` copied to `run_dir` when it finished with the config this trial
    would train (and run_dir does not exist)."""
    o = [*overrides, f"train.seed={SEED}", f"run.dir={run_dir}"]
    expected = to_toml(load_config(str(REPO / arm.config), o))
    if study_reuse.copy_finished(kept, run_dir, expected):
        print(f"tune: {run_dir} copied from {kept}", file=sys.stderr)


def train_trial(
    arm: Arm, run_dir: Path, overrides: list[str], kept: Path | None = None, env=None
) -> float:
    """One trial as `gptrain train` in a subprocess (its output to stderr, its environment `env`,
    default this one's); a finished run is read, one kept in `kept` copied back first; a trial
    that finishes is kept there. One that hangs (the watchdog's exit code) runs once more from
    its checkpoint; hung twice or killed by a signal: Stopped. One that ends otherwise without
    summary.json (diverged: its non-finite steps stopped it) is inf."""
    if kept is not None and not run_dir.exists():
        restore(arm, run_dir, overrides, kept)
    if (loss := read_loss(run_dir)) is not None:
        if kept is not None and not (kept / "summary.json").is_file():  # finished before --kept
            study_saved.keep_run(run_dir, kept)
        return loss
    cmd = [sys.executable, "-m", "gptrain", "train", "--config", str(REPO / arm.config)]
    cmd += [f"--{o}" for o in overrides] + [f"--train.seed={SEED}", f"--run.dir={run_dir}"]
    print(f"tune: {run_dir}", file=sys.stderr)
    code = subprocess.run(cmd, stdout=sys.stderr, env=env).returncode
    if code == HUNG:  # the watchdog's "safe to restart": not a result of the trial's values
        print(f"tune: {run_dir} hung: running it once more from its checkpoint", file=sys.stderr)
        code = subprocess.run(cmd, stdout=sys.stderr, env=env).returncode
        if code == HUNG:
            raise Stopped(f"{run_dir} hung twice (see its train.log); run the same command to continue")  # fmt: skip
    if code == 2:
        raise UserError(f"gptrain train refused {run_dir}'s config (its line is above); fix it")
    if code in (130, -2):
        raise KeyboardInterrupt
    if code < 0:
        raise Stopped(f"{run_dir} was killed by signal {-code}; run the same command to continue")
    loss = read_loss(run_dir)
    if loss is None and code == 0:
        raise Stopped(f"{run_dir} was stopped by a signal; run the same command to continue")
    if loss is not None and kept is not None:
        study_saved.keep_run(run_dir, kept)
    return math.inf if loss is None else loss


def parse_args(argv: list[str]) -> dict:
    """tune.py's own flags; the rest are `--section.key=value` overrides of every trial."""
    own = {"out": None, "budget": "16", "cap": "28", "arms": ",".join(ARMS), "jobs": "1"}
    own["kept"] = ""
    rest, i = [], 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        if flag in ("-h", "--help"):
            print(__doc__.strip())
            raise SystemExit(0)
        if flag[2:] in own:
            if not eq:
                if i + 1 >= len(argv):
                    raise UserError(f"{flag} needs a value; see benchmarks/study/tune.py --help")
                value, i = argv[i + 1], i + 1
            own[flag[2:]] = value
        else:
            rest.append(argv[i])
        i += 1
    config, overrides = parse_cli(rest)
    if config or not own["out"]:
        raise UserError("benchmarks/study/tune.py needs --out DIR (the arms' configs are its own)")
    arms = own["arms"].split(",")
    if unknown := [a for a in arms if a not in ARMS]:
        raise UserError(f"--arms: unknown {', '.join(unknown)}; choose from {', '.join(ARMS)}")
    try:
        budget, cap, jobs = int(own["budget"]), int(own["cap"]), int(own["jobs"])
    except ValueError:
        raise UserError("--budget, --cap and --jobs are whole numbers, e.g. --budget 16") from None
    if jobs < 1:
        raise UserError(f"--jobs {jobs}: run at least 1 trial at a time")
    kept = Path(own["kept"]) if own["kept"] else None
    return {"out": Path(own["out"]), "budget": budget, "cap": cap, "arms": arms, "jobs": jobs} | {
        "o": overrides,
        "kept": kept,
    }


def check_plan(out: Path, plan: dict) -> None:
    """OUT/plan.json: the arms' configs and overrides; other ones would resume other trials."""
    path = out / "plan.json"
    if path.is_file() and json.loads(path.read_text()) != plan:
        raise UserError(
            f"--out {out} holds trials of other configs or overrides (see {path}); run the same command to continue, or choose another --out"
        )
    atomic_write_bytes(path, json.dumps(plan, indent=1).encode())


def results(args: dict, searches: dict[str, Search], steps: dict[str, int]) -> dict:
    """tune.json: every trial and each arm's best with where it sits on each axis."""
    arms = {}
    for name, s in searches.items():
        arm = ARMS[name]
        trials = [
            {
                "point": point_dict(arm, p),
                "overrides": arm.overrides(point_dict(arm, p), steps[name]),
                "dir": str(args["out"] / name / label(arm, p)),
                "val_loss": s.results[p] if math.isfinite(s.results[p]) else None,
            }
            for p in s.order
        ]
        best = s.best()
        arms[name] = {
            "config": arm.config,
            "max_steps": steps[name],
            "trials": trials,
            "best": trials[s.order.index(best)] if best else None,
            "position": {a.name: s.position(i) for i, a in enumerate(arm.axes)} if best else {},
        }
    return {"budget": args["budget"], "cap": args["cap"], "seed": SEED, "overrides": args["o"]} | {
        "arms": arms
    }


def table(report: dict) -> str:
    lines = ["| arm | trial | point | val loss |", "|---|---:|---|---:|"]
    for name, arm in report["arms"].items():
        for n, t in enumerate(arm["trials"], 1):
            point = ", ".join(f"{k} {v:.4g}" for k, v in t["point"].items())
            loss = "failed" if t["val_loss"] is None else f"{t['val_loss']:.4f}"
            if t is arm["best"]:
                point, loss = f"**{point}**", f"**{loss}**"
            lines.append(f"| {name} | {n} | {point} | {loss} |")
    lines += ["", "| arm | trials | best | val loss | position |", "|---|---:|---|---:|---|"]
    for name, arm in report["arms"].items():
        b = arm["best"]
        point = ", ".join(f"{k} {v:.4g}" for k, v in b["point"].items())
        where = ", ".join(f"{k} {v}" for k, v in arm["position"].items())
        loss = "failed" if b["val_loss"] is None else f"{b['val_loss']:.4f}"
        lines.append(f"| {name} | {len(arm['trials'])} | {point} | {loss} | {where} |")
    return "\n".join(lines)


def arm_steps(name: str, o: list[str]) -> int:
    """The arm's train.max_steps under the tuning's overrides `o` (its warmup is set per trial
    from the share: 0 here, so that any fits)."""
    return load_config(str(REPO / ARMS[name].config), [*o, "optim.warmup_steps=0"]).train.max_steps


def trial_dir(name: str, point: dict[str, float], out: Path) -> Path:
    """The run directory in OUT of arm `name`'s trial at `point`."""
    arm = ARMS[name]
    return out / name / label(arm, tuple(point[a.name] for a in arm.axes))


def trial_of(name: str, point: dict[str, float], o: list[str], out: Path) -> tuple[Path, list[str]]:
    """The trial of arm `name` at `point` under the tuning's overrides `o`: its run directory in
    OUT and the overrides it trains with."""
    return trial_dir(name, point, out), o + ARMS[name].overrides(point, arm_steps(name, o))


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    out = args["out"]
    steps = {a: arm_steps(a, args["o"]) for a in args["arms"]}
    plan = {a: (REPO / ARMS[a].config).read_text() for a in args["arms"]}
    out.mkdir(parents=True, exist_ok=True)
    check_plan(out, {"configs": plan, "overrides": args["o"], "seed": SEED})
    searches = {a: Search(ARMS[a].axes) for a in args["arms"]}

    def trial(name: str, point: tuple[float, ...]) -> float:
        arm = ARMS[name]
        run_dir, overrides = trial_of(name, point_dict(arm, point), args["o"], out)
        kept = args["kept"] / name / run_dir.name if args["kept"] else None
        return train_trial(arm, run_dir, overrides, kept)

    def save() -> None:
        report = results(args, searches, steps)
        atomic_write_bytes(out / "tune.json", json.dumps(report, indent=1).encode())

    try:
        tune(searches, trial, args["budget"], args["cap"], save, args["jobs"])
    except Stopped as e:
        print(f"tune: {e}", file=sys.stderr)
        return 0
    report = results(args, searches, steps) | {"complete": True}
    atomic_write_bytes(out / "tune.json", json.dumps(report, indent=1).encode())
    print(table(report))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except UserError as e:
        print(f"tune: {first_line(e)}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("tune: stopped; run the same command to continue", file=sys.stderr)
        sys.exit(130)

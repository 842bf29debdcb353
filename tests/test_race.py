"""`gptrain race`: the statistics against closed forms, mpmath and SciPy; the curves, crossings
and compute multiplier on synthetic runs; a 2-config x 2-seed race of the debug model (race.json,
the table, race.png); a stopped race continuing with the runs it lacks; one run per GPU as
subprocesses (two CPU slots here); bad input."""

import dataclasses
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import forked
import pytest
from train_helpers import DEBUG

from gptrain.__main__ import main as cli
from gptrain.commands import race as race_cmd
from gptrain.commands import race_plan
from gptrain.data import unigram
from gptrain.logs.race import analyse, curve_from_metrics, first_crossing
from gptrain.logs.race_report import markdown_table
from gptrain.logs.stats import (
    betainc,
    ratio_ci,
    student_t_cdf,
    student_t_ppf,
    welch,
)
from gptrain.training import attempts

# ---------------------------------------------------------------- statistics


@pytest.mark.parametrize("t", [-50.0, -3.0, -0.7, 0.0, 0.25, 1.96, 12.0])
def test_student_t_cdf_equals_the_closed_forms(t):
    """df = 1 is the Cauchy distribution, df = 2 has F(t) = 1/2 + t / (2 sqrt(2 + t^2))."""
    assert student_t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, rel=1e-13, abs=1e-16)
    want = 0.5 + t / (2 * math.sqrt(2 + t * t))
    assert student_t_cdf(t, 2) == pytest.approx(want, rel=1e-13, abs=1e-16)
    assert student_t_cdf(t, 1e9) == pytest.approx(0.5 * math.erfc(-t / math.sqrt(2)), rel=1e-9)


def test_student_t_quantiles_equal_the_closed_forms_and_the_tables():
    assert student_t_ppf(0.975, 1) == pytest.approx(math.tan(0.475 * math.pi), rel=1e-13)
    a = 2 * 0.995 - 1  # df = 2: t = a sqrt(2 / (1 - a^2)) with a = 2q - 1
    assert student_t_ppf(0.995, 2) == pytest.approx(a * math.sqrt(2 / (1 - a * a)), rel=1e-13)
    assert student_t_ppf(0.975, 10) == pytest.approx(2.228138851986274, rel=1e-13)  # table: 2.228
    assert student_t_ppf(0.025, 10) == pytest.approx(-2.228138851986274, rel=1e-13)


def test_welch_on_hand_checked_examples():
    """b without spread: se^2 = var(a) / n_a and df = n_a - 1 exactly, so the p-values are the
    closed forms above. [1, 2, 3] vs [5, 5, 5]: t = -3 / sqrt(1/3), df = 2, p = 1 - sqrt(27/29).
    [0, 2] vs [4, 4, 4]: t = -3, df = 1, p = 1 - 2 atan(3) / pi."""
    w = welch([1, 2, 3], [5, 5, 5])
    assert (w.diff, w.df) == (-3.0, pytest.approx(2.0, rel=1e-15))
    assert w.t == pytest.approx(-3 * math.sqrt(3), rel=1e-15)
    assert w.p == pytest.approx(1 - math.sqrt(27 / 29), rel=1e-13)
    w = welch([0, 2], [4, 4, 4])
    assert (w.t, w.df) == (pytest.approx(-3.0), pytest.approx(1.0))
    assert w.p == pytest.approx(1 - 2 * math.atan(3) / math.pi, rel=1e-13)
    lo, hi = w.ci(0.95)  # diff -3, se 1, df 1: -3 +- tan(0.475 pi)
    assert (lo, hi) == (
        pytest.approx(-3 - 12.706204736174707),
        pytest.approx(-3 + 12.706204736174707),
    )
    assert welch([2, 2], [2, 2]).p == 1.0 and welch([2, 2], [3, 3]).p == 0.0


def test_incomplete_beta_equals_mpmath_at_high_precision():
    mpmath = pytest.importorskip("mpmath")
    mpmath.mp.dps = 40
    for a, b, x in [
        (0.5, 0.5, 0.3),
        (5, 0.5, 0.99),
        (2.7, 3.1, 0.4),
        (0.5, 3, 1e-5),
        (40, 0.5, 0.2),
        (3.5, 0.5, 0.9999),
    ]:
        want = float(mpmath.betainc(a, b, 0, x, regularized=True))
        assert betainc(a, b, x) == pytest.approx(want, rel=1e-13), (a, b, x)


def samples(seed: int):
    rng = random.Random(seed)
    a = [rng.gauss(3.0, rng.uniform(0.01, 1)) for _ in range(rng.randint(2, 9))]
    b = [rng.gauss(3.2, rng.uniform(0.01, 1)) for _ in range(rng.randint(2, 9))]
    return a, b


@pytest.mark.parametrize("seed", range(8))
def test_welch_equals_scipy(seed):
    stats = pytest.importorskip("scipy.stats")
    a, b = samples(seed)
    got, want = welch(a, b), stats.ttest_ind(a, b, equal_var=False)
    assert got.t == pytest.approx(want.statistic, rel=1e-12)
    assert got.df == pytest.approx(want.df, rel=1e-12)
    assert got.p == pytest.approx(want.pvalue, rel=1e-10)
    assert got.ci(0.95) == pytest.approx(tuple(want.confidence_interval(0.95)), rel=1e-10)
    assert student_t_ppf(0.9, got.df) == pytest.approx(stats.t.ppf(0.9, got.df), rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_the_ratio_interval_is_where_welch_stops_rejecting(seed):
    """At each bound r, |mean(a) - r mean(b)| / sqrt(va + r^2 vb) equals the t quantile at that
    r's degrees of freedom; the interval excludes 1 exactly when Welch's test rejects."""
    rng = random.Random(seed)
    b = [rng.gauss(1000, 40) for _ in range(rng.randint(2, 6))]
    a = [rng.gauss(1000 * rng.uniform(0.8, 1.1), 60) for _ in range(rng.randint(2, 6))]
    r = ratio_ci(a, b)
    ma, mb = sum(a) / len(a), sum(b) / len(b)
    va = sum((x - ma) ** 2 for x in a) / (len(a) - 1) / len(a)
    vb = sum((x - mb) ** 2 for x in b) / (len(b) - 1) / len(b)
    assert r.value == pytest.approx(ma / mb) and r.lo < r.value < (r.hi or math.inf)
    for bound in (b for b in (r.lo, r.hi) if b):  # 0 and None: the interval reaches 0, or is open
        var = va + bound**2 * vb
        df = var**2 / (va**2 / (len(a) - 1) + (bound**2 * vb) ** 2 / (len(b) - 1))
        t = abs(ma - bound * mb) / math.sqrt(var)
        assert t == pytest.approx(student_t_ppf(0.975, df), rel=1e-9)
    assert (r.lo <= 1 <= (r.hi or math.inf)) == (welch(a, b).p >= 0.05)


# ---------------------------------------------------------------- curves and the multiplier


def loss_at(tokens: float) -> float:
    return 2.0 + 3.0 * 1000 / (1000 + tokens)


def synthetic_run(config: str, seed: int, offset: float, end: int, fpt: float = 1e6) -> dict:
    tokens = list(range(0, end + 1, 100))
    losses = [loss_at(t) + offset for t in tokens]
    curve = {"tokens": tokens, "seconds": [t / 1e4 for t in tokens], "val_loss": losses}
    curve["val_bpb"] = [x / math.log(2) for x in losses]
    return {
        "config": config,
        "seed": seed,
        "status": "done",
        "curve": curve,
        "val_loss": losses[-1],
        "val_bpb": curve["val_bpb"][-1],
        "tokens": end,
        "train_s": end / 1e4,
        "flops_per_token": fpt,
    }


def test_crossings_interpolate_between_evaluations_and_censor():
    assert first_crossing([0, 100, 200], [5.0, 4.0, 3.0], 3.5) == 150
    assert first_crossing([0, 100, 200], [5.0, 4.0, 3.0], 2.9) is None
    rows = [
        {"step": 0, "tokens": 0, "val_loss": 5.0},
        {"step": 2, "tokens": 200, "tok_per_s": 100.0},
    ]
    rows.append({"step": 4, "tokens": 400, "tok_per_s": 50.0, "val_loss": 4.0, "val_bpb": 5.7})
    c = curve_from_metrics(rows)
    assert c["tokens"] == [0, 400] and c["seconds"] == [0.0, 6.0] and c["val_loss"] == [5.0, 4.0]
    rows[-1]["train_s"] = 5.5  # the run's own clock, where metrics.jsonl logs it
    assert curve_from_metrics(rows)["seconds"] == [0.0, 5.5]


def test_analysis_reports_a_run_that_misses_the_target_as_censored():
    base = [synthetic_run("base", s, off, 3000) for s, off in enumerate([-0.01, 0.01])]
    cand = [synthetic_run("cand", s, off, 3000, fpt=2e6) for s, off in enumerate([-0.3, -0.31])]
    race = analyse(base + cand, ["base", "cand"], "baseline")
    assert race["target"] == pytest.approx(loss_at(3000))
    assert base[0]["to_target"] is not None and base[1]["to_target"] is None  # censored
    t = race["configs"][1]["tokens_to_target"]
    assert t["reached"] == 2 and t["vs_baseline"]["censored"] and t["vs_baseline"]["ci"] is None
    flops = race["configs"][1]["flops_to_target"]["stats"]["mean"]
    assert flops == pytest.approx(2e6 * t["stats"]["mean"])
    table = markdown_table(race)
    assert "(1/2 reached)" in table and table.count("\n| ") == 2  # after the header: 2 rows
    race = analyse(base + cand, ["base", "cand"], 4.0)  # every run reaches 4.0
    v = race["configs"][1]["tokens_to_target"]["vs_baseline"]
    assert v["ci"][0] < v["ratio"] < v["ci"][1] and v["p"] < 0.05


# ---------------------------------------------------------------- the regime


def test_the_unigram_cross_entropy_equals_a_hand_computation(monkeypatch):
    """train [0, 0, 1], vocab 3: add-one gives p = 3/6, 2/6, 1/6; val [1, 2] scores
    -(log 2/6 + log 1/6) / 2 = (log 3 + log 6) / 2 nats, counted in chunks of any size."""
    want = (math.log(3) + math.log(6)) / 2
    assert unigram.cross_entropy([[0, 0, 1]], [1, 2], 3) == pytest.approx(want, rel=1e-15)
    monkeypatch.setattr(unigram, "CHUNK", 2)
    assert unigram.cross_entropy([[0], [0, 1]], [1, 2], 3) == pytest.approx(want, rel=1e-15)


def unigram_reference(data_dir, seq_len: int, eval_tokens: int) -> float:
    """The regime by plain Python: Counter over the train tokens, the targets of n =
    eval_tokens // seq_len val windows evenly spaced over the split's (len - 1) // seq_len
    window slots (slot i * slots // n), the add-one-smoothed log-probabilities summed with fsum."""
    from collections import Counter

    from gptrain.data.loader import Dataset

    data = Dataset(data_dir)
    train = Counter()
    for shard in data.shards["train"]:
        train.update(int(t) for t in shard[:])
    val = [int(t) for shard in data.shards["val"] for t in shard[:]]
    slots = (len(val) - 1) // seq_len
    n = min(eval_tokens // seq_len, slots)
    starts = [(i * slots // n) * seq_len for i in range(n)]
    targets = [t for a in starts for t in val[a + 1 : a + seq_len + 1]]
    n, v = sum(train.values()), data.vocab_size
    return -math.fsum(math.log((train[t] + 1) / (n + v)) for t in targets) / len(targets)


def test_the_regime_of_a_prepared_folder_equals_plain_counting_and_is_cached(
    byte_data, tmp_path, monkeypatch
):
    from gptrain.config.load import load_config

    got = unigram.unigram_entropy(byte_data, seq_len=64, eval_tokens=1024)
    assert got["nats"] == pytest.approx(unigram_reference(byte_data, 64, 1024), rel=1e-12)
    assert got["val_tokens"] == 1024 and got["vocab_size"] == 257  # 256 bytes and EOT
    cfg = load_config(DEBUG, [f"data.dir={byte_data}", "eval.tokens=1024"])
    assert race_cmd.regime(tmp_path, cfg) == got  # computed, then cached in the race's folder

    def never(*a):
        raise AssertionError("computed again")

    monkeypatch.setattr(unigram, "unigram_entropy", never)
    assert race_cmd.regime(tmp_path, cfg) == got
    other = load_config(DEBUG, [f"data.dir={byte_data}", "eval.tokens=2048"])
    with pytest.raises(AssertionError, match="computed again"):  # other val tokens: not cached
        race_cmd.regime(tmp_path, other)


# ---------------------------------------------------------------- races of the debug model

FAST = [
    "--log.progress=false",
    "--log.plot=false",
    "--train.max_steps=8",
    "--eval.every=4",
    "--eval.tokens=1024",
    "--eval.sample_every=0",
    "--eval.sample_tokens=1",
    "--checkpoint.every=4",
    "--log.every=2",
    "--optim.warmup_steps=2",
]


def race_args(configs, out, byte_data, *more):
    return [
        "race",
        "--config",
        configs[0],
        "--config",
        configs[1],
        "--seeds",
        "2",
        "--out",
        str(out),
        f"--data.dir={byte_data}",
        *FAST,
        *more,
    ]


def test_a_race_of_two_configs_writes_race_json_the_table_and_race_png(
    configs, byte_data, tmp_path, capsys
):
    out = tmp_path / "race"
    assert cli(race_args(configs, out, byte_data, "--target", "4.7")) == 0
    table = capsys.readouterr().out
    assert table.startswith("| config | runs | val loss |") and "| fast | 2 |" in table
    race = json.loads((out / "race.json").read_text())
    assert race["target"] == 4.7 and race["baseline"] == "debug" and race["seeds"] == 2
    assert [(r["config"], r["seed"], r["status"]) for r in race["runs"]] == [
        ("debug", 1, "done"),  # in the order they ran: seed by seed, every config in turn
        ("fast", 1, "done"),
        ("debug", 2, "done"),
        ("fast", 2, "done"),
    ]
    first, second = race["runs"][0], race["runs"][2]
    assert first["val_loss"] != second["val_loss"]  # the seed changes the run
    assert first["tokens"] == 8 * 1024 and first["curve"]["tokens"] == [0, 4096, 8192]
    assert first["flops_per_token"] > 0 and first["train_s"] > 0
    fast = race["configs"][1]
    assert fast["val_loss_vs_baseline"]["p"] is not None and "compute_multiplier" in fast
    assert (out / "race.png").read_bytes()[:4] == b"\x89PNG"
    for run in race["runs"]:  # ordinary run directories
        assert (out / run["config"] / f"seed_{run['seed']}" / "summary.json").is_file()
    # the regime: the val tokens' unigram entropy (8 steps of bytes end far above it: early)
    want = unigram_reference(byte_data, seq_len=64, eval_tokens=1024)
    assert race["unigram"]["nats"] == pytest.approx(want, rel=1e-12)
    base = race["configs"][0]
    assert base["below_unigram"] == pytest.approx(want - base["val_loss"]["mean"], rel=1e-12)
    assert base["early_regime"] is (base["below_unigram"] < 1) and "early_regime" not in fast
    row = next(line for line in table.splitlines() if line.startswith("| debug |"))
    assert row.endswith("**early regime** |") == base["early_regime"]
    assert f"Below unigram: nats of val loss below {want:.4f}" in table
    # the folder now holds this race: other overrides there are refused, nothing run
    assert cli(race_args(configs, out, byte_data, "--optim.lr=1e-3")) == 2
    assert "holds a race run with other overrides" in capsys.readouterr().err


def test_a_stopped_race_continues_with_the_runs_it_lacks(configs, byte_data, tmp_path, monkeypatch):
    """Ctrl-C at step 6 of the third run (its checkpoint at step 4 saved): the same command
    then leaves the finished runs 1-2 unstarted, resumes run 3 at step 4 and trains run 4."""
    from gptrain.training.meter import Meter

    out, started, report = tmp_path / "race", [], Meter.report

    def train_counting(argv):
        started.append(argv)
        return in_process(argv)

    def report_or_stop(self, step, m):
        if len(started) == 3 and step == 6:
            raise KeyboardInterrupt
        report(self, step, m)

    in_process = race_cmd._train_in_process
    monkeypatch.setattr(race_cmd, "_train_in_process", train_counting)
    monkeypatch.setattr(Meter, "report", report_or_stop)
    assert cli(race_args(configs, out, byte_data)) == 130
    assert len(started) == 3 and not (out / "race.json").exists()
    monkeypatch.undo()
    assert cli(race_args(configs, out, byte_data)) == 0
    starts = {
        d: [a["start"]["start_step"] for a in attempts.read(out / d)]
        for d in ("debug/seed_1", "debug/seed_2", "fast/seed_1", "fast/seed_2")
    }
    assert starts == {  # the order: debug 1, fast 1, debug 2 (stopped at step 6), fast 2
        "debug/seed_1": [0],
        "fast/seed_1": [0],
        "debug/seed_2": [0, 4],
        "fast/seed_2": [0],
    }
    race = json.loads((out / "race.json").read_text())
    assert all(r["status"] == "done" and r["curve"]["tokens"][-1] == 8192 for r in race["runs"])
    base = [r["val_loss"] for r in race["runs"] if r["config"] == "debug"]
    assert race["target"] == pytest.approx(sum(base) / 2)


def listing(folder) -> dict:
    """Every file under `folder` with its size and modification time: what was written."""
    return {
        str(f): (f.stat().st_size, f.stat().st_mtime_ns) for f in folder.rglob("*") if f.is_file()
    }


def test_a_race_trains_from_its_plan_and_refuses_a_config_file_edited_since(
    configs, byte_data, tmp_path, monkeypatch, capsys
):
    """The baseline's file is edited after the race's first run: its later run still trains
    the plan's config; the same command then is refused (one line naming the file, nothing
    written), and continues once the file is restored."""
    mine = [str(tmp_path / "debug.toml"), str(tmp_path / "fast.toml")]
    for src, dst in zip(configs, mine, strict=True):
        (tmp_path / dst).write_text(open(src).read())
    original = open(mine[0]).read()
    in_process, out = race_cmd._train_in_process, tmp_path / "race"

    def train_then_edit(argv):
        code = in_process(argv)
        (tmp_path / "debug.toml").write_text(original.replace("lr = 3e-3", "lr = 5e-2"))
        return code

    monkeypatch.setattr(race_cmd, "_train_in_process", train_then_edit)
    assert cli(race_args(mine, out, byte_data)) == 0
    monkeypatch.undo()
    for seed in (1, 2):  # both seeds trained the plan's lr, not the edited file's
        assert "\nlr = 0.003\n" in (out / "debug" / f"seed_{seed}" / "config.toml").read_text()
    capsys.readouterr()
    before = listing(out)
    assert cli(race_args(mine, out, byte_data)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--config {mine[0]} changed since the race" in err[0]
    assert "restore the file" in err[0] and listing(out) == before
    (tmp_path / "debug.toml").write_text(original)
    assert cli(race_args(mine, out, byte_data)) == 0  # restored: the race is whole
    assert json.loads((out / "race.json").read_text())["runs"][2]["status"] == "done"


def test_a_plan_saved_before_a_key_existed_continues_and_an_unknown_key_is_an_edit(
    configs, byte_data, tmp_path, capsys
):
    """A race's plan written by a gptrain without one of today's keys (that line left out of
    each saved config) continues: the key at its default changes nothing. A saved key this
    gptrain does not know (one renamed since) is refused like an edit."""
    out = tmp_path / "race"
    assert cli(race_args(configs, out, byte_data)) == 0
    plan = json.loads((out / "plan.json").read_text())
    line = "static_graph = false\n"
    older = {label: text.replace(line, "") for label, text in plan["configs"].items()}
    assert all(older[label] != text for label, text in plan["configs"].items())
    (out / "plan.json").write_text(json.dumps(plan | {"configs": older}))
    assert cli(race_args(configs, out, byte_data)) == 0
    assert json.loads((out / "plan.json").read_text())["configs"] == plan["configs"]
    renamed = {label: text.replace(line, "static_graf = false\n") for label, text in plan["configs"].items()}  # fmt: skip
    (out / "plan.json").write_text(json.dumps(plan | {"configs": renamed}))
    capsys.readouterr()
    assert cli(race_args(configs, out, byte_data)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--config {configs[0]} changed since the race" in err[0]


@pytest.fixture
def sigterm_kept():
    """The test process's SIGTERM handler as it was (a run stopped in-process leaves it ignored)."""
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_a_run_ending_without_its_summary_is_run_once_more_and_a_signalled_one_stops_the_race(
    configs, byte_data, tmp_path, monkeypatch, capsys, sigterm_kept
):
    """seed 1 ends without summary.json and without a signal (as when killed after its last
    checkpoint): it runs once more, which finishes it (here: its summary put back, as gptrain
    train's own finish writes it). seed 2 gets SIGTERM at step 6: it saves, and the race stops
    without running it again. A run that twice ends so stops the race after the second time."""
    from gptrain.training.meter import Meter

    out, calls, report, in_process = tmp_path / "race", [], Meter.report, race_cmd._train_in_process
    argv = ["race", "--config", configs[0], "--seeds", "2", "--out", str(out)]
    argv += [f"--data.dir={byte_data}", *FAST]

    def train(argv_run):
        run_dir = argv_run[-1].split("=", 1)[1]
        calls.append(run_dir.rsplit("/", 1)[1])
        summary = out / "debug" / "seed_1" / "summary.json"
        if calls == ["seed_1", "seed_1"]:  # the second start finishes what the first did not
            (out / "summary.kept").rename(summary)
            return 0
        code = in_process(argv_run)
        if calls == ["seed_1"]:
            summary.rename(out / "summary.kept")
        return code

    def report_or_signal(self, step, m):
        if calls[-1] == "seed_2" and step == 6:
            os.kill(os.getpid(), signal.SIGTERM)
        report(self, step, m)

    monkeypatch.setattr(race_cmd, "_train_in_process", train)
    monkeypatch.setattr(Meter, "report", report_or_signal)
    assert cli(argv) == 0
    err = capsys.readouterr().err
    assert calls == ["seed_1", "seed_1", "seed_2"] and not (out / "race.json").exists()
    assert "seed_1 ended without summary.json (not by a signal): running it once more" in err
    assert "seed_2 was stopped by a signal" in err
    assert attempts.outcome(attempts.read(out / "debug" / "seed_2")[-1]) == "preempted"

    calls.clear()  # a run that never writes its summary: run twice, then the race stops
    monkeypatch.setattr(race_cmd, "_train_in_process", lambda a: calls.append(a) or 0)
    argv[argv.index("--out") + 1] = str(tmp_path / "another")
    assert cli(argv) == race_cmd.RUN_FAILED == 3 and len(calls) == 2
    err = capsys.readouterr().err
    assert (
        "gptrain race: a run failed: " in err and "ended twice without writing summary.json" in err
    )


def test_a_signal_at_a_runs_end_stops_the_race_after_that_run(
    configs, byte_data, tmp_path, monkeypatch, capsys, sigterm_kept
):
    """SIGTERM in seed 1's final evaluation: the run finishes (its last step), and the race
    stops there instead of starting seed 2; the same command then continues with seed 2."""
    from gptrain.training.meter import Meter

    out, calls, report, in_process = tmp_path / "race", [], Meter.report, race_cmd._train_in_process
    argv = ["race", "--config", configs[0], "--seeds", "2", "--out", str(out)]
    argv += [f"--data.dir={byte_data}", *FAST]

    def train(argv_run):
        calls.append(argv_run[-1].rsplit("/", 1)[1])
        return in_process(argv_run)

    def report_or_signal(self, step, m):
        if calls == ["seed_1"] and step == self.max_steps:
            os.kill(os.getpid(), signal.SIGTERM)
        report(self, step, m)

    monkeypatch.setattr(race_cmd, "_train_in_process", train)
    monkeypatch.setattr(Meter, "report", report_or_signal)
    assert cli(argv) == 0
    err = capsys.readouterr().err
    assert calls == ["seed_1"] and (out / "debug" / "seed_1" / "summary.json").is_file()
    assert "a signal (SIGTERM) reached it at its end" in err and not (out / "race.json").exists()
    monkeypatch.setattr(Meter, "report", report)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert cli(argv) == 0 and calls[-1] == "seed_2" and (out / "race.json").is_file()


def test_a_signal_to_a_race_on_several_gpus_stops_its_runs_in_progress(
    configs, byte_data, tmp_path, monkeypatch, capsys, sigterm_kept
):
    """Two slots on this CPU; once both runs have a checkpoint the race gets SIGTERM: it passes
    it on, both runs save and exit (preempted, no summary), and the race stops (exit 0)."""
    out, procs, signalled = tmp_path / "race", [], []
    got = []  # without the race's own handler, the signal lands here (the test goes on)
    signal.signal(signal.SIGTERM, lambda *_: got.append(1))

    def popen(*a, **k):
        procs.append(forked.Popen(*a, **k))
        return procs[-1]

    def sleep(s):
        runs = [out / "debug" / f"seed_{k}" / "checkpoints" / "latest" for k in (1, 2)]
        if not signalled and all(r.exists() for r in runs):
            signalled.append(os.kill(os.getpid(), signal.SIGTERM))
        time.sleep(s)

    monkeypatch.setattr(race_cmd, "gpu_slots", lambda cfgs: ["", ""])
    fake = SimpleNamespace(
        Popen=popen, STDOUT=subprocess.STDOUT, TimeoutExpired=subprocess.TimeoutExpired
    )
    monkeypatch.setattr(race_cmd, "subprocess", fake)
    monkeypatch.setattr(race_cmd, "time", SimpleNamespace(sleep=sleep, monotonic=time.monotonic))
    argv = ["race", "--config", configs[0], "--seeds", "2", "--out", str(out)]
    argv += [f"--data.dir={byte_data}", *FAST, "--train.max_steps=100"]
    assert cli(argv) == 0
    assert signalled and "stopped by SIGTERM" in capsys.readouterr().err
    assert len(procs) == 2 and all(p.poll() == 0 for p in procs)
    for k in (1, 2):
        run = attempts.read(out / "debug" / f"seed_{k}")[-1]
        assert attempts.outcome(run) == "preempted" and run["end"]["step"] < 100


def test_a_run_that_ignores_the_passed_on_signal_is_killed_after_the_wait(
    tmp_path, monkeypatch, capsys
):
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    job = race_plan.Job("debug", 1, tmp_path / "seed_1", ())
    monkeypatch.setattr(race_cmd, "STOP_WAIT_S", 0.5)
    t0 = time.monotonic()
    race_cmd._stop([(job, proc, open(tmp_path / "log", "w"))], signal.SIGTERM)
    assert proc.returncode == -signal.SIGKILL and time.monotonic() - t0 < 30
    assert "did not stop within 0.5 s of SIGTERM: killed" in capsys.readouterr().err


def test_a_second_race_into_the_same_folder_is_refused_while_the_first_runs(
    configs, byte_data, tmp_path, monkeypatch
):
    """The same command started again while the race trains its first run: one line, exit 2,
    and each run's metrics.jsonl holds every step once."""
    out, seen = tmp_path / "race", []
    argv = race_args(configs, out, byte_data)
    in_process = race_cmd._train_in_process

    def train_with_a_rival(argv_run):
        if not seen:
            cmd = [sys.executable, "-m", "gptrain", *argv]
            seen.append(forked.run(cmd, capture_output=True, text=True, timeout=120))
        return in_process(argv_run)

    monkeypatch.setattr(race_cmd, "_train_in_process", train_with_a_rival)
    assert cli(argv) == 0
    rival = seen[0]
    assert rival.returncode == 2, rival.stderr
    assert len(rival.stderr.strip().splitlines()) == 1
    assert f"run folder {out} is in use by gptrain race" in rival.stderr
    for run in json.loads((out / "race.json").read_text())["runs"]:
        steps = [json.loads(line)["step"] for line in open(f"{run['dir']}/metrics.jsonl")]
        assert len(steps) == len(set(steps)) and run["status"] == "done"


def test_a_race_whose_folder_another_race_took_over_writes_no_result(
    configs, byte_data, tmp_path, monkeypatch, capsys
):
    """Another host's race takes OUT's lock over while the last run trains (as after this
    race's heartbeat was late): this race ends with one line, exit 2, and writes no race.json
    or race.png; the other race's lock stays."""
    out, started = tmp_path / "race", []
    in_process = race_cmd._train_in_process

    def train_then_lose_the_folder(argv_run):
        started.append(argv_run)
        if len(started) == 4:
            theirs = {"host": "node-elsewhere", "pid": 1, "what": "gptrain race", "token": "x"}
            theirs |= {"started": time.time(), "heartbeat": time.time(), "boot": "", "job": ""}
            (out / ".lock").write_text(json.dumps(theirs))
        return in_process(argv_run)

    monkeypatch.setattr(race_cmd, "_train_in_process", train_then_lose_the_folder)
    assert cli(race_args(configs, out, byte_data)) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("gptrain: error:")]
    assert len(lines) == 1 and "gptrain race (host node-elsewhere, pid 1) took over" in lines[0]
    assert "Traceback" not in err and len(started) == 4
    assert not (out / "race.json").exists() and not (out / "race.png").exists()
    assert json.loads((out / ".lock").read_text())["host"] == "node-elsewhere"


def test_with_several_gpus_the_runs_go_one_per_gpu_as_subprocesses(
    configs, byte_data, tmp_path, monkeypatch
):
    """Two slots (CUDA_VISIBLE_DEVICES="" each: on this CPU): both seeds train at once as
    `python -m gptrain train` processes, each with its own log."""
    monkeypatch.setattr(race_cmd, "gpu_slots", lambda cfgs: ["", ""])
    monkeypatch.setattr(
        race_cmd, "subprocess", SimpleNamespace(Popen=forked.Popen, STDOUT=subprocess.STDOUT)
    )
    out = tmp_path / "race"
    argv = [
        "race",
        "--config",
        configs[0],
        "--seeds",
        "2",
        "--out",
        str(out),
        f"--data.dir={byte_data}",
        *FAST,
    ]
    assert cli(argv) == 0
    race = json.loads((out / "race.json").read_text())
    assert [r["status"] for r in race["runs"]] == ["done", "done"]
    assert "step 8/8" in (out / "logs" / "debug_seed_2.log").read_text()


def test_with_jobs_on_a_cpu_the_runs_train_side_by_side_and_equal_one_at_a_time(
    configs, byte_data, tmp_path, monkeypatch, capsys
):
    """--jobs 2: both seeds start at once as subprocesses, each with OMP_NUM_THREADS = half the
    cores; their final losses equal the same race trained in process one run at a time. A race
    of one run fills one of the two slots."""
    monkeypatch.setattr(
        race_cmd, "subprocess", SimpleNamespace(Popen=forked.Popen, STDOUT=subprocess.STDOUT)
    )
    threads = max(1, (os.cpu_count() or 1) // 2)

    def race(out, *more, seeds="2"):
        argv = ["race", "--config", configs[0], "--seeds", seeds, "--out", str(out)]
        assert cli([*argv, f"--data.dir={byte_data}", *FAST, *more]) == 0
        return json.loads((out / "race.json").read_text())

    one = race(tmp_path / "one", "--jobs", "2", seeds="1")  # fewer runs than slots
    assert [r["status"] for r in one["runs"]] == ["done"]
    capsys.readouterr()
    side = race(tmp_path / "side", "--jobs", "2")
    err = capsys.readouterr().err
    assert err.count(f"race: CPU, {threads} thread(s): debug seed") == 2
    assert "step 8/8" in (tmp_path / "side" / "logs" / "debug_seed_2.log").read_text()
    again = race(tmp_path / "side", "--jobs", "2")  # finished runs are not started again
    err = capsys.readouterr().err
    assert "race: CPU" not in err and "race: 2 run(s) already finished" in err
    assert [r["val_loss"] for r in again["runs"]] == [r["val_loss"] for r in side["runs"]]
    alone = race(tmp_path / "alone")
    assert [r["status"] for r in side["runs"]] == ["done", "done"]
    for a, b in zip(side["runs"], alone["runs"], strict=True):
        assert a["seed"] == b["seed"] and a["val_loss"] == pytest.approx(b["val_loss"], rel=1e-5)
    assert side["runs"][0]["val_loss"] != side["runs"][1]["val_loss"]


def test_jobs_are_refused_for_runs_on_a_gpu_and_for_runs_of_several_processes(configs, monkeypatch):
    """--jobs shares a CPU's cores: a run on a GPU (one GPU here: no GPU slots) or of 2 processes
    is refused in one line naming the fix; --jobs 1 changes nothing."""
    import torch

    from gptrain.config.load import load_config

    cpu = [load_config(configs[0], ["train.device=cpu"])]
    assert race_cmd.slots(cpu, 1) == [None]
    assert race_cmd.slots(cpu, 2) == [f"cpu:{max(1, (os.cpu_count() or 1) // 2)}"] * 2
    two = [load_config(configs[0], ["train.device=cpu", "dist.nproc_per_node=2"])]
    with pytest.raises(race_plan.UserError, match="runs 2 process"):
        race_cmd.slots(two, 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    auto = [load_config(configs[0], ["train.device=auto"])]
    with pytest.raises(race_plan.UserError, match="race on the CPU with --train.device=cpu"):
        race_cmd.slots(auto, 2)
    assert race_cmd.slots(cpu, 2)[0].startswith("cpu:")  # on the CPU on purpose: allowed


@pytest.mark.parametrize(
    "case, says",
    [
        ("target", "--target 'low' is neither a val loss nor 'baseline'"),
        ("seeds", "use --seeds 2 or more"),
        ("data", "their losses cannot be compared"),
        ("out is a file", "is a file, not a folder; choose another --out"),
        ("out below a file", "is a file, not a folder; choose another --out"),
        ("out empty", "--out is empty; name the race's folder"),
        ("jobs 0", "--jobs '0': give the number of CPU runs to train at a time"),
        ("jobs not a number", "--jobs 'two': give the number of CPU runs to train at a time"),
        ("jobs a superscript digit", "--jobs '²': give the number of CPU runs to train at a time"),
        ("config empty", "--config is empty; name a config file to race"),
        ("config named as a rung", "its name in the race, debug@2, is also a rung of the ladder"),
        ("plan not JSON", "is not a race's plan (not JSON: "),
        ("plan not an object", "is not a race's plan (not an object whose configs map"),
        ("plan of no configs", "is not a race's plan (not an object whose configs map"),
        ("plan a folder", "is not a race's plan (not JSON: "),
    ],
)
def test_bad_input_is_one_line_and_nothing_is_written(
    configs, byte_data, tmp_path, capsys, monkeypatch, case, says
):
    out = tmp_path / "race"
    cwd = tmp_path / "cwd"  # an empty --out must not race into the current folder
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    more = {"target": ["--target", "low"], "seeds": ["--seeds", "1"]}.get(case, [])
    more = {"jobs 0": ["--jobs", "0"], "jobs not a number": ["--jobs", "two"]}.get(case, more)
    more = {"jobs a superscript digit": ["--jobs", "²"]}.get(case, more)
    argv = race_args(configs, out, byte_data, *more)
    if case == "config empty":
        argv[argv.index(configs[1]) - 1 : argv.index(configs[1]) + 1] = ["--config="]
    elif case == "config named as a rung":  # debug@1, debug@2 and the file debug@2.toml
        named = tmp_path / "debug@2.toml"
        named.write_text(open(configs[1]).read())
        argv[argv.index(configs[1])] = str(named)
        argv += ["--ladder", "1,2"]
    if case == "data":  # the baseline on the built-in corpus, the other config on a folder
        other = tmp_path / "other.toml"
        other.write_text(
            open(configs[1]).read().replace('dir = "shakespeare"', f'dir = "{byte_data}"')
        )
        argv = ["race", "--config", configs[0], "--config", str(other), "--out", str(out), *FAST]
    elif case.startswith("out is"):
        out.write_text("a file")
    elif case.startswith("out below"):
        out.write_text("a file")
        argv[argv.index("--out") + 1] = str(out / "race")
    elif case == "out empty":
        argv[argv.index("--out") : argv.index("--out") + 2] = ["--out="]
    elif case.startswith("plan"):
        out.mkdir()
        text = {"plan not JSON": "{not json", "plan not an object": "[1, 2]"}
        if case == "plan a folder":
            (out / "plan.json").mkdir()
        else:
            (out / "plan.json").write_text(text.get(case, '{"configs": {"debug": 1}}'))
    before = listing(tmp_path)
    assert cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
    assert listing(tmp_path) == before and not any(cwd.iterdir())


def test_a_first_run_refused_for_bad_input_leaves_no_plan_to_refuse_the_corrected_command(
    configs, byte_data, tmp_path, capsys
):
    """A data folder that does not exist is found by the first run's gptrain train: the race
    stops with its line, and the corrected command is not refused by the plan of the bad one."""
    out = tmp_path / "race"

    def argv(data):  # one config, one seed
        return ["race", "--config", configs[0], "--seeds", "1", "--out", str(out), data, *FAST]

    assert cli(argv(f"--data.dir={tmp_path / 'missing'}")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "missing" in err[-1] and not out.exists()  # nothing of the race is left
    assert cli(argv(f"--data.dir={byte_data}")) == 0


def test_the_resolved_config_loads_back_equal_even_with_a_newline_in_a_string(tmp_path):
    """configs/default.toml's sample prompt holds a newline: the resolved TOML (run.dir's
    config.toml, the race's plan) keeps it escaped."""
    from gptrain.config.load import load_config, to_toml

    cfg = load_config("configs/default.toml")
    assert cfg.eval.sample_prompt == "ROMEO:\n"
    prompt = cfg.eval.sample_prompt + 'a "b"\\ c\x7f\t'  # quotes, a backslash, DEL, a tab
    cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, sample_prompt=prompt))
    (tmp_path / "c.toml").write_text(to_toml(cfg))
    assert load_config(str(tmp_path / "c.toml")) == cfg


def test_a_failed_run_is_never_exit_0_and_no_finished_baseline_is_not_bad_input(
    configs, byte_data, tmp_path, monkeypatch, capsys
):
    """A run that crashes is recorded and the race writes what finished, then exits
    RUN_FAILED; every baseline run failing is RUN_FAILED too, not bad input's 2."""
    in_process = race_cmd._train_in_process

    def crash_fast_seed_2(argv_run):
        if argv_run[-1].endswith("fast/seed_2"):
            raise RuntimeError("a crash")
        return in_process(argv_run)

    monkeypatch.setattr(race_cmd, "_train_in_process", crash_fast_seed_2)
    out = tmp_path / "race"
    assert cli(race_args(configs, out, byte_data)) == race_cmd.RUN_FAILED
    err = capsys.readouterr().err
    assert "a run failed: 1 of 4" in err and "fast/seed_2 (failed (exit 1))" in err
    race = json.loads((out / "race.json").read_text())
    assert [r["status"] for r in race["runs"]].count("done") == 3
    monkeypatch.setattr(race_cmd, "_train_in_process", lambda a: 1)
    assert cli(race_args(configs, tmp_path / "none", byte_data)) == race_cmd.RUN_FAILED
    assert "a run failed: no run of the baseline debug finished" in capsys.readouterr().err


def test_with_jobs_a_runs_bad_input_stops_the_race_as_one_at_a_time(
    configs, byte_data, tmp_path, monkeypatch, capsys
):
    """A data folder that does not exist is found by each run's gptrain train: with --jobs 2 as
    one at a time, the race stops with exit 2 and the run's own line, writing no result."""
    monkeypatch.setattr(
        race_cmd, "subprocess", SimpleNamespace(Popen=forked.Popen, STDOUT=subprocess.STDOUT)
    )
    for jobs in ("1", "2"):
        out = tmp_path / f"jobs{jobs}"
        argv = race_args(configs, out, tmp_path / "missing", "--jobs", jobs)
        assert cli(argv) == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line.startswith("gptrain: error: ") and "missing" in line, line
        assert "no run of the baseline" not in line and not (out / "race.json").exists()


# A stand-in for one run's `gptrain train`: it hangs (the watchdog's exit code) while its
# folder holds fewer than `hangs` marks, then finishes (summary.json, exit 0).
HANGS_THEN_FINISHES = """
import json, sys
from pathlib import Path
run_dir, hangs = Path(sys.argv[1]), int(sys.argv[2])
run_dir.mkdir(parents=True, exist_ok=True)
marks = len(list(run_dir.glob("hung_*")))
if marks < hangs:
    (run_dir / f"hung_{marks}").write_text("")
    sys.exit(3)
(run_dir / "summary.json").write_text(json.dumps({"val_loss": 1.0}))
"""


@pytest.mark.parametrize("hangs", [1, 2])
def test_a_run_that_hangs_runs_once_more_and_one_that_hangs_twice_stops_the_race(
    tmp_path, monkeypatch, capsys, hangs
):
    from gptrain.distributed import watchdog

    assert watchdog.EXIT_CODE == 3  # the stand-in's exit code is the watchdog's
    job = race_plan.Job("debug", 1, tmp_path / "seed_1", ())

    def start(job, slot, logs):
        cmd = [sys.executable, "-c", HANGS_THEN_FINISHES, str(job.run_dir), str(hangs)]
        return job, subprocess.Popen(cmd), open(logs / "run.log", "a")

    monkeypatch.setattr(race_cmd, "_start", start)
    if hangs == 1:
        assert race_cmd._run_parallel([job], ["cpu:1"], tmp_path / "logs") == {job: 0}
        assert "seed_1 hung: running it once more from its checkpoint" in capsys.readouterr().err
    else:
        with pytest.raises(race_cmd.RunFailed, match="hung twice"):
            race_cmd._run_parallel([job], ["cpu:1"], tmp_path / "logs")
    assert len(list(job.run_dir.glob("hung_*"))) == hangs

"""train.time_budget: the lr schedule, warmup included, follows training time (against the schedule
computed by hand), and steps when max_steps comes first; the run stops inside the budget with its
final evaluation and checkpoint; a budget run killed and resumed ends where the uninterrupted one
does (bit for bit, with a clock that makes every step take 1 s), compiled or not; under DDP the
ranks read one agreed clock; a budget under 1 s, or another budget than the checkpoint's on
resume, is one line, exit 2, nothing written."""

import json
import math
import shutil
from itertools import pairwise

import dist_helpers as h
import pytest
import torch
from train_helpers import DEBUG, run, weights

import gptrain.training.state as state_module
from gptrain.__main__ import main as cli
from gptrain.checkpoint import manager as checkpoint
from gptrain.config.sections import OptimConfig
from gptrain.distributed import faults
from gptrain.training.optim import lr_at

# a budget of 6 s with steps of 1 s: 6 steps, well before max_steps
COMMON = ["train.max_steps=100", "train.time_budget=6s", "optim.warmup_steps=2", "log.every=1"]
COMMON += ["eval.every=0", "eval.sample_every=0", "eval.tokens=1024", "checkpoint.every=2"]


class StepClock:
    """Each read moves 1 s: a step reads it at its beginning and its end, so it takes 1 s."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        self.t += 1.0
        return self.t


@pytest.fixture
def step_clock(monkeypatch):
    monkeypatch.setattr(state_module, "clock", StepClock())


def lrs(run_dir) -> dict[int, float]:
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["lr"] for r in rows if "lr" in r}


def by_hand(x: float, lr: float, min_lr: float, warmup: int, max_steps: int) -> float:
    """Warmup then cosine, read at point x of max_steps steps (x fractional under a budget)."""
    if x < warmup:
        return lr * min(1.0, (x + 1) / warmup)
    if x >= max_steps - 1:
        return min_lr
    return min_lr + (lr - min_lr) * (1 + math.cos(math.pi * (x - warmup) / (max_steps - 1 - warmup))) / 2  # fmt: skip


def test_the_schedule_follows_time_and_the_run_stops_inside_the_budget(
    byte_data, tmp_path, step_clock
):  # noqa: E501
    summary = run(byte_data, tmp_path / "r", *COMMON)
    assert summary["steps"] == 6 and summary["train_s"] == pytest.approx(6.0)
    assert "val_loss" in summary  # the final evaluation ran
    assert checkpoint.find(tmp_path / "r").name == "step_00000006"
    # step k (from 1) is trained at the point of the 100-step schedule that k - 1 of 6 s reach
    for k, lr in lrs(tmp_path / "r").items():
        assert lr == pytest.approx(by_hand((k - 1) / 6 * 100, 3e-3, 3e-4, 2, 100), rel=1e-12), k
    assert lrs(tmp_path / "r")[6] < 0.2 * 3e-3  # deep into the decay by the budget's end


def test_the_warmup_takes_its_share_of_the_budget(byte_data, tmp_path, step_clock):
    """warmup_steps = 10 of max_steps = 100 under a 20 s budget (steps of 1 s, 20 of them): the
    warmup takes 10% of the budget, so the peak comes at 2 s (step 3), though only 20 steps
    run; then the cosine is read at the share of the budget spent, ending at min_lr with it."""
    budget = ["train.max_steps=100", "train.time_budget=20s", "optim.warmup_steps=10"]
    run(byte_data, tmp_path / "r", *COMMON[3:], *budget, "checkpoint.every=0")
    got = lrs(tmp_path / "r")
    assert list(got) == list(range(1, 21))
    assert got[1] == pytest.approx(3e-4) and got[2] == pytest.approx(0.6 * 3e-3)  # x = 0, 5
    assert got[3] == pytest.approx(3e-3) and max(got.values()) == got[3]  # x = 10: the peak
    for k, lr in got.items():  # x = (k - 1) / 20 x 100
        assert lr == pytest.approx(by_hand((k - 1) * 5, 3e-3, 3e-4, 10, 100), rel=1e-12), k
    assert by_hand(20 / 20 * 100, 3e-3, 3e-4, 10, 100) == 3e-4  # the budget's end: min_lr


@pytest.mark.parametrize("schedule", ["cosine", "wsd"])
def test_the_schedule_read_between_steps_is_continuous_and_never_above_the_peak(schedule):
    """A budget reads the schedule at fractional steps: on a grid of 1/100 step, no change is
    larger than 1/100 of the largest change between whole steps (no jump at the end of the
    warmup or the start of the decay), and the lr never exceeds the peak."""
    o = OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=4, lr_schedule=schedule, decay_fraction=0.5)
    whole = [lr_at(k, o, 20) for k in range(21)]
    fine = [lr_at(k / 100, o, 20) for k in range(2001)]
    step = max(abs(a - b) for a, b in pairwise(whole))
    assert max(abs(a - b) for a, b in pairwise(fine)) <= step / 100 * (1 + 1e-9)
    assert max(fine) == pytest.approx(3e-3, rel=1e-15) and fine[::100] == whole


def test_max_steps_before_the_budget_ends_the_schedule_with_the_steps(
    byte_data, tmp_path, step_clock
):
    """max_steps = 6 under a budget of 6 s (steps of 1 s) or 30 s: both follow the schedule of
    the run without a budget, ending at min_lr at step 6; the 30 s run says that max_steps came
    first, the 6 s one (whose budget ends with it) does not."""
    steps = ["train.max_steps=6", *COMMON[2:]]
    run(byte_data, tmp_path / "steps", *steps)
    want = lrs(tmp_path / "steps")
    assert want[6] == pytest.approx(3e-4)
    for budget, warned in (("6s", False), ("0.5m", True)):
        summary = run(byte_data, tmp_path / budget, *steps, f"train.time_budget={budget}")
        assert summary["steps"] == 6 and lrs(tmp_path / budget) == want, budget
        line = "warning: train.max_steps = 6 came first, after 6.0 s of train.time_budget = '0.5m': the lr schedule followed the steps to min_lr"  # fmt: skip
        assert (line in (tmp_path / budget / "train.log").read_text()) == warned, budget


# micro-batches of 4 x 64 and one thread, as tests/test_train.py's compiled run: inductor's code
# names its thread count, so with both the same the graphs come from inductor's cache
COMPILED = ["train.compile=true", "train.micro_batch_size=4"]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_budget_run_killed_and_resumed_ends_where_the_uninterrupted_one_does(
    byte_data, tmp_path, monkeypatch, compiled
):
    """Killed after step 2 (the later checkpoints gone) and resumed in a new attempt, whose first
    step compiles under train.compile: the same steps, lrs and weights, bit for bit; and the
    compiled run reads the schedule at the points the eager one does (every step counts)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if compiled else threads)
    common = [*COMMON, *(COMPILED if compiled else [])]
    monkeypatch.setattr(state_module, "clock", StepClock())
    full, cut = tmp_path / "full", tmp_path / "cut"
    try:
        assert run(byte_data, full, *common)["steps"] == 6
        shutil.copytree(full, cut)
        for later in (4, 6):
            shutil.rmtree(cut / "checkpoints" / f"step_{later:08d}")
        (cut / "checkpoints" / "latest").write_text("step_00000002\n")
        monkeypatch.setattr(state_module, "clock", StepClock())  # a new process: a new clock
        assert run(byte_data, cut, *common)["steps"] == 6
    finally:
        torch.set_num_threads(threads)
    a, b = weights(full), weights(cut)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert lrs(cut) == lrs(full)
    for k, lr in lrs(full).items():  # step k at the point k - 1 of 6 s reach, compiled or not,
        # except that a compiled run's step 2 is read at 1 step: the compiling step 1 counts as
        # long as step 2, unknown before step 2 ends
        x = 1 if compiled and k == 2 else (k - 1) / 6 * 100
        assert lr == pytest.approx(by_hand(x, 3e-3, 3e-4, 2, 100), rel=1e-12), k
    saved = checkpoint.load_state(checkpoint.find(cut))["train_state"]
    assert saved["train_s"] == pytest.approx(6.0)
    if not compiled:
        assert run(byte_data, cut, *common)["steps"] == 6  # the budget is spent: nothing more
        assert "already trained to step 6" in (cut / "train.log").read_text()


@pytest.mark.parametrize("bad", ["10", "ten minutes", "-5m", "0s", "1e-9s", "0.5s", "0.01m"])
def test_a_budget_that_is_not_a_duration_is_one_line_exit_2(tmp_path, capsys, bad):
    args = ["train", "--config", DEBUG, f"--run.dir={tmp_path / 'r'}", f"--train.time_budget={bad}"]
    assert cli(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.time_budget" in err[0] and "90s, 10m or 2h" in err[0]
    assert not (tmp_path / "r").exists()
    if bad in ("1e-9s", "0.5s", "0.01m"):  # durations, but shorter than a step can be
        assert "too short to train a step; give at least 1s" in err[0]


def test_the_budget_floor_is_in_the_help(capsys):
    with pytest.raises(SystemExit) as e:
        cli(["train", "--help"])
    assert e.value.code in (0, None)
    out = " ".join(capsys.readouterr().out.split())
    assert "train.time_budget" in out and "at least 1s" in out


def contents(folder) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}  # fmt: skip


def cli_train(byte_data, run_dir, *overrides) -> int:
    args = ["train", "--config", DEBUG, f"--data.dir={byte_data}", f"--run.dir={run_dir}"]
    return cli([*args, "--log.progress=false", "--log.plot=false", *(f"--{o}" for o in overrides)])


def test_resuming_under_another_budget_is_one_line_exit_2_and_nothing_written(
    byte_data, tmp_path, step_clock, capsys
):
    """A checkpoint trained under 6s resumed with 12s (the schedule would go back to 3/6 of its
    way), 3s or none, and one trained without a budget resumed with one: one line naming both
    budgets and the fix, exit 2, the run folder unchanged; the same budget spelled otherwise
    (0.1m) is the same budget."""
    run(byte_data, tmp_path / "r", *COMMON)
    before = contents(tmp_path / "r")
    no_budget = [o for o in COMMON if not o.startswith("train.time_budget")]
    for other in ("12s", "3s", ""):
        capsys.readouterr()
        assert cli_train(byte_data, tmp_path / "r", *no_budget, f"train.time_budget={other}") == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        assert f"train.time_budget = {other!r} but checkpoint" in err[0], err[0]
        assert "trained under train.time_budget = '6s'" in err[0], err[0]
        assert "rerun with --train.time_budget=6s, or start a new run.dir" in err[0], err[0]
        assert contents(tmp_path / "r") == before
    assert cli_train(byte_data, tmp_path / "r", *no_budget, "train.time_budget=0.1m") == 0
    run(byte_data, tmp_path / "steps", "train.max_steps=2", *no_budget[1:])
    before = contents(tmp_path / "steps")
    capsys.readouterr()
    assert cli_train(byte_data, tmp_path / "steps", *no_budget, "train.time_budget=6s") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trained under no train.time_budget (its lr followed steps)" in err[0]
    assert "rerun with no train.time_budget, or start a new run.dir" in err[0], err[0]
    assert contents(tmp_path / "steps") == before


@pytest.mark.slow
def test_ddp_ranks_with_unequal_step_times_read_one_clock(byte_data, tmp_path):
    """Rank 0's steps take 1 s, rank 1's 1.5 s (GPTRAIN_FAULT=step_time, per rank): both ranks
    set the same lr and start every step from the same weights (bit for bit), stop at the same
    step, and follow the lr schedule of one process whose steps take 1.5 s (the slower clock)."""
    budget = [f"--data.dir={byte_data}", *(f"--{o}" for o in COMMON), "--checkpoint.every=0"]
    out = tmp_path / "probe"
    args = ["tests/replicas_worker.py", "probe", str(out), f"--run.dir={tmp_path / 'ddp'}"]
    fault = {faults.ENV: "step_time@1/0,step_time@1.5/1"}
    procs = h.spawn([*args, *budget, "--dist.mode=ddp"], **fault)
    h.check_ok(h.wait_all(procs, h.TIMEOUT))
    ranks = [json.loads(out.with_suffix(f".{r}").read_text()) for r in range(2)]
    assert ranks[0]["steps"] == ranks[1]["steps"]  # every step: the same lr, the same weights
    assert ranks[0]["train_s"] == ranks[1]["train_s"] == 6.0  # 1.5 s x 4, agreed
    assert ranks[0]["done"] == ranks[1]["done"] == 4  # 6 + 1.5 > 6: the budget is spent
    faults.install(0, {faults.ENV: "step_time@1.5"})
    try:
        run(byte_data, tmp_path / "one", *COMMON, "checkpoint.every=0")
    finally:
        faults.install(0, {})
    assert [s["lr"] for s in ranks[0]["steps"]] == list(lrs(tmp_path / "one").values())

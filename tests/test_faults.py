"""Fault injection (GPTRAIN_FAULT): the spec's grammar and its refusals, inert when unset or meant
for another rank, `crash` exits 1 inside its step, `spike` multiplies that step's loss and
gradients by 20, `eval_error` raises once at its step, `publish_error` fails a publish with ENOSPC
(one process here; 2 ranks, full and sharded: tests/test_publish_error.py); `kill_save` and
`kill_eval` SIGKILL a run in tests/test_kill_faults.py (2 ranks: tests/test_chaos.py). `hang` and
`stall_save` are exercised with the watchdog (tests/test_watchdog.py). `step_time` is this rank's
fixed step time, `perturb` moves one weight by one ulp after its step (runs with them:
tests/test_time_budget.py, tests/test_replicas.py, tests/test_equivalence_matrix.py)."""

import json
import sys

import forked
import pytest
import torch
from train_helpers import DEBUG, REPO, run

from gptrain.__main__ import main as cli
from gptrain.checkpoint import manager as checkpoint
from gptrain.distributed import faults
from gptrain.errors import UserError

QUICK = ["eval.every=0", "eval.sample_every=0", "eval.tokens=512", "eval.sample_tokens=1"]
QUICK += ["optim.warmup_steps=1", "log.every=1"]


@pytest.fixture
def fault(monkeypatch):
    """fault(spec, rank=0): install GPTRAIN_FAULT for this (in-process) test; cleared after."""

    def set_fault(spec, rank=0):
        faults.install(rank, {faults.ENV: spec})

    yield set_fault
    faults.install(0, {})


def rows(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


def test_parse():
    assert faults.parse("") == []
    assert faults.parse("hang@5, crash@7/1,spike@2,stall_save@10/0") == [
        faults.Fault("hang", 5, None),
        faults.Fault("crash", 7, 1),
        faults.Fault("spike", 2, None),
        faults.Fault("stall_save", 10, 0),
    ]
    assert faults.parse("publish_error@4/1,eval_error@6") == [
        faults.Fault("publish_error", 4, 1),
        faults.Fault("eval_error", 6, None),
    ]
    assert faults.parse("perturb@3/1, step_time@0.25,step_time@1.5/1") == [
        faults.Fault("perturb", 3, 1),
        faults.Fault("step_time", 0.25, None),
        faults.Fault("step_time", 1.5, 1),
    ]
    assert faults.parse("kill_save@8/0, kill_eval@12,kill_save@4,kill_eval@6/1") == [
        faults.Fault("kill_save", 8, 0),
        faults.Fault("kill_eval", 12, None),
        faults.Fault("kill_save", 4, None),
        faults.Fault("kill_eval", 6, 1),
    ]


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("boom@3", "unknown fault kind 'boom'"),
        ("hang", "malformed entry 'hang'"),
        ("hang@x", "malformed entry 'hang@x'"),
        ("hang@0", "malformed entry 'hang@0'"),
        ("crash@3/a", "malformed entry 'crash@3/a'"),
        ("spike@2,hang@", "malformed entry 'hang@'"),
        ("publish_error@", "malformed entry 'publish_error@'"),
        ("eval_error@2/x", "malformed entry 'eval_error@2/x'"),
        ("publish@2", "unknown fault kind 'publish'"),
        ("kill_save@0", "malformed entry 'kill_save@0'"),
        ("kill_save@x/0", "malformed entry 'kill_save@x/0'"),
        ("kill_eval@", "malformed entry 'kill_eval@'"),
        ("kill_eval@-3", "malformed entry 'kill_eval@-3'"),
        ("kill@2", "unknown fault kind 'kill'"),
        ("perturb@0/1", "malformed entry 'perturb@0/1'"),
        ("step_time@0", "malformed entry 'step_time@0'"),
        ("step_time@-1", "malformed entry 'step_time@-1'"),
        ("step_time@inf", "malformed entry 'step_time@inf'"),
        ("step_time@x/1", "malformed entry 'step_time@x/1'"),
        ("step_time@", "malformed entry 'step_time@'"),
    ],
)
def test_bad_spec_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, monkeypatch, spec, needle):  # fmt: skip
    with pytest.raises(UserError, match=needle):
        faults.parse(spec)
    monkeypatch.setenv(faults.ENV, spec)
    run_dir = tmp_path / "r"
    assert cli(["train", "--config", DEBUG, f"--run.dir={run_dir}", "--log.progress=false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and "GPTRAIN_FAULT" in err[0] and "hang@5/1" in err[0]
    assert not run_dir.exists()
    faults.install(0, {})


def test_inert_when_unset_or_for_another_rank(fault):
    model = torch.nn.Linear(2, 2)
    faults.install(0, {})
    assert faults.in_step(3, model) is faults._NULL and not faults._active
    kinds = ("spike", "hang", "crash", "publish_error", "eval_error", "kill_save", "kill_eval")
    fault(",".join(f"{k}@3/1" for k in kinds), rank=0)
    assert faults.in_step(3, model) is faults._NULL
    faults.stall_save(3)  # returns at once: stall_save is not set here
    faults.publish_error(3, "latest")  # these are rank 1's
    faults.eval_error(3)
    faults.kill_save(3)
    faults.kill_eval(3)
    fault("kill_save@3,kill_eval@3")  # every rank's, but another step's (or no step: a download)
    faults.kill_save(2)
    faults.kill_save(None)
    faults.kill_eval(4)


def test_step_time_is_this_ranks_and_inert_when_unset(fault):
    fault("")
    assert faults.step_seconds() is None
    fault("step_time@1/0,step_time@1.5/1", rank=1)
    assert faults.step_seconds() == 1.5 and not faults._active
    assert faults.in_step(1, torch.nn.Linear(2, 2)) is faults._NULL
    fault("step_time@0.25/1", rank=0)
    assert faults.step_seconds() is None


def test_perturb_moves_one_weight_by_one_ulp_after_the_step_once(fault):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fault("perturb@2")
    with faults.in_step(1, model):
        pass
    with faults.in_step(2, model):
        assert torch.equal(model.weight, before["weight"])  # the step itself is untouched
    w = before["weight"].view(-1)
    assert model.weight.view(-1)[0].item() == torch.nextafter(w[0], torch.tensor(1e30)).item()
    assert torch.equal(model.weight.view(-1)[1:], w[1:])
    assert torch.equal(model.bias, before["bias"])
    assert faults.in_step(2, model) is faults._NULL  # once per process


def test_eval_error_raises_once_at_its_step(fault):
    fault("eval_error@6")
    faults.eval_error(5)
    with pytest.raises(
        RuntimeError, match=r"^fault injection \(GPTRAIN_FAULT\): eval error at step 6$"
    ):
        faults.eval_error(6)
    faults.eval_error(6)  # once per process


def test_spike_multiplies_that_steps_loss_and_gradients(byte_data, tmp_path, fault):
    common = ["train.max_steps=5", "checkpoint.every=0", "optim.grad_clip=0", *QUICK]
    fault("spike@3")
    run(byte_data, tmp_path / "spiked", *common)
    fault("")
    run(byte_data, tmp_path / "ref", *common)
    b, c = rows(tmp_path / "spiked"), rows(tmp_path / "ref")
    assert [r["loss"] for r in b[:2]] == [r["loss"] for r in c[:2]]  # before: identical
    assert b[2]["loss"] == pytest.approx(20 * c[2]["loss"], rel=1e-5)
    assert b[2]["grad_norm"] == pytest.approx(20 * c[2]["grad_norm"], rel=1e-4)  # before clipping
    assert b[3]["loss"] != c[3]["loss"]  # the x20 gradient (unclipped) moved AdamW's moments


def test_crash_exits_1_inside_its_step(byte_data, tmp_path):
    run_dir = tmp_path / "r"
    cmd = [sys.executable, "-m", "gptrain", "train", "--config", DEBUG, f"--data.dir={byte_data}"]
    cmd += [f"--run.dir={run_dir}", "--log.progress=false", "--log.plot=false", "--train.max_steps=6"]  # fmt: skip
    cmd += ["--checkpoint.every=2", *(f"--{q}" for q in QUICK)]
    env = {**__import__("os").environ, faults.ENV: "crash@4", "PYTHONPATH": str(REPO)}
    p = forked.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "fault injection (GPTRAIN_FAULT): crash at step 4: exit 1" in p.stderr
    assert checkpoint.latest(run_dir).name == "step_00000002"  # step 3 trained, 4 never finished
    assert [r["step"] for r in rows(run_dir)] == [1, 2, 3]


def cli_train(byte_data, run_dir, *overrides):
    args = ["train", "--config", DEBUG, f"--data.dir={byte_data}", f"--run.dir={run_dir}"]
    return cli([*args, "--log.progress=false", "--log.plot=false", *(f"--{o}" for o in overrides)])


def test_publish_error_keeps_the_previous_checkpoint_and_the_rerun_is_exact(
    byte_data, tmp_path, fault, capsys, monkeypatch
):
    """publish_error@4: the step-4 folder is renamed into place, then writing `latest` fails with
    ENOSPC: one line naming rank 0, the path and the error, exit 1; the rename is undone, so
    step_00000002 stays complete and named in `latest`, and no step-4 folder is left. The same
    command then ends bit for bit where an uninterrupted run ends."""
    common = ["train.max_steps=6", "checkpoint.every=2", "model.dropout=0.1", *QUICK]
    run(byte_data, tmp_path / "ref", *common)
    run_dir = tmp_path / "r"
    monkeypatch.setenv(faults.ENV, "publish_error@4")  # read by `gptrain train`
    capsys.readouterr()
    assert cli_train(byte_data, run_dir, *common) == 1
    err = capsys.readouterr().err.strip().splitlines()
    lines = [x for x in err if x.startswith("gptrain: error:")]
    root = run_dir / "checkpoints"
    assert len(lines) == 1 and "Traceback" not in "\n".join(err), err
    assert lines[0].startswith("gptrain: error: rank 0: cannot publish checkpoint step_00000004")
    assert f"No space left on device: '{root / '.latest.tmp'}'" in lines[0], lines[0]
    assert "the previous checkpoint step_00000002 is intact and `latest` names it" in lines[0]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002", "timeline.json"]
    assert checkpoint.latest(run_dir).name == "step_00000002"
    assert checkpoint.problem(root / "step_00000002") is None
    monkeypatch.delenv(faults.ENV)
    assert cli_train(byte_data, run_dir, *common) == 0
    a = checkpoint.load_model_state(checkpoint.find(tmp_path / "ref"))[0]
    b = checkpoint.load_model_state(checkpoint.find(run_dir))[0]
    for k in a:
        assert torch.equal(a[k], b[k]), k

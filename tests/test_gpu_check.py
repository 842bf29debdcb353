"""benchmarks/gpu/gpu_check.py, the GPU proof run, checked on a CPU: its dry run (tiny models, 2 gloo
ranks) prints every row; --rows trains only what the rows asked for need; the real run where a
CUDA device is present."""

import sys

import dist_helpers as h
import forked
import pytest
import torch

sys.path.insert(0, str(h.REPO / "benchmarks" / "gpu"))
import gpu_check  # noqa: E402


def _script(*args):
    import subprocess

    script = h.REPO / "benchmarks" / "gpu" / "gpu_check.sh"
    env = h.env(PYTHON=sys.executable)
    return subprocess.run([str(script), *args], env=env, capture_output=True, text=True, timeout=1800)  # fmt: skip


@pytest.mark.slow
@pytest.mark.benchmark
def test_gpu_check_dry_run_prints_its_table(monkeypatch, capsys):
    """benchmarks/gpu/gpu_check.sh --dry-run: every row of the GPU proof run, on tiny CPU models. The
    script runs in this process, its commands forked (tests/forked.py); the shell wrapper is
    checked on its own: without a GPU and without --dry-run it is one line and exit code 2."""
    done = _script()
    assert done.returncode == 2 and "no CUDA device here" in done.stdout, done.stderr[-3000:]
    monkeypatch.setattr(gpu_check, "run_command", forked.run)
    monkeypatch.setattr(gpu_check, "launch", forked.Popen)
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--dry-run"])
    assert gpu_check.main() == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ")][1:]
    assert len(rows) == 7, out
    cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
    assert [c[2] for c in cells[0:1] + cells[2:4]] == ["OK"] * 3, out
    assert cells[4][2] == "OK, bit for bit", out  # on a CPU the resume is exact
    assert "dtype float32 (config), attention " in rows[1], out
    assert all(c[3].endswith(" s") and float(c[3][:-2]) >= 0 for c in cells), out
    assert out.count("gpu_check: done: ") == 7, out  # each row printed when it was done
    assert "vocab 50257" in rows[0] and "tok/s, MFU" in rows[0]
    assert "sharded checkpoint save" in rows[5] and "peak" in rows[1]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_check_on_this_gpu_node():
    """The real proof run: every equality row OK on the GPUs of this machine."""
    done = _script()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "MISMATCH" not in done.stdout, done.stdout


def _fake_check(monkeypatch, diff=0.0, noise=0.0, fail=()):
    """A Check whose training runs are recorded, not run: (name, nproc, overrides) each; `diff`
    the resumed run's weight difference, `noise` two uninterrupted runs', `fail` the runs whose
    command fails (as Check.train reports it: SystemExit with the log's tail)."""
    check = gpu_check.Check.__new__(gpu_check.Check)
    check.dry, check.gpus, check.device, check.rows, check.data = True, 2, "cpu", [], h.REPO
    check.work, trained = h.REPO / "unused", []

    def train(name, nproc, overrides, kill_after_ckpt=False):
        trained.append((name, nproc, overrides))
        if name in fail:
            raise SystemExit(
                f"failed: torchrun ... {name}\nTraceback ...\nRuntimeError: {name} broke\n"
            )
        choices = {"dtype": "bfloat16", "attention": "sdpa", "how": {"dtype": "measured", "attention": "measured"}, "block_ms": {"float32/sdpa": 3.0, "bfloat16/sdpa": 1.5}}  # fmt: skip
        return {"train_loss": 2.0, "tok_per_s": 1.0, "mfu": 0.5, "peak_mib": 1.0, "save_s": [1.0], "muon_s": [0.1], "speed_choices": choices}  # fmt: skip

    def kill_and_resume(n, steps, extra):
        train("resume_cut", n, check.overrides("resume_cut", "gpt2", steps, *extra))
        return "step_00000001", diff

    monkeypatch.setattr(check, "train", train)
    monkeypatch.setattr(check, "throughput", lambda: ("1 tok/s", "OK"))
    monkeypatch.setattr(check, "kill_and_resume", kill_and_resume)
    monkeypatch.setattr(check, "weight_diff", lambda a, b: noise if {a, b} == {"exact", "exact_again"} else None)  # fmt: skip
    return check, trained


@pytest.mark.parametrize(
    "rows, runs",
    [
        ({0}, []),
        ({1}, ["one_False"]),
        ({2}, ["one_False", "ddp", "fsdp"]),
        ({3}, ["exact", "resume_cut"]),
        ({4}, ["xl"]),
        ({5}, ["xl_muon"]),
        ({0, 1, 2, 3, 4}, ["one_False", "ddp", "fsdp", "exact", "resume_cut", "xl"]),
    ],
)
def test_rows_train_only_what_they_need_once(monkeypatch, capsys, rows, runs):
    check, trained = _fake_check(monkeypatch)
    check.run(rows)
    assert [t[0] for t in trained] == runs and not check.failed
    assert len(check.rows) == len(capsys.readouterr().out.splitlines())  # each printed when done
    assert len(check.rows) == sum({0: 1, 1: 1, 2: 2, 3: 1, 4: 1, 5: 1}[r] for r in rows)
    configs = {name: [o for o in overrides if not o.startswith("run.dir=")] for name, _, overrides in trained}  # fmt: skip
    for name, nproc, overrides in trained:
        assert nproc == (1 if name.startswith("one_") else 2)
        if name == "exact":  # row 3: deterministic kernels, checkpoints to resume from
            assert {"dist.mode=fsdp", "checkpoint.every=1", "train.deterministic=true"} <= set(overrides)  # fmt: skip
            assert configs["resume_cut"] == configs["exact"]  # the resumed run is the same run
        if name == "xl":  # GPT-2 XL's ~19 GB of state at most twice on the disk
            assert "checkpoint.keep_last=1" in overrides and "train.max_steps=2" in overrides


@pytest.mark.parametrize("rows", ["6", "x", "", "1,,2"])
def test_bad_rows_are_one_line_and_exit_2(monkeypatch, capsys, rows):
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--dry-run", "--rows", rows])
    assert gpu_check.main() == 2
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "--rows" in out and "0 to 5" in out


@pytest.mark.parametrize(
    "diff, noise, verdict",
    [
        (0.0, None, "OK, bit for bit"),  # exact: no second run needed
        (5e-3, 3e-3, "OK, within the run-to-run noise"),
        (5e-3, 0.0, "MISMATCH"),  # the kernels were deterministic: the resume changed something
        (7e-3, 3e-3, "MISMATCH"),
    ],
)
def test_resume_row_is_judged_against_the_run_to_run_noise(monkeypatch, capsys, diff, noise, verdict):  # fmt: skip
    check, trained = _fake_check(monkeypatch, diff, noise)
    check.run({3})
    (row,) = check.rows
    assert row[2] == verdict and f"{diff:.2e}" in row[1]
    assert ("exact_again" in [t[0] for t in trained]) == (noise is not None)
    if noise is not None:
        assert f"two uninterrupted runs {noise:.2e}" in row[1]


def test_the_single_gpu_row_shows_the_speed_choices(monkeypatch, capsys):
    check, _ = _fake_check(monkeypatch)
    check.run({1})
    (row,) = check.rows
    shown = "dtype bfloat16 (measured), attention sdpa (measured); one block fwd+bwd: float32/sdpa 3 ms, bfloat16/sdpa 1.5 ms"  # fmt: skip
    assert shown in row[1]


def test_a_failed_command_is_a_failed_row_and_the_next_rows_still_run(monkeypatch, capsys):
    """one_False fails: row 1 and both row 2 rows (which compare with it) are FAILED with the
    command's last line, trained once; rows 3 and 4 still run; the script will exit 1."""
    from gptrain.checkpoint import folder

    monkeypatch.setattr(folder, "cpu_cores", lambda: 6)  # 2 ranks: 3 threads each
    check, trained = _fake_check(monkeypatch, fail={"one_False"})
    check.run({1, 2, 3, 4})
    verdicts = [r[2] for r in check.rows]
    assert verdicts == ["FAILED", "FAILED", "FAILED", "OK, bit for bit", "sharded checkpoint save 1.0 s, 3 I/O threads per rank"]  # fmt: skip
    assert all(r[1] == "failed: RuntimeError: one_False broke" for r in check.rows[:3])
    assert [t[0] for t in trained] == ["one_False", "exact", "resume_cut", "xl"] and check.failed
    assert "Traceback" in capsys.readouterr().err  # the whole log, for the person reading it

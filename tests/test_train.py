"""End-to-end trainer tests (one process): it learns, it writes its outputs, accumulation splits
are equivalent, compiled equals eager, bad input is one line, ctrl-c stops cleanly."""

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import forked
import pytest
import torch
from safetensors.torch import load_file
from train_helpers import DEBUG, REPO, assert_same_training, comparable, run, weights

from gptrain.__main__ import main as cli
from gptrain.checkpoint import manager as checkpoint
from gptrain.config.load import load_config
from gptrain.training.build import build_model


def test_debug_run_learns_and_writes_outputs(byte_data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert (
        cli(
            [
                "train",
                "--config",
                DEBUG,
                f"--data.dir={byte_data}",
                f"--run.dir={run_dir}",
                "--log.progress=false",
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    vals = [r for r in rows if "val_loss" in r]
    assert vals[0]["step"] == 0 and vals[-1]["step"] == 40
    # untrained: about ln(257) nats; trained: clearly lower, and bpb consistent with bytes = tokens
    assert abs(vals[0]["val_loss"] - math.log(257)) < 0.3
    assert vals[-1]["val_loss"] < 0.7 * vals[0]["val_loss"]
    assert abs(vals[-1]["val_bpb"] - vals[-1]["val_loss"] / math.log(2)) < 1e-6
    logged = [r for r in rows if "loss" in r]
    assert [r["step"] for r in logged] == [5, 10, 15, 20, 25, 30, 35, 40]
    for r in logged:
        assert set(r) >= {"step", "loss", "lr", "grad_norm", "tokens", "tok_per_s", "mfu"}
        assert r["tokens"] == r["step"] * 1024 and 0 < r["mfu"] < 1 and r["grad_norm"] > 0
    assert (run_dir / "loss.png").stat().st_size > 10_000
    log = (run_dir / "train.log").read_text()
    assert "step 40/40 loss" in log and "step 40: val loss" in log and "done: 40 steps" in log
    assert f"; plot {run_dir / 'loss.png'}" in log  # log.plot's default: drawn at the end
    assert (run_dir / "config.toml").is_file()
    assert load_config(str(run_dir / "config.toml")).run.dir == str(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 40 and summary["val_loss"] == vals[-1]["val_loss"]
    meta = checkpoint.load_meta(checkpoint.find(run_dir))
    assert meta["step"] == 40 and meta["tokenizer"]["name"] == "byte"
    assert [p.name for p in sorted((run_dir / "checkpoints").glob("step_*"))] == [
        "step_00000020",
        "step_00000040",
    ]
    keys = weights(run_dir).keys()
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in keys)
    out = capsys.readouterr()
    assert "sample:" in out.out + out.err and "done: 40 steps" in out.out + out.err


def test_accumulation_splits_are_equivalent(byte_data, tmp_path):
    """Same 1024-token batches: 1 micro-batch of 16 == 2 of 8 == 4 of 4 (float32)."""
    common = [
        "train.max_steps=6",
        "eval.every=0",
        "checkpoint.every=0",
        "eval.sample_every=0",
        "eval.tokens=512",
        "eval.sample_tokens=1",
    ]
    runs = {}
    for mb in (16, 8, 4):
        run(byte_data, tmp_path / f"mb{mb}", f"train.micro_batch_size={mb}", *common)
        runs[mb] = weights(tmp_path / f"mb{mb}")
    for mb in (8, 4):
        assert_same_training(comparable(runs[mb]), comparable(runs[16]), f"micro-batch {mb}", 6 * 3e-3)  # fmt: skip
    # AdamW's step hardly changes when every gradient is scaled: the logged loss (the mean over
    # micro-steps) and gradient norm are what catch a split that scales the loss wrongly
    logged = {mb: [json.loads(r) for r in (tmp_path / f"mb{mb}" / "metrics.jsonl").read_text().splitlines()] for mb in runs}  # fmt: skip
    for mb in (8, 4):
        for key in ("loss", "grad_norm"):
            want = [r[key] for r in logged[16] if key in r]
            assert len(want) >= 2 and [r[key] for r in logged[mb] if key in r] == pytest.approx(want, rel=1e-5), (key, mb)  # fmt: skip
    # a resume may change the micro-batch (e.g. auto on another world size): the loader's cursor
    # counts windows, so steps 4-6 see the same tokens as the uninterrupted run
    cut = tmp_path / "cut"
    run(byte_data, cut, "train.micro_batch_size=16", *common, "checkpoint.every=3")
    shutil.rmtree(cut / "checkpoints" / "step_00000006")  # as if stopped after step 3's save
    (cut / "checkpoints" / "latest").write_text("step_00000003")
    more = ("train.micro_batch_size=auto", "train.micro_batch_cap=5", "checkpoint.resume=3")
    run(byte_data, cut, *common, *more)
    assert "micro-batch 4 (auto), accumulation 4" in (cut / "train.log").read_text()
    for k, v in comparable(runs[16]).items():
        torch.testing.assert_close(comparable(weights(cut))[k], v, rtol=1e-5, atol=1e-6, msg=k)
    torch.manual_seed(1337)  # the initial weights: training really moved them
    init = build_model(load_config(DEBUG), 257).state_dict()
    assert max((init[k] - runs[16][k]).abs().max().item() for k in init) > 1e-3


@pytest.mark.parametrize(
    "override, needle",
    [
        ("--train.total_batch_size=1000", "nearest valid totals"),
        ("--data.dir=/nonexistent/folder", "/nonexistent/folder"),
        ("--model.preset=gpt5", "model.preset"),
        ("--train.dtype=float8", "train.dtype"),
    ],
)
def test_bad_input_one_line_exit_2(byte_data, tmp_path, capsys, override, needle):
    args = [
        "train",
        "--config",
        DEBUG,
        f"--data.dir={byte_data}",
        f"--run.dir={tmp_path / 'r'}",
        override,
    ]
    assert cli(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0] and "Traceback" not in err[0]


def test_a_val_sample_larger_than_the_split_is_refused_before_anything_is_written(
    byte_data, tmp_path, capsys
):
    """tiny shakespeare's byte val split holds ~111k tokens: 200,000 is refused in one line with
    the fix, before a checkpoint, a log or a config is written; 0 scores all of it."""
    run_dir = tmp_path / "r"
    args = ["train", "--config", DEBUG, f"--data.dir={byte_data}", f"--run.dir={run_dir}"]
    assert cli([*args, "--eval.tokens=200000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "eval.tokens = 200,000 is more than the val split" in err[0]
    assert "eval.tokens=0" in err[0]
    assert not run_dir.exists() or os.listdir(run_dir) in ([], [".lock"])


def test_bench_reports_tokens_and_mfu(capsys, tmp_path):
    args = ["bench", "--config", DEBUG, "--steps", "2", "--warmup", "1"]
    assert cli([*args, "--json", str(tmp_path / "rows.json")]) == 0
    out = capsys.readouterr().out
    header, _, line = [r for r in out.splitlines() if r.startswith("|")]
    row = dict(zip(header.split("|"), line.split("|"), strict=True))
    row = {k.strip(): v.strip() for k, v in row.items()}
    tok_per_s, mfu = float(row["tok_per_s"].replace(",", "")), float(row["mfu"].rstrip("%"))
    assert row["dtype"] == "float32" and tok_per_s > 0 and 0 < mfu < 100
    (saved,) = json.loads((tmp_path / "rows.json").read_text())  # the same row, machine-readable
    assert (f"{saved['tok_per_s']:,.0f}", f"{saved['mfu']:.1%}") == (row["tok_per_s"], row["mfu"])
    step_s = saved["step_ms"] / 1e3  # tokens/s is the batch over the step time
    assert saved["tok_per_s"] == pytest.approx(saved["accum"] * saved["micro_batch"] * 64 / step_s)


@pytest.mark.slow
def test_log_plot_false_ends_without_a_plot_that_gptrain_plot_draws_later(byte_data, tmp_path):
    """log.plot = false: no loss.png and none named in the last line; `gptrain plot` draws it
    from metrics.jsonl afterwards."""
    run_dir = tmp_path / "run"
    quick = ["train.max_steps=2", "optim.warmup_steps=1", "eval.every=0", "eval.tokens=512"]
    run(byte_data, run_dir, *quick, "eval.sample_every=0", "eval.sample_tokens=1", "log.plot=false")
    done = [x for x in (run_dir / "train.log").read_text().splitlines() if x.startswith("done:")]
    assert len(done) == 1 and "plot" not in done[0] and not (run_dir / "loss.png").exists()
    assert cli(["plot", "--run", str(run_dir)]) == 0
    assert (run_dir / "loss.png").stat().st_size > 10_000


def test_compiled_run_equals_eager_and_saves_plain_keys(byte_data, tmp_path):
    """train.compile=true trains, evaluates and samples; same weights as eager; no _orig_mod."""
    # micro-batches of 4 x 64 and one thread, as each rank of tests/test_distributed.py's
    # compiled DDP run: inductor's code names its thread count, so with both the same the later
    # test finds every graph in inductor's cache (17.5 -> 6 s on the AVX2 tier)
    common = ["train.max_steps=3", "optim.warmup_steps=1", "eval.every=0", "eval.tokens=512"]
    common += ["train.micro_batch_size=4"]
    common += ["eval.sample_every=0", "eval.sample_tokens=4", "checkpoint.every=0"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run(byte_data, tmp_path / "eager", *common)
        run(byte_data, tmp_path / "compiled", "train.compile=true", *common)
    finally:
        torch.set_num_threads(threads)
    raw = load_file(str(checkpoint.find(tmp_path / "compiled") / "model.safetensors"))
    assert not any("_orig_mod" in k or k.startswith("module.") for k in raw)
    a, b = comparable(weights(tmp_path / "eager")), comparable(weights(tmp_path / "compiled"))
    assert_same_training(b, a, "compiled vs eager", 3 * 3e-3, rtol=1e-4, atol=1e-5)


def test_ctrl_c_stops_cleanly_with_a_final_log_line(byte_data, tmp_path):
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "gptrain", "train", "--config", DEBUG, f"--data.dir={byte_data}"]
    args += [f"--run.dir={run_dir}", "--train.max_steps=100000", "--log.progress=false", "--log.plot=false"]  # fmt: skip
    args += ["--checkpoint.every=5", "--eval.every=0"]
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}  # SIGABRT below prints every thread's stack
    # A shell starts background jobs (`make test &`) with SIGINT ignored, and a child inherits
    # that: Ctrl-C's default action is restored for the child, as in a terminal.
    proc = subprocess.Popen(
        args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    deadline = time.time() + 120
    while checkpoint.latest(run_dir) is None and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        out, err = proc.communicate()
        pytest.fail(f"still running 60 s after SIGINT; its threads:\n{err[-6000:]}")
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert "interrupted at step" in out + err and "run the same command to resume" in out + err
    assert checkpoint.latest(run_dir) is not None  # what was written is intact and resumable


def test_bpe_run_samples_without_its_data_or_tokenizer_file(shakespeare_txt, tmp_path, capsys):
    """Own BPE tokenizer -> prepare -> train -> sample, with the data and tok.json then deleted:
    the checkpoint folder carries the tokenizer (hash-checked)."""
    from gptrain.data.prepare import prepare

    tok = tmp_path / "tok.json"
    assert cli(["tokenizer", "train", "--input", str(shakespeare_txt), "--vocab-size", "400", "--out", str(tok)]) == 0  # fmt: skip
    data = tmp_path / "data"
    prepare([str(shakespeare_txt)], data, tokenizer=f"bpe:{tok}", progress=False)
    run_dir = tmp_path / "run"
    run(data, run_dir, "train.max_steps=2", "optim.warmup_steps=1", "eval.every=0", "eval.sample_every=0", "eval.tokens=512")  # fmt: skip
    shutil.rmtree(data)
    tok.unlink()
    capsys.readouterr()
    assert (
        cli(["sample", "--run", str(run_dir), "--prompt", "ROMEO:", "--max-new-tokens", "5"]) == 0
    )
    assert capsys.readouterr().out.startswith("ROMEO:")


def test_attention_auto_takes_the_measured_kernel_and_an_explicit_one_wins():
    """auto is what training/choices.py measured faster (tested there with a fake timer); an
    explicit sdpa or matmul is used as given."""
    from gptrain.training.build import attention_kernel

    assert attention_kernel("auto", "matmul") == "matmul"
    assert attention_kernel("auto", "sdpa") == "sdpa"
    assert attention_kernel("sdpa", "matmul") == "sdpa"
    assert attention_kernel("matmul", "sdpa") == "matmul"


def test_deterministic_run_equals_the_default_one_on_a_cpu_and_resumes_bit_for_bit(byte_data, tmp_path):  # fmt: skip
    """train.deterministic = true: torch's deterministic kernels for the run (it asks for them
    before its first matmul). CPU kernels already are, so the weights equal the default run's bit
    for bit, and a resumed deterministic run equals its uninterrupted twin bit for bit (on a GPU
    the flag is what makes this hold: benchmarks/gpu/gpu_check.py row 3)."""
    common = ["train.max_steps=6", "eval.every=0", "eval.sample_every=0", "checkpoint.every=3"]
    before = torch.are_deterministic_algorithms_enabled()
    try:
        run(byte_data, tmp_path / "default", *common)
        assert not torch.are_deterministic_algorithms_enabled()
        run(byte_data, tmp_path / "det", *common, "train.deterministic=true")
        assert torch.are_deterministic_algorithms_enabled()  # process-wide, set by each run
        assert os.environ.get("CUBLAS_WORKSPACE_CONFIG")
        cut = tmp_path / "cut"
        run(byte_data, cut, *common, "train.deterministic=true")
        shutil.rmtree(cut / "checkpoints" / "step_00000006")  # as if killed after step 3's save
        (cut / "checkpoints" / "latest").write_text("step_00000003")
        run(byte_data, cut, *common, "train.deterministic=true")
        want = weights(tmp_path / "default")
        for name in ("det", "cut"):
            got = weights(tmp_path / name)
            assert all(torch.equal(got[k], want[k]) for k in want), name
        assert (
            "resumed from" in (cut / "train.log").read_text()
            and "deterministic kernels" in (cut / "train.log").read_text()
        )
    finally:
        torch.use_deterministic_algorithms(before)


def test_an_op_without_a_deterministic_kernel_is_one_line_and_exit_2(byte_data, tmp_path, capsys, monkeypatch):  # fmt: skip
    """train.deterministic = true on a device where an op has no deterministic kernel (torch
    raises; no CPU op of a run does, so the error is torch's text for a CUDA one): one line
    naming the op and the fix, exit code 2. Without the flag the same error is not swallowed."""
    import gptrain.commands.train as command

    torch_error = RuntimeError(
        "avg_pool3d_backward_cuda does not have a deterministic implementation, but you set "
        "'torch.use_deterministic_algorithms(True)'. You can turn off determinism just for this "
        "operation, or you can use the 'warn_only=True' option, if that's acceptable for your application."
    )

    def fails(cfg, info):
        raise torch_error

    monkeypatch.setattr(command, "train", fails)
    args = ["train", "--config", DEBUG, f"--data.dir={byte_data}", f"--run.dir={tmp_path / 'r'}"]
    assert cli([*args, "--train.deterministic=true"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "avg_pool3d_backward_cuda has no deterministic kernel" in err
    assert "train.deterministic=false" in err
    with pytest.raises(RuntimeError, match="avg_pool3d"):
        cli(args)


def test_progress_bar_only_on_a_terminal(byte_data, tmp_path):
    """log.progress = true draws the bar where stderr is a terminal (a pty here); a batch log
    (a pipe) gets the plain step lines instead of carriage-return redraws."""
    import fcntl
    import os
    import pty
    import struct
    import subprocess
    import sys
    import termios

    args = [sys.executable, "-m", "gptrain", "train", "--config", DEBUG, f"--data.dir={byte_data}"]
    args += [
        "--train.max_steps=4",
        "--optim.warmup_steps=1",
        "--eval.every=0",
        "--eval.sample_every=0",
    ]
    args += ["--log.every=2"]
    args += ["--eval.tokens=512", "--log.progress=true"]
    piped = forked.run([*args, f"--run.dir={tmp_path / 'a'}"], capture_output=True, text=True)
    assert piped.returncode == 0, piped.stderr
    assert "step 2/4 loss" in piped.stdout and "\r" not in piped.stderr
    main, sub = pty.openpty()
    fcntl.ioctl(sub, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 24 x 100
    proc = forked.Popen([*args, f"--run.dir={tmp_path / 'b'}"], stdout=subprocess.PIPE, stderr=sub)
    os.close(sub)
    drawn = b""
    while True:  # read while it runs: the terminal's buffer is small
        try:
            chunk = os.read(main, 65536)
        except OSError:  # the process closed the terminal
            break
        if not chunk:
            break
        drawn += chunk
    out, _ = proc.communicate(timeout=120)
    os.close(main)
    assert proc.returncode == 0
    assert b"train:" in drawn and b"4/4" in drawn and b"step 2/4 loss" not in out


def test_a_second_training_into_a_run_dir_in_use_is_one_line_and_exit_2(byte_data, tmp_path):
    """Two `gptrain train` into one run.dir at once: the second stops with one line naming the
    first (host, pid), exit 2, writing nothing; the first finishes normally and lets go."""
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "gptrain", "train", "--config", DEBUG, f"--data.dir={byte_data}"]
    args += [f"--run.dir={run_dir}", "--log.progress=false", "--log.plot=false", "--log.every=1", "--eval.every=0"]  # fmt: skip
    args += ["--eval.sample_every=0", "--eval.tokens=512", "--train.max_steps=100"]
    first = forked.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics, deadline = run_dir / "metrics.jsonl", time.time() + 120
    while time.time() < deadline and first.poll() is None:
        if metrics.is_file() and metrics.read_text():
            break
        time.sleep(0.05)
    attempts = (run_dir / "attempts.jsonl").read_text()
    second = forked.run(args, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert first.poll() is None, "the first run ended before the second started"
    assert second.returncode == 2, second.stderr[-2000:]
    host = socket.gethostname()
    assert second.stderr.splitlines() == [
        line for line in second.stderr.splitlines() if line.startswith("gptrain: error: ")
    ]
    assert len(second.stderr.splitlines()) == 1
    assert f"run folder {run_dir} is in use by gptrain train (host {host}, pid {first.pid}, since " in second.stderr  # fmt: skip
    assert (run_dir / "attempts.jsonl").read_text().startswith(attempts)
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-2000:]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 100
    starts = [json.loads(x) for x in (run_dir / "attempts.jsonl").read_text().splitlines()]
    assert len([r for r in starts if r.get("event") == "start"]) == 1  # the second wrote nothing
    assert not (run_dir / ".lock").exists()


@pytest.mark.slow
def test_every_rank_stops_with_one_line_when_the_run_dir_is_in_use(byte_data, tmp_path):
    """2 gloo ranks into a run.dir whose lock a live process holds: rank 0 (the only one that
    takes the lock) is refused, and its refusal stops rank 1 too, both exit 2 with the line."""
    import dist_helpers as h

    run_dir = tmp_path / "run"
    args = ["-m", "gptrain", "train", "--config", DEBUG, f"--data.dir={byte_data}"]
    args += [f"--run.dir={run_dir}", "--train.micro_batch_size=4", *h.FAST]
    with checkpoint.RunLock(run_dir, "a test"):
        results = h.wait_all(h.spawn(args), h.TIMEOUT)
        assert sorted(os.listdir(run_dir)) == [".lock"]  # nothing written
    assert [rc for rc, _, _ in results] == [2, 2], [r[2][-2000:] for r in results]
    for _, _, err in results:
        assert f"run folder {run_dir} is in use by a test (host {socket.gethostname()}, pid {os.getpid()}" in err  # fmt: skip
        assert "Traceback" not in err

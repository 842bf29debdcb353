"""End-to-end trainer tests (one process): it learns, it writes its outputs, accumulation splits
are equivalent, and a resumed run equals an uninterrupted one bit for bit."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from gptrain.__main__ import main as cli
from gptrain.checkpoint import manager as checkpoint
from gptrain.commands.train import train
from gptrain.config.load import load_config
from gptrain.distributed.runtime import DistInfo
from gptrain.training.build import build_model

REPO = Path(__file__).resolve().parents[1]
DEBUG = str(REPO / "configs" / "debug.toml")


def run(byte_data, run_dir, *overrides):
    cfg = load_config(
        DEBUG, [f"data.dir={byte_data}", f"run.dir={run_dir}", "log.progress=false", *overrides]
    )
    return train(cfg, DistInfo())


def weights(run_dir, step=None):
    return checkpoint.load_model_state(checkpoint.find(run_dir, step))[0]


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


def comparable(state: dict, n_embd: int = 64) -> dict:
    """Weights minus the key part of each attention input bias: its true gradient is exactly zero
    (a constant added to every score of a query leaves the softmax unchanged), so AdamW turns the
    ~1e-11 rounding noise in it into full +-lr steps whose sign depends on the summation order."""
    out = dict(state)
    for k, v in state.items():
        if k.endswith("attn.c_attn.bias"):
            out[k] = torch.cat([v[:n_embd], v[2 * n_embd :]])
    return out


def assert_same_training(got: dict, want: dict, what: str, lr_sum: float, rtol=1e-5, atol=1e-6):
    """Weights of two runs that did the same computation in another summation order (micro-batch
    shapes or compiled kernels pick other float32 kernels, which differ by CPU): every element
    within rtol/atol, except at most 0.1% of a tensor's elements (at least one). Those are
    entries whose gradient is ~0: AdamW's normalised step m / sqrt(v) turns their rounding noise
    into steps of up to lr with an arbitrary sign. Even they stay below lr_sum (the learning
    rates of all steps added up). A wrong batch, scaling or graph moves most elements."""
    for k, v in want.items():
        diff = (got[k] - v).abs()
        outliers = int((diff > atol + rtol * v.abs()).sum())
        assert outliers <= max(1, v.numel() // 1000), f"{k} differs in {outliers} of {v.numel()} elements, {what}"  # fmt: skip
        assert diff.max() < lr_sum, f"{k} differs by {diff.max():.3g} >= {lr_sum}, {what}"


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
    "every, optim",
    [
        (6, []),
        # Muon + AdamW, wsd: the resumed part crosses the decay start (step 6 of 12)
        (4, ["optim.name=muon", "optim.lr_schedule=wsd", "optim.decay_fraction=0.5"]),
    ],
)
def test_resume_equals_uninterrupted_run_bit_for_bit(byte_data, tmp_path, every, optim):
    """Dropout on (RNG matters): stop after step `every`, resume to 12 == straight to 12."""
    common = [
        "train.max_steps=12",
        f"checkpoint.every={every}",
        f"eval.every={every}",
        "eval.sample_every=0",
        "model.dropout=0.1",
        "eval.tokens=1024",
        *optim,
    ]
    full, cut = tmp_path / "full", tmp_path / "cut"
    run(byte_data, full, *common)
    shutil.copytree(full, cut)
    # the crash: nothing after step `every` happened for `cut`
    for later in range(2 * every, 13, every):
        shutil.rmtree(cut / "checkpoints" / f"step_{later:08d}")
    (cut / "checkpoints" / "latest").write_text(f"step_{every:08d}\n")
    summary = run(byte_data, cut, *common)
    assert summary["steps"] == 12
    a, b = weights(full), weights(cut)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    sa = checkpoint.load_state(checkpoint.find(full))
    sb = checkpoint.load_state(checkpoint.find(cut))
    assert sa["data"] == sb["data"]
    for k, v in sa["optimizer"]["state"].items():
        for name, t in v.items():
            assert torch.equal(t, sb["optimizer"]["state"][k][name]), (k, name)
    muon = "momentum_buffer" in sa["optimizer"]["state"]["transformer.h.0.mlp.c_fc.weight"]
    assert muon == bool(optim)
    rows = [json.loads(r) for r in (cut / "metrics.jsonl").read_text().splitlines()]
    full_rows = [json.loads(r) for r in (full / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("lr") for r in rows] == [r.get("lr") for r in full_rows]


def test_half_written_checkpoint_is_invisible(byte_data, tmp_path):
    run_dir = tmp_path / "run"
    run(
        byte_data,
        run_dir,
        "train.max_steps=4",
        "optim.warmup_steps=1",
        "checkpoint.every=2",
        "eval.every=0",
        "eval.sample_every=0",
        "eval.tokens=512",
    )
    # a crash in the middle of writing step 6: its temporary folder exists, `latest` is unchanged
    tmp = run_dir / "checkpoints" / ".tmp-step_00000006"
    tmp.mkdir()
    (tmp / "model.safetensors").write_bytes(b"partial")
    assert checkpoint.latest(run_dir).name == "step_00000004"


def test_resume_none_refuses_to_overwrite(byte_data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run(
        byte_data,
        run_dir,
        "train.max_steps=2",
        "optim.warmup_steps=1",
        "eval.every=0",
        "eval.sample_every=0",
        "eval.tokens=512",
    )
    before = (run_dir / "metrics.jsonl").read_text()
    rc = cli(
        [
            "train",
            "--config",
            DEBUG,
            f"--data.dir={byte_data}",
            f"--run.dir={run_dir}",
            "--checkpoint.resume=none",
        ]
    )
    assert rc == 2 and "checkpoint.resume" in capsys.readouterr().err
    assert (run_dir / "metrics.jsonl").read_text() == before


@pytest.mark.parametrize(
    "override, needle",
    [
        ("--train.total_batch_size=1000", "nearest valid totals"),
        ("--data.dir=/nonexistent/folder", "/nonexistent/folder"),
        ("--model.preset=gpt5", "model.preset"),
        ("--train.dtype=float16", "float16"),
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
    args += [f"--run.dir={run_dir}", "--train.max_steps=100000", "--log.progress=false"]
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


@pytest.mark.parametrize(
    "damaged, how",
    [
        ("model.safetensors", "truncated"),
        ("state.pt", "truncated"),
        ("meta.json", "truncated"),
        ("model.safetensors", "one bit flipped"),  # still a valid file: only the hash can tell
        ("state.pt", "one bit flipped"),
    ],
)
def test_damaged_checkpoint_is_one_line_and_nothing_is_overwritten(
    byte_data, tmp_path, capsys, damaged, how
):
    run_dir = tmp_path / "run"
    run(byte_data, run_dir, "train.max_steps=2", "optim.warmup_steps=1", "eval.every=0", "eval.sample_every=0", "eval.tokens=512")  # fmt: skip
    path = checkpoint.find(run_dir) / damaged
    data = bytearray(path.read_bytes())
    if how == "truncated":  # e.g. by a full disk or a bad copy
        data = data[:40]
    else:  # bit rot in the middle of the tensor data
        data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    rc = cli(["train", "--config", DEBUG, f"--data.dir={byte_data}", f"--run.dir={run_dir}", "--train.max_steps=4", "--optim.warmup_steps=1"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and damaged in err[0], err
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


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


def test_rerunning_a_finished_run_changes_nothing(byte_data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = ["train.max_steps=2", "optim.warmup_steps=1", "eval.every=0", "eval.sample_every=0", "eval.tokens=512"]  # fmt: skip
    run(byte_data, run_dir, *args)
    before = {p: p.read_bytes() for p in (run_dir / "checkpoints").rglob("*") if p.is_file()}
    summary = (run_dir / "summary.json").read_text()
    capsys.readouterr()
    assert run(byte_data, run_dir, *args)["steps"] == 2
    assert "already trained to step 2" in capsys.readouterr().out
    assert (run_dir / "summary.json").read_text() == summary
    assert {
        p: p.read_bytes() for p in (run_dir / "checkpoints").rglob("*") if p.is_file()
    } == before


def test_sigkill_at_any_moment_then_resume_equals_uninterrupted_run(byte_data, tmp_path):
    """A run killed with SIGKILL (no chance to clean up) and started again with the same command
    ends with the uninterrupted run's weights bit for bit, and its metrics hold every step once."""
    common = ["train.max_steps=200", "checkpoint.every=50", "eval.every=0", "eval.sample_every=0"]
    common += ["eval.tokens=512", "eval.sample_tokens=1", "model.dropout=0.1", "log.every=1"]
    run(byte_data, tmp_path / "full", *common)
    crashed = tmp_path / "crashed"
    cmd = [sys.executable, "-m", "gptrain", "train", "--config", DEBUG, f"--data.dir={byte_data}"]
    cmd += [f"--run.dir={crashed}", "--log.progress=false", *(f"--{o}" for o in common)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    metrics_file = crashed / "metrics.jsonl"
    while time.time() < deadline and proc.poll() is None:  # kill between checkpoints 50 and 100
        text = metrics_file.read_text() if metrics_file.is_file() else ""
        if '"step": 70,' in text:
            break
        time.sleep(0.005)
    proc.kill()
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    stopped_at = checkpoint.latest(crashed).name
    logged = [
        json.loads(x)["step"] for x in metrics_file.read_text().splitlines() if x.endswith("}")
    ]
    assert stopped_at == "step_00000050" and max(logged) >= 70  # 20+ steps past the checkpoint
    assert run(byte_data, crashed, *common)["steps"] == 200
    a, b = weights(tmp_path / "full"), weights(crashed)
    for k in a:
        assert torch.equal(a[k], b[k]), (k, stopped_at)
    rows = [json.loads(line) for line in (crashed / "metrics.jsonl").read_text().splitlines()]
    ref = [
        json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in rows] == [r["step"] for r in ref] == list(range(1, 201))
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref]


def test_sigkill_while_a_checkpoint_is_being_written_then_resume_equals_uninterrupted_run(
    byte_data, tmp_path
):
    """The process is frozen (SIGSTOP) the moment a checkpoint's temporary folder appears; when it
    is caught mid-save it is SIGKILLed there. The half-written folder stays invisible, `latest`
    names the previous checkpoint, and the restarted run ends equal to the uninterrupted one."""
    common = ["train.max_steps=30", "checkpoint.every=3", "eval.every=0", "eval.sample_every=0"]
    common += ["eval.tokens=512", "model.dropout=0.1", "log.every=1"]
    run(byte_data, tmp_path / "full", *common)
    crashed = tmp_path / "crashed"
    ckpts = crashed / "checkpoints"
    cmd = [sys.executable, "-m", "gptrain", "train", "--config", DEBUG, f"--data.dir={byte_data}"]
    cmd += [f"--run.dir={crashed}", "--log.progress=false", *(f"--{o}" for o in common)]
    caught = []  # steps whose save was killed half-way
    for _attempt in range(3):
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        seen_tmp = set(ckpts.glob(".tmp-*")) if ckpts.is_dir() else set()
        while proc.poll() is None:
            fresh = set(ckpts.glob(".tmp-*")) - seen_tmp if ckpts.is_dir() else set()
            if not fresh:
                time.sleep(0.0002)
                continue
            proc.send_signal(signal.SIGSTOP)
            tmp = fresh.pop()
            if tmp.exists():  # frozen in the middle of writing this checkpoint
                proc.kill()
                proc.wait(timeout=30)
                step = int(tmp.name.rsplit("_", 1)[1])
                before = checkpoint.latest(crashed)  # None: killed in the very first save
                expected = f"step_{step - 3:08d}" if step > 3 else None
                assert (before.name if before else None) == expected
                caught.append(step)
                break
            seen_tmp.add(tmp)  # it finished before the stop arrived: let it go on
            proc.send_signal(signal.SIGCONT)
        proc.wait(timeout=120)
        if proc.returncode == 0:
            break
    assert run(byte_data, crashed, *common)["steps"] == 30
    a, b = weights(tmp_path / "full"), weights(crashed)
    for k in a:
        assert torch.equal(a[k], b[k]), (k, caught)
    assert len(caught) >= 2, caught
    rows = [json.loads(line) for line in (crashed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 31))  # each step once


def test_killed_between_the_renames_of_a_re_save_resumes(byte_data, tmp_path):
    """Re-saving a step (after resuming from an earlier one) moves the old folder aside, then
    renames the new one in; a kill between the two leaves `latest` naming a moved folder. The
    moved copy is complete, so resume uses it instead of refusing."""
    common = ["train.max_steps=6", "checkpoint.every=3", "eval.every=0", "eval.sample_every=0"]
    common += ["eval.tokens=512", "model.dropout=0.1"]
    full, cut = tmp_path / "full", tmp_path / "cut"
    run(byte_data, full, *common)
    shutil.copytree(full, cut)
    root = cut / "checkpoints"
    os.replace(root / "step_00000006", root / ".old-step_00000006")  # the first rename only
    assert checkpoint.latest(cut) == root / ".old-step_00000006"
    assert run(byte_data, cut, *common)["steps"] == 6  # nothing left to do, no error
    assert checkpoint.latest(cut) == root / ".old-step_00000006"
    assert run(byte_data, cut, *common, "train.max_steps=9")["steps"] == 9  # and it goes on
    assert checkpoint.latest(cut) == root / "step_00000009"


def test_attention_auto_takes_the_measured_kernel_and_an_explicit_one_wins():
    """auto is what training/choices.py measured faster (tested there with a fake timer); an
    explicit sdpa or matmul is used as given."""
    from gptrain.training.build import attention_kernel

    assert attention_kernel("auto", "matmul") == "matmul"
    assert attention_kernel("auto", "sdpa") == "sdpa"
    assert attention_kernel("sdpa", "matmul") == "sdpa"
    assert attention_kernel("matmul", "sdpa") == "matmul"


@pytest.mark.parametrize(
    "first, now, fix",
    [("model.gelu=erf", "model.gelu = 'tanh'", "--model.gelu=erf"), ("model.bias=false", "model.bias = True", "--model.bias=false")],
)  # fmt: skip
def test_resume_with_another_gelu_or_bias_is_refused(byte_data, tmp_path, capsys, first, now, fix):
    """No parameter shape changes with model.gelu: without this check a resume would go on
    silently with another function; with model.bias the tensors would not match. One line, exit
    2, the run directory untouched. The bias-free run's checkpoint has no bias tensors."""
    run_dir = tmp_path / "run"
    common = ["train.max_steps=2", "optim.warmup_steps=1", "eval.every=0", "eval.sample_every=0"]
    common += ["checkpoint.every=2"]
    run(byte_data, run_dir, *common, first)
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    if first == "model.bias=false":
        latest = (run_dir / "checkpoints" / "latest").read_text().strip()
        keys = load_file(run_dir / "checkpoints" / latest / "model.safetensors").keys()
        assert keys and not [k for k in keys if k.endswith(".bias")]
    args = ["train", "--config", DEBUG, f"--data.dir={byte_data}", f"--run.dir={run_dir}"]
    args += [f"--{o}" for o in common] + ["--train.max_steps=4", "--log.progress=false"]
    capsys.readouterr()
    assert cli(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and now in err[0] and fix in err[0]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before

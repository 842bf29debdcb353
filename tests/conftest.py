"""Shared fixtures: the verified test data beside the checkout, and a prepared byte-level corpus."""

import os
import time
from pathlib import Path

import pytest
import torch

# the commands tests start with this process's own environment import gptrain from this checkout,
# as those started with dist_helpers.env() do: one environment, so one zygote (tests/forked.py)
os.environ["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])

# The longest files first (each file runs on one pytest worker: `--dist loadfile`, with
# `--no-loadscope-reorder` keeping this order), so that both workers end together on short files
# instead of one waiting for the other's last long one. GPT-2's compiled run in test_train.py comes
# before the other runs of the same graphs (FSDP2, DDP, time budget), which then find its kernels
# in inductor's cache, and beside the compiled nanochat run, whose kernels are its own. The other
# files follow, those with more tests first. Only the order changes.
FIRST = ["test_nanochat_faults", "test_train", "test_elastic", "test_fsdp", "test_distributed",
         "test_equivalence_matrix", "test_race", "test_model", "test_time_budget", "test_forked",
         "test_finish", "test_resume", "test_hellaswag", "test_watchdog", "test_choices",
         "test_eval_error", "test_attempts", "test_mirror", "test_loss", "test_lock_taken",
         "test_guard", "test_publish_error", "test_muon_dist"]  # fmt: skip


def pytest_collection_modifyitems(items):
    first = {name: i for i, name in enumerate(FIRST)}
    count: dict[str, int] = {}
    for item in items:
        count[item.path.stem] = count.get(item.path.stem, 0) + 1
    items.sort(key=lambda item: (first.get(item.path.stem, len(FIRST)), -count[item.path.stem]))


SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
SHAKESPEARE = SHARED / "tinyshakespeare" / "input.txt"
GPT2_DIR = SHARED / "gpt2"


def bf16_matmul_slowdown() -> float:
    """How many times the CPU time of a 512^3 float32 matmul a bf16 one takes on this CPU: about
    0.5-1 where bf16 is native (AVX512-BF16, AMX), 25-50 where it is emulated (AVX2-only CPUs, or
    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2). One thread's CPU time, not wall time, so
    that other jobs on the machine (or threads spinning while they wait) do not move it. Measured
    once per test process."""
    global _BF16_SLOWDOWN
    if _BF16_SLOWDOWN is None:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        a = torch.randn(512, 512)
        times = {}
        for dtype in (torch.float32, torch.bfloat16):
            x = a.to(dtype)
            x @ x  # warm-up
            best = float("inf")
            for _ in range(3):
                t0 = time.process_time()
                x @ x
                best = min(best, time.process_time() - t0)
            times[dtype] = max(best, 1e-6)
        torch.set_num_threads(threads)
        _BF16_SLOWDOWN = times[torch.bfloat16] / times[torch.float32]
    return _BF16_SLOWDOWN


_BF16_SLOWDOWN: float | None = None


def bf16_is_emulated() -> bool:
    return bf16_matmul_slowdown() > 4


def skip_where_bf16_is_emulated(what: str):
    """For tests whose bf16 training runs are sized for native bf16: on a CPU that emulates it
    (25-50x slower) they would take many minutes, so they are skipped there with the measurement."""
    return pytest.mark.skipif(
        bf16_is_emulated(),
        reason=f"{what}: bf16 is emulated on this CPU (a bf16 matmul takes "
        f"{bf16_matmul_slowdown():.0f}x float32's); runs where bf16 is native",
    )


@pytest.fixture(scope="session")
def shakespeare_txt() -> Path:
    if not SHAKESPEARE.is_file():
        pytest.skip(
            f"verified test data not found at {SHAKESPEARE} (../shared/data beside the checkout)"
        )
    return SHAKESPEARE


@pytest.fixture
def gpt2_env(monkeypatch, tmp_path) -> Path:
    """The GPT-2 tokenizer files of ../shared/data, through GPTRAIN_GPT2_DIR, with a fresh cache."""
    if not (GPT2_DIR / "vocab.bpe").is_file():
        pytest.skip(f"GPT-2 files not found at {GPT2_DIR} (../shared/data beside the checkout)")
    monkeypatch.setenv("GPTRAIN_GPT2_DIR", str(GPT2_DIR))
    monkeypatch.setenv("GPTRAIN_CACHE", str(tmp_path / "cache"))
    return GPT2_DIR


@pytest.fixture(scope="session")
def byte_data(tmp_path_factory, shakespeare_txt) -> Path:
    """tiny shakespeare prepared with the byte tokenizer (90/10 split), shared by the trainer tests."""
    from gptrain.data.prepare import prepare

    out = tmp_path_factory.mktemp("data") / "shakespeare-byte"
    prepare([str(shakespeare_txt)], out, tokenizer="byte", progress=False)
    return out


@pytest.fixture
def one_process_group():
    """A one-process gloo process group for the test (FSDP2 and DDP wrappers need one)."""
    import socket

    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group already exists")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """Two configs to race (test_race.py, test_ladder.py): the debug config, and a copy with a
    higher learning rate."""
    folder = tmp_path_factory.mktemp("configs")
    text = (Path(__file__).resolve().parent.parent / "configs" / "debug.toml").read_text()
    (folder / "debug.toml").write_text(text)
    (folder / "fast.toml").write_text(text.replace("lr = 3e-3", "lr = 1e-2"))
    return [str(folder / "debug.toml"), str(folder / "fast.toml")]

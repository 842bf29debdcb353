"""Shared fixtures: the verified test data beside the checkout, and a prepared byte-level corpus."""

from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
SHAKESPEARE = SHARED / "tinyshakespeare" / "input.txt"
GPT2_DIR = SHARED / "gpt2"


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

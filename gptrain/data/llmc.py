"""llm.c's GPT-2 token shard format (karpathy/llm.c dev/data/data_common.py `write_datafile`).

    offset  size        field
    0       1024        header: 256 little-endian int32; [0] magic 20240520, [1] version 1,
                        [2] token count; the rest zero
    1024    2 x count   the tokens, uint16 little-endian

llm.c's readers (train_gpt2.py's `_peek_data_shard`/`_load_data_shard`, the C dataloader) check
the magic and version, read the count from the header and expect exactly that many tokens after
it. The count is an int32, so one file holds fewer than 2^31 tokens. The same layout with magic
20240801 / version 7 is llm.c's LLaMA-3 format (uint32 tokens), which gptrain does not read.

This module is the format only (no manifest, no gptrain shards): `read_header` validates a file,
`open_tokens` memory-maps its tokens, `write_file` writes one atomically, `scan` hashes a file and
finds its end-of-text tokens in one pass.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from gptrain.errors import UserError

MAGIC = 20240520
VERSION = 1
LLAMA3_MAGIC = 20240801
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4  # 1024
MAX_TOKENS = 2**31 - 1
TOKEN_DTYPE = np.dtype("<u2")
GPT2_VOCAB, GPT2_EOT = 50257, 50256
FIX = "pass llm.c GPT-2 shards (dev/data/fineweb.py output) or text inputs"


def peek_magic(path) -> int | None:
    """The first int32 of a file (None when shorter than 4 bytes)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(4)
    except OSError as e:
        raise UserError(f"cannot read input file {path}: {e.strerror}") from None
    return int.from_bytes(raw, "little", signed=True) if len(raw) == 4 else None


def read_header(path) -> int:
    """The token count of an llm.c GPT-2 shard, after checking magic, version and file size."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(HEADER_BYTES)
    except OSError as e:
        raise UserError(f"cannot read llm.c shard {path}: {e.strerror}") from None
    if len(raw) < HEADER_BYTES:
        raise UserError(
            f"{path}: {size} bytes, shorter than llm.c's {HEADER_BYTES}-byte header: not an llm.c "
            f"shard or a truncated one; {FIX}"
        )
    header = np.frombuffer(raw, dtype="<i4")
    magic, version, count = int(header[0]), int(header[1]), int(header[2])
    if magic == LLAMA3_MAGIC:
        raise UserError(
            f"{path} is an llm.c LLaMA-3 shard (magic {LLAMA3_MAGIC}, uint32 tokens); gptrain "
            f"reads only llm.c GPT-2 shards (magic {MAGIC})"
        )
    if magic != MAGIC:
        raise UserError(
            f"{path}: magic {magic}, expected llm.c's GPT-2 magic {MAGIC}: not an llm.c token "
            f"shard; {FIX}"
        )
    if version != VERSION:
        raise UserError(
            f"{path}: llm.c shard version {version}, gptrain reads version {VERSION}; re-make it "
            f"with llm.c's dev/data scripts"
        )
    if count < 0 or size != HEADER_BYTES + 2 * count:
        have = (size - HEADER_BYTES) / 2
        raise UserError(
            f"{path}: header says {count} tokens, the file holds {have:g} ({size} bytes, expected "
            f"{HEADER_BYTES} + 2 x {count}): truncated or damaged; download or re-make it"
        )
    return count


def open_tokens(path, expected_tokens: int | None = None) -> np.ndarray:
    """Memory-map an llm.c shard's tokens (uint16) after checking its header and count."""
    count = read_header(path)
    if expected_tokens is not None and count != expected_tokens:
        raise UserError(
            f"llm.c shard {path} holds {count} tokens, the manifest says {expected_tokens}; the "
            f"file changed since `gptrain prepare`: prepare again"
        )
    if count == 0:
        return np.zeros(0, dtype=TOKEN_DTYPE)
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r", offset=HEADER_BYTES, shape=(count,))


def header_bytes(count: int) -> bytes:
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = MAGIC, VERSION, count
    return header.tobytes()


def write_file(path, tokens: np.ndarray) -> str:
    """Write `tokens` (ids < 65,536) as an llm.c GPT-2 shard (temporary name, fsync, rename);
    return the file's sha256."""
    path = Path(path)
    if len(tokens) > MAX_TOKENS:
        raise UserError(
            f"{path}: {len(tokens):,} tokens do not fit one llm.c shard (int32 count, at most "
            f"{MAX_TOKENS:,}); prepare with a smaller --shard-tokens"
        )
    sha = hashlib.sha256()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        head = header_bytes(len(tokens))
        f.write(head)
        sha.update(head)
        for start in range(0, len(tokens), 1 << 24):
            block = np.ascontiguousarray(tokens[start : start + (1 << 24)], dtype=TOKEN_DTYPE)
            f.write(memoryview(block).cast("B"))
            sha.update(memoryview(block).cast("B"))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return sha.hexdigest()


def scan(path, eot: int = GPT2_EOT, vocab: int = GPT2_VOCAB) -> tuple[str, np.ndarray]:
    """(sha256 of the whole file, positions of the end-of-text tokens), reading the file once;
    a token id outside the GPT-2 vocabulary is refused."""
    count = read_header(path)
    sha, eots, pos = hashlib.sha256(), [], 0
    with open(path, "rb") as f:
        sha.update(f.read(HEADER_BYTES))
        for raw in iter(lambda: f.read(1 << 24), b""):
            sha.update(raw)
            block = np.frombuffer(raw, dtype=TOKEN_DTYPE)
            if block.size and int(block.max()) >= vocab:
                raise UserError(
                    f"{path}: token id {int(block.max())} >= GPT-2's vocabulary size {vocab}: "
                    f"not GPT-2 tokens; {FIX}"
                )
            eots.append(np.flatnonzero(block == eot) + pos)
            pos += block.size
    if pos != count:
        raise UserError(f"{path} changed while it was read; prepare again")
    return sha.hexdigest(), np.concatenate([np.zeros(0, dtype=np.int64), *eots]).astype(np.int64)

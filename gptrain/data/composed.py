"""Composed shards: a prepared folder whose tokens are written once, in the parts, and whose
shards are ranges of a split's token stream read through that split's span table.

A text prepare tokenizes every work item into a part (`gptrain.data.parts`). The val split and
the seeded shuffle put documents in an order known only once every part exists; rather than copy
every token a second time into shard files, the folder keeps the parts and, per split, a table of
where each piece of text lies in the split's stream:

    parts/part_NNNNNN.tok   a part's tokens as they were written (no header; the manifest's
                            dtype, little-endian; documents back to back, no end-of-text)
    <split>.spans.npy       int64 (4, pieces): stream position, length, part, start in the part,
                            in stream order; the gaps between pieces are end-of-text tokens
    <split>_NNNNNN.docs.npy the document index of shard NNNNNN (as for file shards)

Shard s of a split is the stream's tokens [s * shard_tokens, (s + 1) * shard_tokens): its
manifest entry says "format": "composed", its "start", "tokens" and "spans" file. `Composed`
reads any slice of it, byte for byte what a shard file written from the same stream would hold,
so the loader's windows do not change. Parts are read with pread (nothing memory-mapped, so a
reader's resident memory does not grow with what it has read). The manifest's "parts" list holds
every part's token count and sha256, and each span table's sha256 is in "spans"; `verify` checks
them and that the table only points inside the parts.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import numpy as np

from gptrain.cache import sha256_file
from gptrain.errors import UserError

POS, LEN, PART, START = range(4)


def check_storage_path(manifest_path, where: str, name, absolute_ok: bool = False) -> None:
    """A manifest's storage path names a file inside its folder: relative, without `..` (only an
    llm.c entry may be absolute, where conversion could not hard-link the original)."""
    ok = isinstance(name, str) and name and "\0" not in name
    path = Path(name) if ok else None
    if ok and path.is_absolute():
        ok = absolute_ok
    elif ok:
        ok = ".." not in path.parts
    if not ok:
        raise UserError(
            f"{manifest_path}: {where} = {name!r} is not a path inside the folder (absolute, or "
            f"with '..'); a manifest names only its own folder's files: re-run gptrain prepare"
        )


def check_paths(manifest_path, manifest: dict) -> None:
    """Every storage path of a composed folder's manifest: its parts and span tables."""
    for i, part in enumerate(manifest.get("parts") or []):
        if isinstance(part, dict):
            check_storage_path(manifest_path, f"parts[{i}].file", part.get("file"))
    spans = manifest.get("spans") or {}
    for split, record in spans.items() if isinstance(spans, dict) else ():
        if isinstance(record, dict):
            check_storage_path(manifest_path, f"spans.{split}.file", record.get("file"))


class PartFiles:
    """The parts of one folder, read with pread; at most MAX_OPEN descriptors open at once."""

    MAX_OPEN = 256

    def __init__(self, folder: Path, parts: list[dict], dtype: np.dtype):
        self.folder, self.parts, self.dtype = Path(folder), parts, np.dtype(dtype).newbyteorder("<")
        self.fds: dict[int, int] = {}
        self.pid, self.lock = os.getpid(), threading.Lock()
        for part in parts:  # like a shard's header check: a missing or cut part is found at open
            path = self.folder / part["file"]
            try:
                size = path.stat().st_size
            except OSError as e:
                raise UserError(
                    f"cannot read {path}: {e.strerror}; re-run gptrain prepare"
                ) from None
            if size != int(part["tokens"]) * self.dtype.itemsize:
                raise UserError(
                    f"truncated part {path}: {size} bytes, the manifest says {part['tokens']} tokens; re-run gptrain prepare"
                )

    def read(self, part: int, start: int, n: int) -> np.ndarray:
        # one reader at a time (the loader's prefetch thread and val batches share a Dataset):
        # a descriptor closed by another thread could be reused for another file mid-read
        if self.pid != os.getpid():  # a forked child opens its own descriptors
            self.fds, self.pid, self.lock = {}, os.getpid(), threading.Lock()
        with self.lock:
            return self._read(part, start, n)

    def _read(self, part: int, start: int, n: int) -> np.ndarray:
        fd = self.fds.get(part)
        if fd is None:
            if len(self.fds) >= self.MAX_OPEN:
                os.close(self.fds.pop(next(iter(self.fds))))
            path = self.folder / self.parts[part]["file"]
            try:
                fd = self.fds[part] = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise UserError(
                    f"cannot read {path}: {e.strerror}; re-run gptrain prepare"
                ) from None
        size = self.dtype.itemsize
        raw = os.pread(fd, n * size, start * size)
        if len(raw) != n * size:
            path = self.folder / self.parts[part]["file"]
            raise UserError(f"{path} is shorter than the manifest says; re-run gptrain prepare")
        return np.frombuffer(raw, dtype=self.dtype)

    def close(self) -> None:
        if self.pid == os.getpid():
            with self.lock:
                for fd in self.fds.values():
                    os.close(fd)
        self.fds = {}

    __del__ = close


class Composed:
    """One composed shard: `len()` tokens, sliced like an array (a step of 1) into a new array."""

    def __init__(self, spans: np.ndarray, start: int, tokens: int, files: PartFiles, eot: int):
        self.spans, self.a, self.n, self.files, self.eot = (
            spans,
            int(start),
            int(tokens),
            files,
            eot,
        )
        self.dtype = files.dtype

    def __len__(self) -> int:
        return self.n

    def __array__(self, dtype=None, copy=None):
        out = self[0 : self.n]
        return out if dtype is None else out.astype(dtype)

    def __getitem__(self, key) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("a composed shard is read in slices with step 1")
        lo, hi, _ = key.indices(self.n)
        hi = max(hi, lo)
        out = np.full(hi - lo, self.eot, dtype=self.dtype)
        a, b = self.a + lo, self.a + hi  # stream positions
        pos, length = self.spans[POS], self.spans[LEN]
        k = max(int(np.searchsorted(pos, a, side="right")) - 1, 0)
        end = int(np.searchsorted(pos, b, side="left"))
        for j in range(k, end):
            p, n = int(pos[j]), int(length[j])
            x, y = max(p, a), min(p + n, b)
            if y > x:
                src = int(self.spans[START][j]) + x - p
                out[x - a : y - a] = self.files.read(int(self.spans[PART][j]), src, y - x)
        return out


def load_spans(folder, name: str, expected: str | None = None) -> np.ndarray:
    """A span table, memory-mapped; one line naming the file when it is not one."""
    path = Path(folder) / name
    try:
        spans = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise UserError(f"unreadable span table {path}: {e}; re-run gptrain prepare") from None
    if spans.dtype != np.int64 or spans.ndim != 2 or spans.shape[0] != 4:
        raise UserError(f"span table {path} is not an int64 (4, N) array; re-run gptrain prepare")
    if expected is not None and sha256_file(path) != expected:
        raise UserError(f"hash mismatch for {path}: the file changed, re-run gptrain prepare")
    return spans


def verify(folder, manifest: dict) -> None:
    """Every part's and span table's sha256, spans inside their parts, token ids < vocab."""
    folder, vocab = Path(folder), int(manifest["vocab_size"])
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    for part in manifest.get("parts", []):
        path = folder / part["file"]
        if not path.is_file() or path.stat().st_size != part["tokens"] * dtype.itemsize:
            raise UserError(
                f"{path} is missing or not {part['tokens']} tokens long; re-run gptrain prepare"
            )
        sha, top = hashlib.sha256(), -1
        with open(path, "rb") as f:
            while block := f.read(1 << 25):
                sha.update(block)
                top = max(top, int(np.frombuffer(block, dtype=dtype).max()))
        if sha.hexdigest() != part["sha256"]:
            raise UserError(f"hash mismatch for {path}: the file changed, re-run gptrain prepare")
        if top >= vocab:
            raise UserError(
                f"{path}: token id {top} >= vocabulary size {vocab}; the part was made with another tokenizer"
            )
    sizes = np.array([p["tokens"] for p in manifest.get("parts", [])] + [0], dtype=np.int64)
    for record in manifest.get("spans", {}).values():
        spans = load_spans(folder, record["file"], record["sha256"])
        part, start, length = spans[PART], spans[START], spans[LEN]
        if len(part) and (
            part.min() < 0
            or part.max() >= len(sizes) - 1
            or start.min() < 0
            or length.min() < 0
            or (start + length > sizes[part]).any()
            or (np.diff(spans[POS]) < length[:-1]).any()
        ):
            raise UserError(
                f"span table {folder / record['file']} points outside its parts; re-run gptrain prepare"
            )

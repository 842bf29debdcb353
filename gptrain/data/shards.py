"""Token shard files and the manifest.json beside them.

A shard is a fixed 64-byte little-endian header followed by the tokens:

    offset  size  field
    0       8     MAGIC b"GPTRSHRD"
    8       4     VERSION (uint32)
    12      4     bytes per token: 2 (uint16) or 4 (uint32, when the vocabulary is > 65,535)
    16      8     token count (uint64)
    24      32    tokenizer hash (raw sha256 digest of the tokenizer identity's "hash")
    56      8     reserved, zero

`open_shard` checks the header and that the file holds exactly `count` tokens, then memory-maps
the tokens (nothing is read up front). A manifest entry with "format": "llmc" is an llm.c GPT-2
shard taken as it is (`gptrain.data.llmc`; its "file" is relative to the folder, or absolute when
the original could not be hard-linked); `open_entry` opens either kind. An entry's "index" names
its document index: `<shard>.docs.npy`, int64 positions (inside the shard) where a document
starts, i.e. the token after each end-of-text separator (and 0 when the split's first document
starts there), with its sha256. An entry with "format": "composed" is a range of a split's token stream read
from the folder's parts (`gptrain.data.composed`); `open_entries` opens every entry of a
manifest. `verify_dir` checks every shard's (and index's) sha256 against the manifest and that
every token id is inside the vocabulary.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np

from gptrain.cache import sha256_file
from gptrain.data import composed, llmc
from gptrain.errors import UserError

MAGIC = b"GPTRSHRD"
VERSION = 1
HEADER = struct.Struct("<8sIIQ32s8x")
HEADER_SIZE = HEADER.size  # 64
MANIFEST = "manifest.json"


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 65_535 else np.dtype(np.uint32)


def write_shard(
    path, tokens: np.ndarray, tokenizer_hash: str, vocab_size: int | None = None
) -> dict:
    """Write `tokens` as a shard (temporary name, fsync, rename); return its manifest entry."""
    path = Path(path)
    tokens = np.asarray(tokens)
    if vocab_size is None:
        vocab_size = int(tokens.max()) + 1 if tokens.size else 1
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) >= vocab_size):
        raise UserError(
            f"{path}: token id {int(tokens.max())} is outside the vocabulary (size {vocab_size})"
        )
    dtype = dtype_for_vocab(vocab_size)
    data = tokens.astype(dtype.newbyteorder("<"), copy=False)
    header = HEADER.pack(MAGIC, VERSION, dtype.itemsize, data.size, bytes.fromhex(tokenizer_hash))
    sha = hashlib.sha256(header)
    sha.update(memoryview(np.ascontiguousarray(data)).cast("B"))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(header)
        np.ascontiguousarray(data).tofile(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return {"file": path.name, "tokens": int(data.size), "sha256": sha.hexdigest()}


def read_header(path) -> tuple[int, int, str]:
    """(bytes per token, token count, tokenizer hash) after checking magic, version and size."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(HEADER_SIZE)
    except OSError as e:
        raise UserError(f"cannot read shard {path}: {e.strerror}; re-run gptrain prepare") from None
    if len(raw) < HEADER_SIZE:
        raise UserError(
            f"truncated shard {path}: {size} bytes, shorter than the {HEADER_SIZE}-byte header; re-run gptrain prepare"
        )
    magic, version, itemsize, count, tok_hash = HEADER.unpack(raw)
    if magic != MAGIC:
        raise UserError(f"bad magic in {path}: {magic!r}, expected {MAGIC!r}; not a gptrain shard")
    if version != VERSION:
        raise UserError(
            f"shard {path} has format version {version}; this gptrain reads version {VERSION}"
        )
    if itemsize not in (2, 4):
        raise UserError(f"shard {path} has {itemsize} bytes per token; allowed: 2 or 4")
    if size != HEADER_SIZE + count * itemsize:
        have = (size - HEADER_SIZE) / itemsize
        raise UserError(
            f"truncated shard {path}: header says {count} tokens, file holds {have:g}; re-run gptrain prepare"
        )
    return itemsize, count, tok_hash.hex()


def open_shard(
    path, expected_tokens: int | None = None, tokenizer_hash: str | None = None
) -> np.memmap:
    """Memory-map a shard's tokens after checking its header (and, if given, count and tokenizer)."""
    itemsize, count, tok_hash = read_header(path)
    if expected_tokens is not None and count != expected_tokens:
        raise UserError(
            f"shard {path} holds {count} tokens, the manifest says {expected_tokens}; re-run gptrain prepare"
        )
    if tokenizer_hash is not None and tok_hash != tokenizer_hash:
        raise UserError(
            f"shard {path} was made with tokenizer {tok_hash[:12]}, the manifest says {tokenizer_hash[:12]}"
        )
    dtype = np.dtype("<u2" if itemsize == 2 else "<u4")
    if count == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=HEADER_SIZE, shape=(count,))


def open_entry(folder, entry: dict, tokenizer_hash: str | None = None) -> np.ndarray:
    """The tokens of a manifest entry: a gptrain shard or an llm.c shard, memory-mapped."""
    path = Path(folder) / entry["file"]  # an absolute "file" stays absolute
    if entry.get("format", "gptrain") == "llmc":
        return llmc.open_tokens(path, entry["tokens"])
    return open_shard(path, entry["tokens"], tokenizer_hash)


def open_entries(folder, manifest: dict) -> list:
    """The tokens of every manifest entry, in order: file shards memory-mapped, composed shards
    (`gptrain.data.composed`) sharing one reader of the parts and one span table per split."""
    tok_hash, files, spans, out = manifest["tokenizer"]["hash"], None, {}, []
    for entry in manifest["shards"]:
        if entry.get("format") != "composed":
            out.append(open_entry(folder, entry, tok_hash))
            continue
        try:
            if files is None:
                files = composed.PartFiles(folder, manifest["parts"], np.dtype(manifest["dtype"]))
            if entry["spans"] not in spans:
                spans[entry["spans"]] = composed.load_spans(folder, entry["spans"])
            table = spans[entry["spans"]]
            end = int(table[0][-1] + table[1][-1]) if table.shape[1] else 0
            if not 0 <= int(entry["start"]) <= int(entry["start"]) + int(entry["tokens"]) <= end:
                raise ValueError(f"shard {entry['file']} lies outside its span table")
            out.append(
                composed.Composed(
                    table, entry["start"], entry["tokens"], files, int(manifest["eot_id"])
                )
            )
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(
                f"{Path(folder) / MANIFEST}: malformed composed shard entry ({e}); re-run gptrain prepare"
            ) from None
    return out


def write_index(path, starts: np.ndarray) -> dict:
    """Save a shard's document starts as .npy (no pickle); return the manifest's "index" entry."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        np.save(f, np.asarray(starts, dtype=np.int64), allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return {"file": path.name, "documents": int(len(starts)), "sha256": sha256_file(path)}


def read_index(folder, entry: dict) -> np.ndarray | None:
    """A shard's document starts (int64), or None for a folder prepared before the index."""
    index = entry.get("index")
    if not index:
        return None
    path = Path(folder) / index["file"]
    try:
        starts = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise UserError(f"unreadable document index {path}: {e}; re-run gptrain prepare") from None
    if starts.dtype != np.int64 or starts.ndim != 1 or len(starts) != index["documents"]:
        raise UserError(
            f"document index {path} does not match the manifest; re-run gptrain prepare"
        )
    return starts


def write_manifest(folder, manifest: dict) -> None:
    path = Path(folder) / MANIFEST
    tmp = path.with_name(f".{MANIFEST}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(folder) -> dict:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise UserError(
            f"no {MANIFEST} in {folder}; make the folder with `gptrain prepare --input ... --out {folder}`"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"unreadable {path}: {e}; re-run gptrain prepare") from None
    for key in ("tokenizer", "vocab_size", "eot_id", "shards"):
        if key not in manifest:
            raise UserError(f"{path} lacks key {key!r}; re-run gptrain prepare")
    check_paths(path, manifest)
    return manifest


def check_paths(path: Path, manifest: dict) -> None:
    """Every storage path in the manifest stays inside the folder: relative, no `..`. Only an
    llm.c entry's "file" may be absolute (conversion names the original where it cannot link)."""
    for i, entry in enumerate(manifest["shards"] if isinstance(manifest["shards"], list) else []):
        if not isinstance(entry, dict):
            continue
        llmc_entry = entry.get("format") == "llmc"
        composed.check_storage_path(path, f"shards[{i}].file", entry.get("file"), llmc_entry)
        if entry.get("format") == "composed":
            composed.check_storage_path(path, f"shards[{i}].spans", entry.get("spans"))
        if isinstance(entry.get("index"), dict):
            composed.check_storage_path(path, f"shards[{i}].index.file", entry["index"].get("file"))
    composed.check_paths(path, manifest)


def verify_dir(folder) -> None:
    """Check every shard of a prepared folder: header, count, sha256, token ids < vocab size (a
    composed folder: its parts and span tables, `gptrain.data.composed.verify`)."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    vocab = int(manifest["vocab_size"])
    if "parts" in manifest:
        composed.verify(folder, manifest)
    for entry, tokens in zip(manifest["shards"], open_entries(folder, manifest), strict=True):
        path = folder / entry["file"]
        files = [] if entry.get("format") == "composed" else [(path, entry["sha256"])]
        if entry.get("index"):
            files.append((folder / entry["index"]["file"], entry["index"]["sha256"]))
        for file, want in files:
            if not file.is_file():
                raise UserError(f"{file} listed in the manifest is missing; re-run gptrain prepare")
            got = sha256_file(file)
            if got != want:
                raise UserError(
                    f"hash mismatch for {file}: sha256 {got[:16]}..., manifest says {want[:16]}...; the file changed, re-run gptrain prepare"
                )
        starts = read_index(folder, entry)
        if starts is not None and len(starts) and (starts.min() < 0 or starts.max() >= len(tokens)):
            raise UserError(
                f"document index of {path} points outside the shard; re-run gptrain prepare"
            )
        if entry.get("format") == "composed":
            continue  # its token ids were checked in the parts
        for start in range(0, len(tokens), 1 << 24):
            top = int(tokens[start : start + (1 << 24)].max())
            if top >= vocab:
                raise UserError(
                    f"shard {path}: token id {top} >= vocabulary size {vocab}; the shard was made with another tokenizer"
                )

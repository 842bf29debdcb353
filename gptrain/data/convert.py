"""llm.c GPT-2 shards in and out of prepared folders.

In (`import_llmc`): each llm.c shard becomes one shard of the prepared folder, its tokens taken as
they are. Nothing is copied: the file is hard-linked into the folder when it can be (same file
system), else the manifest points at the original by its absolute path. Either way the manifest
records its sha256 (checked by `gptrain prepare --verify`); opening checks its header and size.
The document index is found by reading the tokens once (with the hash): a document starts after
each end-of-text token (llm.c puts one before every document), and at 0 in the split's first
shard unless it begins with one.

Out (`export_llmc`): every shard of a prepared GPT-2 folder written as an llm.c shard, in order,
`train_NNNNNN.bin` and `val_NNNNNN.bin`, readable by llm.c's loaders (same header layout).
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from gptrain.data import llmc
from gptrain.data.shards import open_entries, read_manifest, write_index
from gptrain.data.tokenizers import GPT2_TIKTOKEN_SHA256
from gptrain.errors import UserError

GPT2_IDENTITY = {
    "name": "gpt2",
    "vocab_size": llmc.GPT2_VOCAB,
    "eot_id": llmc.GPT2_EOT,
    "hash": GPT2_TIKTOKEN_SHA256,
}


def _place(src: Path, dst: Path) -> str:
    """Hard-link src as dst (no copy); where that is impossible, the absolute path of src."""
    try:
        os.link(src, dst)
        return dst.name
    except OSError:
        return str(src.resolve())


def _scan(name: str) -> tuple[int, str, np.ndarray]:
    count = llmc.read_header(name)
    return (count, *llmc.scan(name))


def import_split(split: str, files: list[str], folder: Path) -> tuple[list[dict], int]:
    """Manifest entries for one split's llm.c shards (in the given order), and its documents.
    The files are read (hashed, end-of-text found) by a few threads at once: hashing and NumPy
    release the GIL, and 20 GB is disk-bound."""
    for name in files:
        llmc.read_header(name)  # every header checked before any long read
    with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1, len(files)))) as pool:
        scans = list(pool.map(_scan, files))
    entries, carry, documents = [], True, 0
    for i, (name, (count, sha, eots)) in enumerate(zip(files, scans, strict=True)):
        src = Path(name)
        starts = eots + 1
        starts = starts[starts < count]
        if carry and count and (len(eots) == 0 or eots[0] != 0):
            starts = np.concatenate([[0], starts]).astype(np.int64)
        if count:
            carry = bool(len(eots) and eots[-1] == count - 1)
        target = f"{split}_{i:06d}.bin"
        entry = {
            "file": _place(src, folder / target),
            "format": "llmc",
            "source": str(src.resolve()),
            "tokens": count,
            "sha256": sha,
            "split": split,
            "index": write_index(folder / f"{split}_{i:06d}.docs.npy", starts),
        }
        entries.append(entry)
        documents += len(starts)
    if sum(e["tokens"] for e in entries) == 0:
        raise UserError(f"the llm.c {split} shards ({', '.join(files)}) hold no tokens")
    return entries, documents


def import_llmc(train_files: list[str], val_files: list[str], folder: Path, tokenizer) -> dict:
    """The manifest fields of a folder whose shards are llm.c shards taken as they are."""
    if tokenizer not in (None, "gpt2"):
        raise UserError(
            f"--tokenizer {tokenizer}: llm.c shards hold GPT-2 tokens; drop --tokenizer or pass "
            "--tokenizer gpt2"
        )
    if not val_files:
        raise UserError(
            "llm.c shards need their validation shards too: pass --val-input 'DIR/*val*.bin' "
            "(llm.c's fineweb.py writes the val split as the first shard)"
        )
    train, n_train = import_split("train", train_files, folder)
    val, n_val = import_split("val", val_files, folder)
    return {
        "tokenizer": dict(GPT2_IDENTITY),
        "vocab_size": llmc.GPT2_VOCAB,
        "eot_id": llmc.GPT2_EOT,
        "dtype": "uint16",
        "splits": {
            "train": {"tokens": sum(e["tokens"] for e in train), "documents": n_train},
            "val": {"tokens": sum(e["tokens"] for e in val), "documents": n_val},
        },
        "documents": n_train + n_val,
        "shards": train + val,
        "source_format": "llmc",
        "shuffle": None,  # taken as they are: the loader still permutes shards and windows
    }


def export_llmc(src, out) -> list[dict]:
    """Write the shards of prepared GPT-2 folder `src` into new folder `out` as llm.c shards."""
    src, out = Path(src), Path(out)
    manifest = read_manifest(src)
    tok = manifest["tokenizer"]
    if tok.get("name") != "gpt2" or tok.get("hash") != GPT2_TIKTOKEN_SHA256:
        raise UserError(
            f"--export-llmc {src}: made with tokenizer {tok.get('name')!r}; llm.c shards hold "
            "GPT-2 tokens: prepare the text with --tokenizer gpt2 first"
        )
    if out.exists() and any(out.iterdir()):
        raise UserError(
            f"--out {out} already exists and is not empty; delete it or choose another folder"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    written, index = [], {"train": 0, "val": 0}
    try:
        for entry, tokens in zip(manifest["shards"], open_entries(src, manifest), strict=True):
            split = entry["split"]
            name = f"{split}_{index[split]:06d}.bin"
            index[split] += 1
            sha = llmc.write_file(tmp / name, tokens)
            written.append({"file": name, "tokens": int(len(tokens)), "sha256": sha})
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
        return written
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

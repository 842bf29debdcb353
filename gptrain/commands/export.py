"""`gptrain export`: a trained run as a Hugging Face folder that transformers loads as it is.

    gptrain export --run runs/default --out exports/default            # the latest checkpoint
    gptrain export --run runs/default --out exports/step100 --step 100

    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained("exports/default")
    tokenizer = AutoTokenizer.from_pretrained("exports/default")

The folder holds config.json and model.safetensors of the run's block: GPT2Config and HF's key
names and Conv1D layout for gpt2 (GPT2LMHeadModel), NanoChatConfig and its key names for
nanochat (NanoChatForCausalLM, untied head), the vocabulary unpadded (gptrain/model/hf.py,
hf_nanochat.py); and the run's tokenizer as a fast tokenizer: tokenizer.json +
tokenizer_config.json. Every tokenizer gptrain trains with has an exact HF equivalent:
  * byte: byte-level BPE with the 256 bytes as ids 0-255, no merges, end-of-text 256;
  * gpt2: the vocabulary and merges rebuilt from the mergeable ranks (tiktoken's form);
  * bpe: the run's own tokenizer.json, copied.
As in transformers' own GPT-2 tokenizer, the literal text `<|endoftext|>` encodes to the
end-of-text id (gptrain's byte and GPT-2 tokenizers read it as plain text); all other text encodes
to the same ids (tested on all of tiny shakespeare for GPT-2).
The folder is written under a temporary name and renamed into place; an existing --out is refused.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from gptrain.data.tokenizers import EOT_TEXT, Tokenizer, byte_level_alphabet
from gptrain.errors import ArgParser, UserError


def _byte_chars() -> list[str]:
    """GPT-2's printable stand-in character for each byte value 0..255."""
    chars = [""] * 256
    for ch, b in byte_level_alphabet().items():
        chars[b] = ch
    return chars


def bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merges (in priority order) under which HF's BPE reproduces ranked-BPE (tiktoken).

    tiktoken repeatedly joins the adjacent pair whose concatenation has the lowest rank; HF's BPE
    the pair listed first. So the merges list, token by token in rank order, every split of the
    token into two tokens (tests check the result against tiktoken on all of tiny shakespeare).
    """
    merges = []
    for token in sorted(ranks, key=ranks.__getitem__):
        splits = [(token[:i], token[i:]) for i in range(1, len(token))]
        splits = [(a, b) for a, b in splits if a in ranks and b in ranks]
        merges += sorted(splits, key=lambda ab: (ranks[ab[0]], ranks[ab[1]]))
    return merges


def _byte_level_tokenizer(vocab: dict[str, int], merges: list[tuple[str, str]], eot_id: int):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(EOT_TEXT, special=True, normalized=False)])
    if tok.token_to_id(EOT_TEXT) != eot_id:
        raise ValueError(f"{EOT_TEXT} got id {tok.token_to_id(EOT_TEXT)}, expected {eot_id}")
    return tok


def hf_tokenizer_json(tokenizer: Tokenizer) -> str:
    """tokenizer.json (HF `tokenizers` format) encoding exactly as the run's tokenizer does."""
    if tokenizer.name == "bpe":
        return Path(tokenizer.identity()["path"]).read_text(encoding="utf-8")
    chars = _byte_chars()
    if tokenizer.name == "byte":
        vocab = {chars[b]: b for b in range(256)} | {EOT_TEXT: tokenizer.eot_id}
        return _byte_level_tokenizer(vocab, [], tokenizer.eot_id).to_str()
    if tokenizer.name == "gpt2":
        ranks = {
            tokenizer.decode_bytes([i]): i
            for i in range(tokenizer.vocab_size)
            if i != tokenizer.eot_id
        }

        def text(b: bytes) -> str:
            return "".join(chars[x] for x in b)

        vocab = {text(t): i for t, i in ranks.items()} | {EOT_TEXT: tokenizer.eot_id}
        merges = [(text(a), text(b)) for a, b in bpe_merges(ranks)]
        return _byte_level_tokenizer(vocab, merges, tokenizer.eot_id).to_str()
    raise UserError(f"tokenizer {tokenizer.name!r} has no Hugging Face export")


HF_MODULES = {"gpt2": "gptrain.model.hf", "nanochat": "gptrain.model.hf_nanochat"}
HF_NAMES = {"gpt2": "GPT-2", "nanochat": "NanoChat"}


def hf_module(arch: str):
    """The module that maps the `arch` block to its transformers class (hf_config_dict,
    to_hf_state_dict)."""
    import importlib

    return importlib.import_module(HF_MODULES[arch])


def export_hf(run_dir: str | Path, out: str | Path, step: int | None = None) -> Path:
    """Write the run's checkpoint (latest, or `step`) as a Hugging Face folder at `out`."""
    from safetensors.torch import save_file

    from gptrain.evals.generate import load_model

    out = Path(out)
    if out.exists():
        raise UserError(f"--out {out} already exists; choose a new folder (nothing is overwritten)")
    model, tokenizer, meta = load_model(run_dir, step)
    hf = hf_module(model.arch)
    try:
        config = hf.hf_config_dict(model.config, tokenizer.eot_id)
    except ValueError as e:
        raise UserError(f"cannot export {run_dir}: {e}") from None
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_file(hf.to_hf_state_dict(model), str(tmp / "model.safetensors"), {"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "tokenizer.json").write_text(hf_tokenizer_json(tokenizer), encoding="utf-8")
        tok_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": EOT_TEXT,
            "eos_token": EOT_TEXT,
            "unk_token": EOT_TEXT,
            "model_max_length": model.config.block_size,
            "clean_up_tokenization_spaces": False,
        }
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
        source = {
            "run": str(Path(run_dir).resolve()),
            "step": meta.get("step"),
            "tokenizer": tokenizer.identity(),
        }
        (tmp / "gptrain_export.json").write_text(json.dumps(source, indent=2) + "\n")
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str]) -> int:
    p = ArgParser(prog="gptrain export", description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="run directory (holds checkpoints/)")
    p.add_argument("--out", required=True, help="folder to create (must not exist)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    a = p.parse_args(argv)
    out = export_hf(a.run, a.out, a.step)
    name = HF_NAMES.get(json.loads((out / "config.json").read_text()).get("model_type"), "")
    print(
        f"wrote {out}: config.json, model.safetensors, tokenizer.json (Hugging Face {name} format)"
    )
    return 0

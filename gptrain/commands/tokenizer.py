"""`gptrain tokenizer train`: a byte-level BPE tokenizer trained on your text.

gptrain tokenizer train --input 'texts/*.txt' --vocab-size 8192 --out tok.json
"""

from __future__ import annotations

from gptrain.data.sources import iter_documents
from gptrain.data.tokenizers import EOT_TEXT, train_bpe
from gptrain.errors import ArgParser


def main(argv) -> int:
    """`gptrain tokenizer train --input ... --vocab-size N --out tok.json`."""
    parser = ArgParser(prog="gptrain tokenizer", description="Train a byte-level BPE tokenizer.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    train = sub.add_parser("train", help="train a byte-level BPE on text")
    train.add_argument(
        "--input", nargs="+", required=True, help="files, folders, globs or a built-in corpus"
    )
    train.add_argument("--vocab-size", type=int, required=True)
    train.add_argument("--out", required=True, help="tokenizer.json to write")
    train.add_argument("--text-field", default="text", help="JSON key of the text in .jsonl input")
    args = parser.parse_args(argv)
    docs = (doc.text for doc in iter_documents(args.input, args.text_field))
    tok = train_bpe(docs, args.vocab_size, args.out)
    print(
        f"wrote {args.out}: vocab {tok.vocab_size}, {EOT_TEXT} id {tok.eot_id}, sha256 {tok.hash[:12]}"
    )
    return 0

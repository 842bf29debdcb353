"""Cutting long texts where GPT-2-style pre-tokenization always splits (`split_points`: at a
newline that follows a non-space character), so tokenizing the pieces gives the tokens of the
whole text; `gptrain prepare`'s workers (`gptrain.data.parts`) use it.
"""

from __future__ import annotations

CHUNK_CHARS = 1 << 17


def split_points(text: str, chunk: int | None = None) -> list[int]:
    """Cut positions ~chunk apart, each at a "\\n" right after a non-space character."""
    chunk = chunk or CHUNK_CHARS
    cuts, pos = [], chunk
    while pos < len(text):
        p = text.find("\n", pos)
        while p != -1 and text[p - 1].isspace():
            p = text.find("\n", p + 1)
        if p == -1:
            break
        cuts.append(p)
        pos = p + chunk
    return cuts

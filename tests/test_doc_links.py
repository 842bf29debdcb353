"""Every relative link in README.md, docs/*.md and benchmarks/**/*.md leads somewhere: the file
exists and, for a Markdown target, the #anchor is one of its headings (GitHub's rule: lowercase,
punctuation dropped, spaces to hyphens, a repeated heading numbered -1, -2, ...) or an explicit
`<a id="...">`. The checker itself is tested on a small fixture with links planted broken."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
EXPLICIT = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks and indented code, with inline code removed."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            continue
        out.append(re.sub(r"`[^`]*`", "", line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text only
    text = re.sub(r"[^\w\- ]", "", text)  # punctuation (backticks, quotes, +, /, ...) dropped
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    found, seen = set(), {}
    text = path.read_text()
    found.update(EXPLICIT.findall(text))
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken_links(files: list[Path], root: Path) -> list[str]:
    """'file: target (why)' for each relative link that leads nowhere."""
    broken = []
    for path in files:
        for line in prose_lines(path.read_text()):
            for target in LINK.findall(line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                file_part, _, anchor = target.partition("#")
                dest = (path.parent / file_part).resolve() if file_part else path
                where = f"{path.relative_to(root)}: {target}"
                if not dest.exists():
                    broken.append(f"{where} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    broken.append(f"{where} (no such anchor)")
    return broken


def doc_files(root: Path) -> list[Path]:
    return [
        root / "README.md",
        *sorted((root / "docs").glob("*.md")),
        *sorted((root / "benchmarks").rglob("*.md")),
    ]


def test_every_link_in_the_docs_leads_somewhere():
    files = doc_files(REPO)
    assert len(files) >= 10, files  # the docs were found: a moved folder would check nothing
    broken = broken_links(files, REPO)
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_slugs_follow_githubs_rule():
    assert slug("Checkpoint I/O") == "checkpoint-io"
    assert slug("The recipe: Muon + wsd against llm.c's") == "the-recipe-muon--wsd-against-llmcs"
    assert slug("`gptrain prepare` at scale") == "gptrain-prepare-at-scale"
    assert slug("Exit codes, the restart ledger, crash loops") == (
        "exit-codes-the-restart-ledger-crash-loops"
    )
    assert slug("Where do I add ...") == "where-do-i-add-"
    assert slug("speed_choices and Muon's step") == "speed_choices-and-muons-step"


def test_the_checker_finds_links_planted_broken(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md#the-loss-path) [ok](docs/a.md) [web](https://example.com/x.md#nope)\n"
        "[gone](docs/missing.md) [bad](docs/a.md#no-such-heading)\n"
        "```\n[in a code block](docs/missing.md)\n```\n"
        "`[inline code](docs/missing.md)`\n"
    )
    (tmp_path / "docs" / "a.md").write_text(
        '# A\n\n## The loss path\n\n## Twice\n\n## Twice\n\n<a id="explicit-one"></a>\n'
        "[self](#twice-1) [self](#explicit-one) [up](../README.md) [bad self](#twice-2)\n"
        "[results](../benchmarks/results/x.md#gpu)\n"
    )
    (tmp_path / "benchmarks" / "results" / "x.md").write_text(
        "# X\n\n## GPU\n\n[back](../../docs/a.md#a) [bad](../../docs/a.md#gpu)\n"
    )
    broken = broken_links(doc_files(tmp_path), tmp_path)
    assert sorted(broken) == sorted(
        [
            "README.md: docs/missing.md (no such file)",
            "README.md: docs/a.md#no-such-heading (no such anchor)",
            "docs/a.md: #twice-2 (no such anchor)",
            "benchmarks/results/x.md: ../../docs/a.md#gpu (no such anchor)",
        ]
    ), broken


def test_the_checker_finds_a_link_broken_in_a_copy_of_the_real_docs(tmp_path):
    """The real pages copied (only the Markdown: a link to another file of the checkout counts as
    broken in the copy from the start); one heading renamed and one page removed in the copy add
    exactly the links that pointed at them."""
    for path in doc_files(REPO):
        dest = tmp_path / path.relative_to(REPO)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(path.read_text())
    before = set(broken_links(doc_files(tmp_path), tmp_path))
    resume = tmp_path / "docs" / "resume.md"
    resume.write_text(resume.read_text().replace("## Preemption\n", "## Signals\n"))
    (tmp_path / "docs" / "huggingface.md").unlink()
    added = set(broken_links(doc_files(tmp_path), tmp_path)) - before
    assert any("resume.md#preemption (no such anchor)" in b for b in added), added
    assert any("huggingface.md (no such file)" in b for b in added), added
    assert all("#preemption" in b or "huggingface.md" in b for b in added), added

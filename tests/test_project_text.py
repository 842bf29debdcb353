"""The repository's own size and wording rules, checked on every file git tracks: the project
speaks only of itself (no development sessions, issue numbers or commit hashes), the README is a
front door, the loop and every function stay short, and `ruff format` applies almost everywhere."""

import ast
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
HISTORY = re.compile(r"\bsessions? [0-9]|\bissues? #?[0-9]", re.IGNORECASE)
# a commit hash: 7-40 lowercase hex characters with at least one letter and one digit
HASH = re.compile(
    r"(?<![0-9a-zA-Z_.])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![0-9a-zA-Z_]|\.[0-9])"
)
TEXT = (".py", ".md", ".toml", ".sh", ".txt", ".cfg", ".yml", ".yaml", "")


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("git is not installed")
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return [REPO / f for f in out.stdout.splitlines() if Path(f).suffix in TEXT]


def functions(tree):
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def test_no_development_history_in_the_repository():
    found = []
    for path in tracked_files():
        if not path.is_file():
            continue
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if HISTORY.search(line) or HASH.search(line):
                found.append(f"{path.relative_to(REPO)}:{i}: {line.strip()[:100]}")
    assert not found, "history or commit hashes:\n" + "\n".join(found)


def test_the_checks_find_what_they_look_for():
    # the examples are assembled so that this file itself holds no match
    assert HISTORY.search("measured in Ses" + "sion 22") and HISTORY.search("see iss" + "ue #37")
    assert HASH.search("before 5617" + "f7e the loop") and HASH.search("at e61c" + "e64.")
    assert not HASH.search("magic 20240520") and not HASH.search("deadbeef")
    assert not HASH.search("sha256 " + "ab12" * 16)


def test_readme_is_a_front_door():
    assert len((REPO / "README.md").read_text().splitlines()) <= 200


def test_the_training_loop_and_every_function_stay_short():
    long = []
    for path in sorted((REPO / "gptrain").rglob("*.py")):
        for fn in functions(ast.parse(path.read_text())):
            n = fn.end_lineno - fn.lineno + 1
            limit = 60 if (path.name, fn.name) == ("train.py", "_train") else 80
            if n > limit:
                long.append(f"{path.relative_to(REPO)}:{fn.lineno} {fn.name}: {n} > {limit} lines")
    assert not long, "\n".join(long)


def test_dataclasses_outside_config_have_at_most_16_fields():
    big = []
    for path in sorted((REPO / "gptrain").rglob("*.py")):
        if path.parent.name == "config":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                "dataclass" in ast.unparse(d) for d in node.decorator_list
            ):
                fields = sum(isinstance(b, ast.AnnAssign) for b in node.body)
                if fields > 16:
                    big.append(f"{path.relative_to(REPO)} {node.name}: {fields} fields")
    assert not big, "\n".join(big)


def test_ruff_format_applies_almost_everywhere():
    skips = sum(p.read_text().count("# fmt: skip") for p in (REPO / "gptrain").rglob("*.py"))
    assert skips <= 20, f"{skips} lines of gptrain/ carry '# fmt: skip' (at most 20)"

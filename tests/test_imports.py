"""The package's imports run one way (docs/architecture.md): read with `ast`, every import of a
gptrain module (top-level or inside a function) must point to its own folder or to a layer below,
and no module may reach itself through a chain of imports (no circles)."""

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gptrain"

# The rules, in one table: layer -> the folders (or ground files) in it. A module may import from
# its own folder and from any lower layer; never from its own layer's other folders or from above.
LAYERS = [
    {"errors", "cache"},  # ground files
    {"config"},
    {"model", "data", "logs"},
    {"distributed"},
    {"checkpoint"},
    {"evals"},
    {"training"},
    {"commands", "__main__"},
]
# model/ is torch only: of gptrain it may import only itself and the ground file errors.py.
MODEL_MAY_IMPORT = {"model", "errors"}


def unit(module: str) -> str:
    """gptrain.data.loader -> data; gptrain.errors -> errors; gptrain -> '' (the package)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer(u: str) -> int:
    for i, names in enumerate(LAYERS):
        if u in names:
            return i
    raise AssertionError(f"{u!r} is in no layer of the table in tests/test_imports.py")


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    """Every gptrain module `path` imports ('from gptrain.x import y' counts y when it is a
    module, else gptrain.x)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("gptrain")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gptrain"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                is_module = (PACKAGE.parent / (sub.replace(".", "/") + ".py")).is_file() or (
                    PACKAGE.parent / sub.replace(".", "/") / "__init__.py"
                ).is_file()
                found.add(sub if is_module else node.module)
    return found


def graph() -> dict[str, set[str]]:
    return {module_name(p): imports_of(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_import_points_down_or_within_its_folder():
    wrong = []
    for mod, deps in graph().items():
        me = unit(mod)
        if not me:
            continue  # gptrain/__init__.py
        for dep in deps:
            them = unit(dep)
            if not them or them == me:
                continue
            if me == "model" and them not in MODEL_MAY_IMPORT:
                wrong.append(f"{mod} -> {dep} (model/ imports only torch and gptrain.errors)")
            elif layer(them) >= layer(me):
                wrong.append(
                    f"{mod} -> {dep} (layer {layer(me)} may not import layer {layer(them)})"
                )
    assert not wrong, "\n".join(wrong)


def test_no_import_circles():
    g = graph()
    circles = []

    def visit(mod, path, on_path, done):
        if mod in on_path:
            circles.append(" -> ".join(path[path.index(mod) :] + [mod]))
            return
        if mod in done:
            return
        on_path.add(mod)
        for dep in sorted(g.get(mod, ())):
            if dep in g:
                visit(dep, path + [mod], on_path, done)
        on_path.discard(mod)
        done.add(mod)

    done: set[str] = set()
    for mod in g:
        visit(mod, [], set(), done)
    assert not circles, "\n".join(circles)


def test_the_checker_catches_what_it_forbids(tmp_path, monkeypatch):
    """The rules are not vacuous: a model module importing checkpoint, and a circle, are found."""
    g = {
        "gptrain.model.gpt": {"gptrain.checkpoint.manager"},
        "gptrain.data.a": {"gptrain.data.b"},
        "gptrain.data.b": {"gptrain.data.a"},
    }
    monkeypatch.setattr(__import__(__name__), "graph", lambda: g)
    for check in (test_every_import_points_down_or_within_its_folder, test_no_import_circles):
        try:
            check()
        except AssertionError:
            continue
        raise AssertionError(f"{check.__name__} accepted a forbidden graph")


def test_commands_are_imported_only_by_main():
    for mod, deps in graph().items():
        if unit(mod) not in ("commands", "__main__"):
            assert not any(unit(d) == "commands" for d in deps), mod


# The whole config: only training/ and commands/ (and config/ itself) may import these names, or
# the module that defines them (docs/architecture.md).
WHOLE_CONFIG = ("Config", "load_config")
MAY_SEE_THE_WHOLE_CONFIG = {"training", "commands", "config"}


@functools.cache
def parse(text: str) -> ast.Module:
    """A module's syntax tree, parsed once for all the checks below (they only read it)."""
    return ast.parse(text)


def sources() -> dict[str, str]:
    """{module name: source text} of every module of the package."""
    return {module_name(p): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def home_of(name: str, texts: dict[str, str]) -> str:
    """The one module that defines the top-level class or function `name`."""
    homes = [
        mod
        for mod, text in texts.items()
        for node in parse(text).body
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name
    ]
    assert len(homes) == 1, f"{name} is defined in {homes or 'no module'}"
    return homes[0]


def whole_config_imports(texts: dict[str, str]) -> list[str]:
    """Every import, outside training/, commands/ and config/, of Config or load_config (from any
    gptrain module) or of the module that defines them (`from gptrain.config import load`,
    `import gptrain.config.load`, `from gptrain.config.load import ...`)."""
    homes = {home_of(name, texts) for name in WHOLE_CONFIG}
    wrong = []
    for mod, text in texts.items():
        if unit(mod) in MAY_SEE_THE_WHOLE_CONFIG:
            continue
        for node in ast.walk(parse(text)):
            if isinstance(node, ast.Import):
                hits = {a.name for a in node.names} & homes
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gptrain"):
                names = {a.name for a in node.names}
                hits = names & set(WHOLE_CONFIG) | {f"{node.module}.{n}" for n in names} & homes
                hits |= {node.module} & homes
            else:
                continue
            wrong += [f"{mod} imports {h}" for h in sorted(hits)]
    return wrong


def test_only_training_and_commands_see_the_whole_config():
    """Every other component receives its own section (DistConfig, OptimConfig, ...)."""
    texts = sources()
    assert home_of("Config", texts) == "gptrain.config.load"  # what the rule guards
    wrong = whole_config_imports(texts)
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    "line",
    [
        "from gptrain.config.load import Config",
        "from gptrain.config.load import load_config as load",
        "from gptrain.config.load import SECTIONS",
        "from gptrain.config import load",
        "import gptrain.config.load",
        "from gptrain.config.sections import Config",  # even where it is not defined
    ],
)
def test_the_whole_config_check_catches_an_import_of_it(line):
    """The check is not vacuous: one added import of the whole config, in a module of a lower
    layer (checkpoint/manager.py), is found; the same line in training/ is allowed."""
    texts = sources()
    for mod, caught in (("gptrain.checkpoint.manager", True), ("gptrain.training.run", False)):
        tampered = {**texts, mod: texts[mod] + f"\n{line}\n"}
        assert bool(whole_config_imports(tampered)) is caught, (mod, line)


def test_outside_checkpoint_only_its_manager_is_used():
    """The loop, the guards, evals and the commands reach checkpoints through checkpoint.manager
    only (the backends and the folder contract stay behind it)."""
    for mod, deps in graph().items():
        if unit(mod) != "checkpoint":
            wrong = {
                d for d in deps if unit(d) == "checkpoint" and d != "gptrain.checkpoint.manager"
            }
            assert not wrong, (mod, wrong)


MAX_LINES = 420  # docs/architecture.md: no module over ~400 lines


def test_no_module_over_420_lines_and_no_utils():
    for p in PACKAGE.rglob("*.py"):
        assert p.name != "utils.py"
        lines = len(p.read_text().splitlines())
        assert lines <= MAX_LINES, f"{p.relative_to(PACKAGE.parent)}: {lines} lines"


def map_entries(text: str) -> set[str]:
    """The module paths docs/architecture.md's map names: `name.py` lines under their folder."""
    block = text.split("## The map", 1)[1].split("\n## ", 1)[0]
    folder, found = "", set()
    for line in block.splitlines():
        indent, entry = len(line) - len(line.lstrip()), line.strip().split(" ", 1)[0]
        if indent == 6:  # a folder of the package, or a module at its own level (errors.py, ...)
            folder = entry if entry.endswith("/") else ""
            if entry.endswith(".py"):
                found.add(entry)
        elif indent == 8 and folder and entry.endswith(".py"):  # a module inside that folder
            found.add(folder + entry)
    return found


def test_the_map_in_docs_names_every_module():
    """docs/architecture.md's map stays true: every module of the package is listed under its
    folder, and every module it lists exists."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    named = map_entries(text)
    modules = {
        str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"
    }
    assert modules - named == set(), f"modules missing from the map: {sorted(modules - named)}"
    assert named - modules == set(), (
        f"the map names modules that do not exist: {sorted(named - modules)}"
    )


def test_the_map_checker_sees_a_missing_module():
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    assert "checkpoint/mirror.py" in map_entries(text)
    assert "checkpoint/mirror.py" not in map_entries(text.replace("        mirror.py ", "        "))

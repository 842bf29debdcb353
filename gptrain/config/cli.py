"""The command line of `gptrain train`: `--config FILE`, `--section.key=value`
overrides, and `--help`, which prints every config key with its type, default and help text.
"""

from __future__ import annotations

from dataclasses import fields

from gptrain.config.load import SECTIONS, field_types, type_name
from gptrain.errors import UserError


def help_text() -> str:
    """`--help`: every key with its type, default and documentation."""
    out = ["config keys (set in a TOML file under [section] or as --section.key=value):", ""]
    for section in SECTIONS:
        sec = SECTIONS[section]()
        for (key, typ), f in zip(field_types(type(sec)).items(), fields(sec), strict=True):
            out.append(
                f"  --{section}.{key} ({f.metadata.get('type') or type_name(typ)}, default {getattr(sec, f.name)!r})"
            )
            out.append(f"      {f.metadata['help']}")
    return "\n".join(out)


def parse_cli(argv: list[str], usage: str = "") -> tuple[str | None, list[str]]:
    """`[--config FILE] [--section.key=value | --section.key value | --flag ...] [--help]` →
    (config file, overrides); a bare `--section.key` means true. --help prints `usage` and every
    key's documentation."""
    config_file, overrides, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            print(usage.strip() + "\n\n" + help_text())
            raise SystemExit(0)
        if arg == "--config":
            if i + 1 >= len(argv):
                raise UserError("--config needs a file, e.g. --config configs/debug.toml")
            config_file, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            config_file = arg.split("=", 1)[1]
        elif arg.startswith("--") and "=" in arg:
            overrides.append(arg[2:])
        elif arg.startswith("--") and "." in arg:  # --section.key VALUE, or a bare flag = true
            has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            overrides.append(f"{arg[2:]}={argv[i + 1] if has_value else 'true'}")
            i += 1 if has_value else 0
        else:
            raise UserError(
                f"unexpected argument {arg!r}; use --config FILE and --section.key=value (see --help)"
            )
        i += 1
    return config_file, overrides

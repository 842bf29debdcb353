"""The building blocks of config sections: a documented field, the one-line refusal, the
choices check, the duration syntax (90s, 10m, 2h) and the KEY=N,... list syntax."""

from __future__ import annotations

from dataclasses import field, fields

from gptrain.errors import UserError


def opt(default, help: str, choices: tuple | None = None, type_text: str = ""):
    """A config field: its default, its one-line documentation and, optionally, allowed values and
    how `--help` names its type (when the annotation alone would mislead)."""
    return field(default=default, metadata={"help": help, "choices": choices, "type": type_text})


def check(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(message)


def check_choices(section: str, sec) -> None:
    """Every field with `choices` holds one of them."""
    for f in fields(sec):
        choices, value = f.metadata.get("choices"), getattr(sec, f.name)
        check(
            choices is None or value in choices,
            f"{section}.{f.name} = {value!r}; allowed: {', '.join(choices or ())}",
        )


def duration_s(text: str) -> float | None:
    """'90s', '10m', '1.5h' -> seconds (> 0); None when `text` is not such a duration."""
    units = {"s": 1.0, "m": 60.0, "h": 3600.0}
    text = text.strip()
    try:
        value = float(text[:-1]) * units[text[-1:]]
    except (KeyError, ValueError):
        return None
    return value if 0 < value < float("inf") else None


def bad_key_number(text: str, keys: tuple[str, ...]) -> str | None:
    """The first item of 'KEY=N,KEY=N,...' that is not KEY=N with KEY in `keys` and a whole
    N >= 1; None when every item is."""
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if not (key.strip() in keys and value.strip().isdigit() and int(value) >= 1):
            return item
    return None

"""TOML out (``tomllib`` only reads): the one writer of the resolved configs of ``driftlab config --toml``, of the
sweep files ``benchmarks/gpu_reproduce.py`` writes, and of the ``--grid`` values a sweep records as overrides.

``to_toml`` lays a document out as a person would write it: the top level's plain keys, then each top-level table
under a ``[section]`` header and each list of tables (at the top level or in a section) as ``[[section.key]]``
blocks; anything deeper is inline (``lr = {kind = "exponential", initial = 0.1}``). ``None`` is left out of tables,
as ``ExperimentConfig.to_dict`` leaves it out. Strings are basic strings with TOML's escapes (``\\"``, ``\\\\``,
``\\b``, ``\\t``, ``\\n``, ``\\f``, ``\\r``, and ``\\u00XX`` for the other control characters, DEL included), which
for any text TOML can hold are JSON's; floats are ``repr`` (the shortest text that reads back as the same float;
``inf``, ``-inf`` and ``nan`` are TOML's too).
"""

from __future__ import annotations

import re
from typing import Any

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def toml_string(text: str, ascii_only: bool = False) -> str:
    """``text`` as a TOML basic string; ``ascii_only``: every character past ASCII escaped too (``\\u00e9``,
    ``\\U0001f600``), as ``json.dumps`` writes the ones TOML can read, for text that must stay ASCII."""
    out = []
    for char in text:
        code = ord(char)
        if char in _SHORT_ESCAPES:
            out.append(_SHORT_ESCAPES[char])
        elif code < 0x20 or code == 0x7F:
            out.append(f"\\u{code:04x}")
        elif 0xD800 <= code <= 0xDFFF:
            # a lone surrogate (a file name read with surrogateescape, say) is no character TOML can hold
            raise ValueError(f"cannot write {text!r} as TOML: it holds a lone surrogate, \\u{code:04x}")
        elif ascii_only and code > 0x7F:
            out.append(f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}")
        else:
            out.append(char)
    return '"' + "".join(out) + '"'


def toml_key(key: str) -> str:
    """``key`` bare when TOML allows it (letters, digits, ``_`` and ``-``), else quoted."""
    return key if _BARE_KEY.fullmatch(key) else toml_string(key)


def toml_value(value: Any) -> str:
    """A boolean, number, string, list or table as an inline TOML value (a table's ``None`` entries left out)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # a float's shortest text; inf, -inf and nan as TOML writes them
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_key(k)} = {toml_value(v)}" for k, v in value.items() if v is not None) + "}"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as TOML")


def to_toml(document: dict[str, Any]) -> str:
    """``document`` (plain dicts, lists, strings, numbers, booleans) as TOML that ``tomllib.loads`` reads back equal.

    Top-level tables become ``[section]`` headers; a list of tables at the top level or in a section becomes
    ``[[key]]`` or ``[[section.key]]`` blocks (``[[axes]]``, ``[[availability.events]]``); deeper tables are inline.
    """
    lines = _plain_lines(document, top=True)
    for key, value in document.items():
        if isinstance(value, dict):
            lines += ["", f"[{toml_key(key)}]", *_plain_lines(value, top=False)]
            for inner, items in value.items():
                if _is_table_list(items):
                    lines += _blocks(f"{toml_key(key)}.{toml_key(inner)}", items)
        elif _is_table_list(value):
            lines += _blocks(toml_key(key), value)
    return "\n".join(lines).lstrip("\n") + "\n"


def _plain_lines(table: dict[str, Any], top: bool) -> list[str]:
    """The ``key = value`` lines of a table: all but its tables at the top level and its lists of tables."""
    return [
        f"{toml_key(k)} = {toml_value(v)}"
        for k, v in table.items()
        if v is not None and not _is_table_list(v) and not (top and isinstance(v, dict))
    ]


def _blocks(path: str, items: list[dict[str, Any]]) -> list[str]:
    lines: list[str] = []
    for item in items:
        lines += ["", f"[[{path}]]", *(f"{toml_key(k)} = {toml_value(v)}" for k, v in item.items() if v is not None)]
    return lines


def _is_table_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(item, dict) for item in value)


__all__ = ["to_toml", "toml_key", "toml_string", "toml_value"]

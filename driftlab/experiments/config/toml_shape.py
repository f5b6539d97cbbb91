"""The shape of a TOML text, checked before ``tomllib`` reads it: no key, table or list nests more than ``MAX_NESTING`` levels.

``tomllib`` needs memory quadratic in a dotted key's parts (a 439 kB file holding one key of 50,000 quoted
parts took 7.8 GB and was still parsing after 500 s) and recurses once per bracket, so a hostile or mistaken
file must be refused from its raw text, in one linear pass (``check_toml_shape``).
"""

from __future__ import annotations

import re

from driftlab.errors import ConfigError

MAX_NESTING = (
    32  # a config nests 5 levels at most (availability.events[i].join_range[j]); 32 leaves room, not recursion
)


# What the TOML pre-scan matches. It follows tomllib's grammar wherever tomllib accepts the text, so it sees every
# key tomllib builds; the one-line string forms stop at a newline and the others cannot fail after matching the
# text, so each position is read a bounded number of times.
_TOML_GAP = re.compile(r"[ \t]*")
_TOML_ARRAY_GAP = re.compile(
    r"(?:[ \t\n]+|#[^\n]*)*+"
)  # a list may span lines and hold comments; an inline table may not
_TOML_LINE_END = re.compile(r"[ \t]*(?:#[^\n]*)?(?:\n|\Z)")
_TOML_KEY_PART = re.compile(r'[A-Za-z0-9_-]+|"(?:[^"\\\n]|\\[^\n])*"|\'[^\'\n]*\'')
_TOML_KEY_DOT = re.compile(r"[ \t]*\.[ \t]*")
_TOML_STRING = re.compile(
    # multi-line forms first (a closing delimiter may carry one or two quotes of the text), then one-line ones
    r'"""(?:[^"\\]|\\.|"(?!""))*""""{0,2}|\'\'\'(?:[^\']|\'(?!\'\'))*\'\'\'\'{0,2}|"(?:[^"\\\n]|\\[^\n])*"|\'[^\'\n]*\'',
    re.DOTALL,
)
# a number, boolean or date: from a character that is not a blank up to the next one that means something
_TOML_SCALAR = re.compile(r"[^,\[\]{}#\"'\n \t][^,\[\]{}#\"'\n]*")
# more strings, numbers, booleans or dates of a list at once: only their commas and gaps, no nesting, to read
_TOML_MORE_ITEMS = re.compile(
    rf"(?:{_TOML_ARRAY_GAP.pattern},{_TOML_ARRAY_GAP.pattern}(?:{_TOML_STRING.pattern}|{_TOML_SCALAR.pattern}))*",
    re.DOTALL,
)
_TOML_COARSE = re.compile(r"[\[\]{}=,\n.#\"']")
_TOML_ONE_LINE_STRING = {'"': re.compile(r'"(?:[^"\\\n]|\\[^\n])*"'), "'": re.compile(r"'[^'\n]*'")}


class _NotToml(Exception):
    """The text stops being TOML at ``position`` (tomllib will say why)."""

    def __init__(self, position: int) -> None:
        self.position = position


class _TomlShape:
    """One pass over a TOML text refusing, before tomllib reads it, nesting deeper than ``MAX_NESTING`` (``check_toml_shape``).

    A depth is how deep a value sits in the parsed table, as ``check_plain_values`` counts it: each part of a
    key is a level (a ``[table]`` header's too, for the keys under it), a list is a level around its items
    (``[[a]]``: the list a, then the table appended to it), an inline table adds only its keys' parts.
    """

    def __init__(self, text: str, origin: str) -> None:
        self.text, self.origin = text, origin
        self.depth = 0  # of the value being read, for the coarse scan after a syntax error

    def document(self) -> None:
        """Statement after statement, as ``tomllib.loads`` reads them; raises ``_NotToml`` where it would fail."""
        text, pos, header_depth = self.text, 0, 0
        while (pos := _TOML_GAP.match(text, pos).end()) < len(text):
            if text[pos] == "[":
                array = text.startswith("[[", pos)
                pos, parts = self.key(_TOML_GAP.match(text, pos + 1 + array).end(), base=int(array))
                if not text.startswith("]]" if array else "]", pos):
                    raise _NotToml(pos)
                header_depth = parts + array  # [[a.b]]: the list a.b holds the tables
                pos += 1 + array
            elif text[pos] not in "\n#":
                pos, parts = self.key_and_equals(pos, base=header_depth)
                pos = self.value(pos, header_depth + parts)
            line_end = _TOML_LINE_END.match(text, pos)
            if line_end is None:
                raise _NotToml(pos)
            pos = line_end.end()

    def key(self, pos: int, base: int) -> tuple[int, int]:
        """(position after the key at ``pos`` and the blanks after it, number of its parts).

        Refuses, part by part, a key that nests a value more than ``MAX_NESTING`` levels deep below ``base``
        levels, so a key of 50,000 parts costs 33 of them.
        """
        start, parts = pos, 0
        while True:
            part = _TOML_KEY_PART.match(self.text, pos)
            if part is None:
                raise _NotToml(pos)
            parts += 1
            if base + parts > MAX_NESTING:
                self.refuse_key(start, base)
            dot = _TOML_KEY_DOT.match(self.text, part.end())
            if dot is None:
                return _TOML_GAP.match(self.text, part.end()).end(), parts
            pos = dot.end()

    def key_and_equals(self, pos: int, base: int) -> tuple[int, int]:
        """(position of the value after ``key =`` at ``pos``, the key's number of parts)."""
        pos, parts = self.key(pos, base)
        if not self.text.startswith("=", pos):
            raise _NotToml(pos)
        return _TOML_GAP.match(self.text, pos + 1).end(), parts

    def value(self, pos: int, depth: int) -> int:
        """The position after the value at ``pos``, which sits ``depth`` levels deep.

        Iterative: the lists and inline tables around the value being read are a stack of (closing bracket,
        depth of what is inside), so a hostile depth is refused, not recursed into.
        """
        text = self.text
        around: list[tuple[str, int]] = []
        while True:
            self.depth = depth
            if depth > MAX_NESTING:
                self.refuse_depth(pos)
            char = text[pos : pos + 1]
            if char == "[":
                around.append(("]", depth + 1))
                pos = _TOML_ARRAY_GAP.match(text, pos + 1).end()
                if not text.startswith("]", pos):
                    depth += 1
                    continue
                pos += 1
                around.pop()
            elif char == "{":
                around.append(("}", depth))
                pos = _TOML_GAP.match(text, pos + 1).end()
                if not text.startswith("}", pos):
                    pos, parts = self.key_and_equals(pos, depth)
                    depth += parts
                    continue
                pos += 1
                around.pop()
            else:
                scalar = (_TOML_STRING if char in ("'", '"') else _TOML_SCALAR).match(text, pos)
                if scalar is None:
                    raise _NotToml(pos)
                pos = scalar.end()
                if around and around[-1][0] == "]":
                    pos = _TOML_MORE_ITEMS.match(text, pos).end()  # at the depth just checked
            # a value is complete: close the lists and tables it completes, up to the next value in one of them
            while around:
                closing, inside = around[-1]
                pos = (_TOML_ARRAY_GAP if closing == "]" else _TOML_GAP).match(text, pos).end()
                if text.startswith(closing, pos):
                    pos += 1
                    around.pop()
                    continue
                if not text.startswith(",", pos):
                    raise _NotToml(pos)
                if closing == "}":
                    pos, parts = self.key_and_equals(_TOML_GAP.match(text, pos + 1).end(), inside)
                    depth = inside + parts
                    break
                pos = _TOML_ARRAY_GAP.match(text, pos + 1).end()
                if not text.startswith("]", pos):
                    depth = inside
                    break
                pos += 1  # a trailing comma
                around.pop()
            else:
                return pos

    def coarse(self, pos: int, depth: int) -> None:
        """From ``pos`` on, where the text stopped being TOML: brackets and runs of dots counted wherever they are.

        For a caller that also parses pieces of the text on their own (a sweep's ``--grid a,b,c``); it may
        refuse what is not nesting (dots in a string after a syntax error), never miss what is. A string is
        skipped when it closes on its line; once one does not, the quotes on the rest of that line are not
        taken as strings, so no line is read more than twice.
        """
        text, dots, strings_from = self.text, 0, pos
        while (found := _TOML_COARSE.search(text, pos)) is not None:
            char, pos = found.group(), found.end()
            if char == ".":
                dots += 1
                if depth + dots + 1 > MAX_NESTING:
                    self.refuse_key(text.rfind("\n", 0, found.start()) + 1, depth)
            elif char in "'\"":
                string = (
                    _TOML_ONE_LINE_STRING[char].match(text, found.start()) if found.start() >= strings_from else None
                )
                if string is not None:
                    pos = string.end()
                elif found.start() >= strings_from:
                    strings_from = _line_end(text, pos)
            elif char == "#":
                pos = _line_end(text, pos)
            else:
                dots = 0
                if char in "[{":
                    depth += 1
                    if depth > MAX_NESTING:
                        self.refuse_depth(found.start())
                elif char in "]}":
                    depth = max(0, depth - 1)

    def refuse_key(self, start: int, base: int) -> None:
        shown = self.text[start : start + 40].split("\n")[0]
        below = f", below {base} level{'s' * (base != 1)} of tables and lists" if base else ""
        raise ConfigError(
            f"{self.origin}: line {self.text.count(chr(10), 0, start) + 1}: a dotted key nested more than {MAX_NESTING} "
            f"levels deep (starting {shown!r}{below}); a config is sections of keys, with at most a schedule table or "
            "a list of events inside: write [section] and then key = value"
        )

    def refuse_depth(self, pos: int) -> None:
        raise ConfigError(
            f"{self.origin}: line {self.text.count(chr(10), 0, pos) + 1} is nested too deeply to be a config (a config "
            f"nests at most {MAX_NESTING} levels); a value is a number, a string, a list or a small table"
        )


def _line_end(text: str, pos: int) -> int:
    end = text.find("\n", pos)
    return len(text) if end < 0 else end


def check_toml_shape(text: str, origin: str, *, pieces: bool = True) -> None:
    """Refuse TOML whose keys, tables and lists nest more than ``MAX_NESTING`` levels, from the raw text.

    Runs before ``tomllib``, which needs memory quadratic in a dotted key's parts (a 439 kB file holding one
    key of 50,000 quoted parts took 7.8 GB and was still parsing after 500 s) and recurses once per bracket.
    The scan reads keys as tomllib does (bare, "basic" and 'literal' parts, blanks around the dots) in
    ``key = value`` lines, ``[table]`` and ``[[array]]`` headers and inline tables, and adds up the levels of
    the header, lists and tables around a key; dots and brackets in strings (one-line and multi-line) and
    comments are not nesting, nor is a number's dot. One pass, linear in the text, allocating little.

    Where the text stops being TOML, ``tomllib.loads`` stops too, so the rest cannot cost it anything; but
    with ``pieces`` (the default) the caller may also parse pieces of the text on their own (a sweep's
    ``--grid a,b,c`` splits at commas), so the rest is scanned by a coarser rule that over-counts rather than misses.
    """
    if "\r" in text:
        text = text.replace("\r\n", "\n")  # as tomllib reads it
    shape = _TomlShape(text, origin)
    try:
        shape.document()
    except _NotToml as stop:
        if pieces:
            shape.coarse(stop.position, shape.depth)


__all__ = ["MAX_NESTING", "check_toml_shape"]

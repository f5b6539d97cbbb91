"""The raw-text scan refuses what nests deeper than a config may, agreeing with the parsed table's check at the boundary."""

import tomllib

import pytest

from driftlab.errors import ConfigError
from driftlab.experiments.config import preset_names
from driftlab.experiments.config.toml_shape import check_toml_shape


def _key(parts: int) -> str:
    return ".".join(f'"p{i}"' for i in range(parts))


@pytest.mark.parametrize(
    "deepest, too_deep, refusal",
    [  # the deepest value at exactly 32 levels, then one level more
        (
            f"[{_key(20)}]\n{_key(12)} = 1\n",
            f"[{_key(20)}]\n{_key(13)} = 1\n",
            "line 2: a dotted key nested .* below 20 levels",
        ),
        (
            f"[[{_key(20)}]]\n{_key(11)} = 1\n",
            f"[[{_key(20)}]]\n{_key(12)} = 1\n",
            "line 2: .* below 21 levels",
        ),  # 20, the list, a table in it
        (
            f"a = [{{ b = [{{ {_key(28)} = 1 }}] }}]\n",
            f"a = [{{ b = [{{ {_key(29)} = 1 }}] }}]\n",
            "line 1: .* below 4 levels",
        ),  # a, list, b, list
        (
            f"a = {{ b = {{ {_key(30)} = 1 }} }}\n",
            f"a = {{ b = {{ {_key(31)} = 1 }} }}\n",
            "line 1: .* below 2 levels",
        ),  # a, b: braces add none
        ("a = " + "[" * 31 + "1" + "]" * 31, "a = " + "[" * 32 + "1" + "]" * 32, "line 1 is nested too deeply"),
    ],
    ids=["table header", "array of tables header", "lists of inline tables", "inline tables", "lists"],
)
def test_the_levels_of_headers_lists_and_inline_tables_around_a_key_add_up(deepest, too_deep, refusal):
    from driftlab.experiments.config import check_plain_values

    check_toml_shape(deepest, "f.toml")
    check_plain_values(tomllib.loads(deepest), "f.toml")  # the check of the parsed table agrees at the boundary ...
    with pytest.raises(ConfigError, match="nested more than 32 levels"):
        check_plain_values(tomllib.loads(too_deep), "f.toml")  # ... and one level past it
    with pytest.raises(ConfigError, match=f"^f.toml: {refusal}"):
        check_toml_shape(too_deep, "f.toml")


def test_strings_holding_dots_quotes_and_brackets_are_read_as_strings_not_keys():
    from driftlab.experiments.config import parse_toml

    dots, brackets = ".".join(["a"] * 40), "[{" * 40
    text = (
        f'"{dots}" = 1\n'  # one quoted part holding 40 dots is one level
        f"'{brackets}' . x = \"{brackets}\"  # {dots} {brackets}\n"  # so does one holding 80 brackets
        f'q = "\\"{dots}\\" = {brackets}"\n'  # escaped quotes do not end the string
        f'[section]\nml = """\n{dots} = 1\n{brackets}\n"""""\n'  # a multi-line string may end in two more quotes
        f"lit = '''\n[{dots}]\n'{dots}' '''''\n"
        f"list = [\n  \"{brackets}\",  # {brackets}\n  '{dots}', 0.5, 1979-05-27 07:32:00,\n]\n"
        f"inline = {{ s = \"{dots}\", t = ['{brackets}'] }}\r\n"
    )
    check_toml_shape(text, "f.toml")  # nothing refused
    table = parse_toml(text, "f.toml")
    assert table[dots] == 1 and table[brackets] == {"x": brackets}
    assert table["q"] == f'"{dots}" = {brackets}'
    assert table["section"]["ml"] == f'{dots} = 1\n{brackets}\n""'
    assert table["section"]["lit"] == f"[{dots}]\n'{dots}' ''"
    assert table["section"]["list"][:3] == [brackets, dots, 0.5]
    assert table["section"]["inline"] == {"s": dots, "t": [brackets]}


def test_every_shipped_preset_and_sweep_passes_the_scan():
    from driftlab.experiments.sweep.shipped import preset_text, sweep_names, sweep_text

    texts = [preset_text(name) for name in preset_names()] + [sweep_text(name) for name in sweep_names()]
    assert len(texts) == len(preset_names()) + len(sweep_names()) > 30
    for text in texts:
        tomllib.loads(text)  # each is TOML ...
        check_toml_shape(text, "shipped", pieces=False)  # ... that the scan passes

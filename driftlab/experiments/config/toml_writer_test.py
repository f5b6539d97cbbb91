"""The one TOML writer: what it writes reads back equal through tomllib, in the layout a person would write."""

from __future__ import annotations

import json
import math
import tomllib

import pytest

from driftlab.experiments.config import load_config, preset_names
from driftlab.experiments.config.toml_writer import to_toml, toml_key, toml_string, toml_value
from driftlab.experiments.sweep.shipped import sweep_names, sweep_text

NASTY = [
    "",
    "quote \" and ' apostrophe",
    "back\\slash \\n not a newline",
    "newline \n tab \t return \r backspace \b form feed \f",
    "bell \x07 escape \x1b nul \x00 unit separator \x1f delete \x7f",
    "é ü ß 中文 ﬁ",
    "astral 😀 𝄞",
    '"""',
    "'''",
    "# not a comment",
    "[not.a.table]",
    "key = value",
]


@pytest.mark.parametrize("text", NASTY)
def test_a_string_reads_back_as_itself_quoted_either_way(text):
    for ascii_only in (False, True):
        written = toml_string(text, ascii_only)
        assert tomllib.loads(f"v = {written}")["v"] == text
        assert "\n" not in written and all(ord(c) >= 0x20 and ord(c) != 0x7F for c in written)
    assert toml_string(text, ascii_only=True).isascii()


def test_escapes_are_tomls_short_forms_and_json_s_for_text_toml_can_hold():
    assert toml_string('a"b\\c\nd\te\bf\fg\rh') == '"a\\"b\\\\c\\nd\\te\\bf\\fg\\rh"'
    assert toml_string("\x07\x7f") == '"\\u0007\\u007f"'  # DEL too, which JSON leaves raw and TOML refuses
    assert toml_string("é😀") == '"é😀"'
    assert (
        toml_string("é😀", ascii_only=True) == '"\\u00e9\\U0001f600"'
    )  # not JSON's surrogate pair, which TOML refuses
    for code in [*range(0x7F), *range(0x80, 0xD800), *range(0xE000, 0x10000)]:
        assert toml_string(chr(code), ascii_only=True) == json.dumps(chr(code)), hex(code)
        assert toml_string(chr(code)) == json.dumps(chr(code), ensure_ascii=False), hex(code)


def test_a_lone_surrogate_is_refused_not_written_unreadable():
    with pytest.raises(ValueError, match="lone surrogate"):
        toml_string("file\udcff.toml")


def test_keys_are_bare_when_toml_allows_and_quoted_otherwise():
    assert [toml_key(k) for k in ("lr", "client_lr", "x-1", "7")] == ["lr", "client_lr", "x-1", "7"]
    assert [toml_key(k) for k in ("", "a b", "a.b", "é", "lr\n")] == ['""', '"a b"', '"a.b"', '"é"', '"lr\\n"']


def test_numbers_are_their_shortest_text_and_the_infinities_tomls():
    assert [toml_value(v) for v in (0, -3, 2**62, 0.1, -2.5e-07, 1e300, -0.0, True, False)] == [
        "0",
        "-3",
        "4611686018427387904",
        "0.1",
        "-2.5e-07",
        "1e+300",
        "-0.0",
        "true",
        "false",
    ]
    assert [toml_value(v) for v in (math.inf, -math.inf, math.nan)] == ["inf", "-inf", "nan"]
    assert math.isnan(tomllib.loads(f"v = {toml_value(math.nan)}")["v"])


def test_a_document_round_trips_with_tables_lists_of_tables_and_inline_tables():
    document = {
        "seed": 3,
        "name": 'a "quoted" \\ name\n',
        "ratios": [0.5, 1, -math.inf],
        "nested": [[1, 2], [], ["x", [True]]],
        "mixed": [1, {"a": 1}],
        "axes": [{"name": "lr", "values": [{"label": "é", "set": ["client.lr=0.1"]}]}, {"name": "", "empty": {}}],
        "client": {"lr": {"kind": "exponential", "initial": 0.1, "decay": 0.99}, "weird key": {"x": {"y": "z"}}},
        "availability": {"events": [{"round": 2, "join": [1, 2]}, {"round": 3, "leave_range": [0, 4]}], "p": 0.0},
        "empty section": {},
        "scales": {"paper": {"overrides": ["rounds=1000"]}},
    }
    text = to_toml(document)
    assert tomllib.loads(text) == document
    assert text.startswith("seed = 3\n")
    assert "\n[client]\n" in text and 'lr = {kind = "exponential", initial = 0.1, decay = 0.99}' in text
    assert "\n[[axes]]\n" in text and "\n[[availability.events]]\n" in text and '\n["empty section"]\n' in text
    assert to_toml({}) == "\n"


def test_none_is_left_out_of_tables_as_to_dict_leaves_it_and_refused_in_lists():
    assert tomllib.loads(to_toml({"a": None, "s": {"b": None, "c": {"d": None, "e": 1}}})) == {"s": {"c": {"e": 1}}}
    with pytest.raises(TypeError, match="cannot write NoneType"):
        to_toml({"a": [None]})
    with pytest.raises(TypeError, match="cannot write object"):
        to_toml({"a": object()})


@pytest.mark.parametrize("name", preset_names())
def test_every_presets_resolved_config_reads_back_as_the_same_config(name, tmp_path):
    original = load_config(name)
    path = tmp_path / "config.toml"
    path.write_text(to_toml(original.to_dict()), encoding="utf-8")
    loaded = load_config(path)
    assert loaded.to_dict() == original.to_dict() and loaded.fingerprint() == original.fingerprint()


@pytest.mark.parametrize("name", sweep_names())
def test_every_shipped_sweep_reads_back_as_the_same_sweep(name):
    sweep = tomllib.loads(sweep_text(name))
    assert tomllib.loads(to_toml(sweep)) == sweep

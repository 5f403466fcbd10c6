"""`check_json` (limits.py) refuses exactly the bodies whose parsed strings hold a lone surrogate, whichever
way the surrogate is written: a JSON escape (either case, in a key or a value), raw bytes, UTF-16 or a BOM.
Escaped surrogate pairs (emoji, as ensure_ascii encoders write them) and an escaped backslash before "ud800"
are valid text."""

import json

import pytest

from asyncrl.inference.api.limits import check_json

REFUSED = {
    "escape": b'{"a": "\\ud800"}',
    "upper-case escape": b'{"a": "x\\uDC00y"}',
    "escape in a key": b'{"\\udfff": 1}',
    "nested": b'{"messages": [{"role": "user", "content": ["\\ud800"]}]}',
    "raw utf-8 bytes": '{"a": "\ud800"}'.encode("utf-8", "surrogatepass"),
    "utf-16": '{"a": "\ud800"}'.encode("utf-16-le", "surrogatepass"),
    "utf-8 bom": '\ufeff{"a": "\\ud800"}'.encode(),
}
ACCEPTED = {
    "ascii": b'{"messages": [{"role": "user", "content": "hi"}]}',
    "non-ascii": '{"a": "h\u00e9 \u4e16 \U0001f600"}'.encode(),
    "escaped pair": b'{"a": "\\ud83d\\ude00"}',
    "escaped backslash": b'{"a": "\\\\ud800"}',
    "utf-16": '{"a": "h\u00e9"}'.encode("utf-16"),
    "not json": b'{"a": ',
    "invalid utf-8": b'{"a": "\xff"}',
}


def _reference(body: bytes) -> bool:
    """Whether the body parses to a lone surrogate: its full re-encoding fails."""
    try:
        obj = json.loads(body)
    except ValueError:
        return False
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


@pytest.mark.parametrize("case", REFUSED)
def test_a_lone_surrogate_is_refused(case):
    assert _reference(REFUSED[case])
    assert "lone UTF-16 surrogate" in check_json(REFUSED[case], 10)


@pytest.mark.parametrize("case", ACCEPTED)
def test_valid_text_passes(case):
    assert not _reference(ACCEPTED[case])
    assert check_json(ACCEPTED[case], 10) is None


def test_the_message_count_is_checked_first():
    body = json.dumps({"messages": [{"role": "user", "content": "\ud800"}] * 3}, ensure_ascii=True).encode()
    assert "at most 2" in check_json(body, 2)


@pytest.mark.parametrize("depth", [129, 1_000, 100_000])
def test_json_nested_past_the_limit_is_refused_at_any_depth(depth):
    """Deeper than the interpreter's recursion limit too (json.loads raises RecursionError there)."""
    body = ('{"messages": [{"role": "user", "content": ' + "[" * depth + "]" * depth + "}]}").encode()
    assert "nests JSON more than 128 levels" in check_json(body, 100)


def test_json_nested_to_the_limit_and_brackets_in_strings_pass():
    assert check_json(("[" * 128 + "]" * 128).encode(), 100) is None
    assert check_json(b'{"prompt": "' + b"[{" * 5_000 + b'"}', 100) is None  # text, not nesting

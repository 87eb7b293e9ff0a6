"""lightning_horizon.checks: the predicates' edge cases and the one message format."""

from __future__ import annotations

import math

import pytest

from lightning_horizon.checks import check_int, check_one_of, is_int, is_number, require

INF, NAN = math.inf, math.nan


@pytest.mark.parametrize(
    "value, minimum, ok",
    [
        (0, None, True),
        (-7, None, True),
        (10**30, None, True),
        (3, 3, True),  # the minimum itself is allowed
        (2, 3, False),
        (True, None, False),  # bool is an int subclass, never a count
        (False, 0, False),
        (1.0, None, False),
        (2.0, 1, False),
        ("3", None, False),
        (None, None, False),
    ],
)
def test_is_int(value, minimum, ok):
    assert is_int(value, minimum) is ok


@pytest.mark.parametrize(
    "value, kwargs, ok",
    [
        # defaults: any finite int or float
        (0, {}, True),
        (-1.5, {}, True),
        (10**400, {}, True),  # larger than any float: compared, not converted
        (INF, {}, False),
        (-INF, {}, False),
        (NAN, {}, False),
        (True, {}, False),
        (False, {}, False),
        ("1", {}, False),
        (None, {}, False),
        # the ends: open unless included
        (0, {"low": 0}, False),
        (0.0, {"low": 0, "include_low": True}, True),
        (1, {"low": 0, "high": 1}, False),
        (1, {"low": 0, "high": 1, "include_high": True}, True),
        (0.5, {"low": 0, "high": 1}, True),
        (INF, {"low": 0, "high": INF, "include_high": True}, True),  # an infinite end that is included
        (-INF, {"low": -INF, "include_low": True}, True),
        (NAN, {"low": -INF, "high": INF, "include_low": True, "include_high": True}, False),  # NaN never
        (1, {"low": 1, "high": 10, "include_low": True, "include_high": True}, True),
        (10.000001, {"low": 1, "high": 10, "include_low": True, "include_high": True}, False),
    ],
)
def test_is_number(value, kwargs, ok):
    assert is_number(value, **kwargs) is ok


def test_require_message_format():
    require(True, "Owner", "x", object(), "anything")  # passes silently
    with pytest.raises(ValueError) as info:
        require(False, "Owner", "x", "a'b", "a finite number > 0")
    assert str(info.value) == "Owner(x=\"a'b\"): allowed is a finite number > 0"  # the value as repr shows it


@pytest.mark.parametrize(
    "value, message",
    [
        (0, "M(n=0): allowed is an int >= 1 (steps)"),
        (True, "M(n=True): allowed is an int >= 1 (steps)"),
        (1.0, "M(n=1.0): allowed is an int >= 1 (steps)"),
    ],
)
def test_check_int(value, message):
    check_int("M", "n", 1, 1, " (steps)")
    with pytest.raises(ValueError) as info:
        check_int("M", "n", value, 1, " (steps)")
    assert str(info.value) == message


def test_check_one_of():
    check_one_of("P", "mode", "fake", ("auto", "fake"))
    check_one_of("P", "master", None, ("kahan", None))
    with pytest.raises(ValueError) as info:
        check_one_of("P", "mode", "trace", ["auto", "fake"])
    assert str(info.value) == "P(mode='trace'): allowed is one of ('auto', 'fake')"

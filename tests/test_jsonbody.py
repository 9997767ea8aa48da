"""Bounded JSON bodies (http/jsonbody.py): the out-of-range number search, small bodies and large ones.

The real path (the gateway's listener answering 400 naming the field) is
tests/test_gateway_api.py::test_abusive_json_gets_400_naming_the_field; this checks the search itself,
which runs on every request body, against its definition as a regular expression."""

from __future__ import annotations

import json
import random
import re

import pytest

from llmgw.http.jsonbody import SMALL, JSONRefused, _suspect, decode

DEFINITION = re.compile(rb"NaN|Infinity|\d{19,}|[eE][+-]?\d{3,}")


def test_the_number_search_finds_what_its_definition_does():
    rng = random.Random(11)
    alphabet = b"0123456789eE+-.NaInfity ,:[]{}\"x\xc3\xa9"
    for _ in range(100_000):
        data = bytes(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        assert _suspect(data) == bool(DEFINITION.search(data)), data


def body(extra: str, filler: int) -> bytes:
    text = "release e2024, hash 5e770a12, id 12345678901234567890 " * (filler // 50 + 1)
    return ('{"model": "m", "messages": [{"role": "user", "content": "%s"}], %s}' % (text[:filler], extra)).encode()


@pytest.mark.parametrize("filler", [10, SMALL + 1000])
@pytest.mark.parametrize("extra, param", [
    ('"temperature": NaN', "temperature"),
    ('"top_p": -Infinity', "top_p"),
    ('"temperature": 1e999', "temperature"),
    ('"temperature": -2.5E+400', "temperature"),
    ('"seed": 99999999999999999999', "seed"),
    ('"logit_bias": {"5": %s}' % ("7" * 5000), "logit_bias.5"),
])
def test_numbers_json_cannot_carry_are_refused_naming_the_field(filler, extra, param):
    with pytest.raises(JSONRefused) as err:
        decode(body(extra, filler))
    assert err.value.param == param


@pytest.mark.parametrize("filler", [10, SMALL + 1000])
def test_numbers_in_range_and_lookalikes_in_strings_pass(filler):
    data = body('"temperature": 1e-300, "seed": 9223372036854775807, "top_p": 0.5E+10', filler)
    assert decode(data) == json.loads(data)

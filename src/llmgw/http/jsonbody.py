"""JSON request bodies with bounded work: the shape is checked before the body is parsed whole.

Python's parser has no limits of its own: a 64 MiB body of `[{},{},…]` costs seconds of event-loop CPU
and gigabytes of objects, deep nesting ends in a RecursionError (a 500), an integer of 5,000 digits in a
ValueError, and `NaN` / `Infinity` / `1e999` are accepted although JSON has no such numbers. So, before
`json.loads`, one linear pass in C (regular expressions and `bytes` methods) reduces the body to its
skeleton (every string emptied) and refuses:

- more than `MAX_CONTAINERS` objects and arrays, or more than `MAX_VALUES` values in all;
- nesting deeper than `MAX_DEPTH`;
- a number JSON cannot carry here: `NaN`, `Infinity`, a float that overflows to infinity, or an integer
  outside the signed 64-bit range (no OpenAI field needs more, and engines parse them into fixed widths);
- a body that is not UTF-8 (RFC 8259) or not valid JSON.

Each refusal is a `JSONRefused` naming the field (`messages[3].content`) where one is to blame; finding
it walks the tokens up to the offence, which only a refused body pays for. A legitimate body pays a few
passes in C (a translation and a few searches and counts), about as much as `json.loads` itself.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_DEPTH = 64
MAX_CONTAINERS = 100_000
MAX_VALUES = 1_000_000
INT64 = (-(1 << 63), (1 << 63) - 1)
LOCATE_TOKENS = 200_000  # the walk that names the field gives up (param null) after this many tokens
SMALL = 16 << 10  # bodies up to this size take the short path in `check`

# A JSON string: possessive, and an unterminated one runs to the end, so the pass stays linear on any input.
_STRING = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+(?:"|\Z)', re.S)
# What may be a number out of range: `NaN`, `Infinity`, 19 digits in a row, an exponent of 3 digits or more
# (`[eE][+-]?\d{3,}`). Looked for in C: the body mapped to a few classes (digit -> 0, e/E -> e, +/- -> +,
# anything else -> space), then searched. A regular expression tried at every offset cost ~70 us per KiB.
_CLASSES = bytes(0x30 if 0x30 <= b <= 0x39 else 0x65 if b in b"eE" else 0x2B if b in b"+-" else 0x20 for b in range(256))
_LONG_DIGITS = b"0" * 19
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_OPEN = frozenset(b"[{")
_TOKEN = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+(?:"|\Z)|[\[\]{}:,]|[^\s\[\]{}:,"]+', re.S)


class JSONRefused(ValueError):
    """The body is refused: `str()` says why, `param` names the field (or None for the whole body)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def decode(body: bytes) -> Any:
    """The parsed body, or `JSONRefused`. See the module docstring for the limits."""
    check(body)
    try:
        return _DECODER.decode(body.decode("utf-8"))
    except UnicodeDecodeError:
        raise JSONRefused("the request body is not UTF-8 text") from None
    except (ValueError, RecursionError):  # JSONDecodeError, or what the walk's budget could not name
        raise JSONRefused("the request body is not valid JSON") from None


def check(body: bytes) -> None:
    """Refuse (`JSONRefused`) a body whose shape is beyond the limits, without parsing it whole."""
    if len(body) <= SMALL:
        # Too short to hold MAX_CONTAINERS or MAX_VALUES, and (brackets in strings counted too) usually to
        # nest MAX_DEPTH deep; the literals are looked for in the body itself (a match inside a string only
        # costs the walk that finds nothing): the common request pays two counts and one search.
        if body.count(b"{") + body.count(b"[") > MAX_DEPTH and _depth(skeleton_of(body)) > MAX_DEPTH:
            param = _locate(body, _too_deep, top_level=True)
            raise JSONRefused(f"{_name(param)} nests deeper than {MAX_DEPTH} levels", param)
        _numbers(body)
        return
    skeleton = skeleton_of(body)
    containers = skeleton.count(b"{") + skeleton.count(b"[")
    if containers > MAX_CONTAINERS:
        raise JSONRefused(f"the request body has more than {MAX_CONTAINERS} objects and arrays")
    if containers + skeleton.count(b",") > MAX_VALUES:
        raise JSONRefused(f"the request body has more than {MAX_VALUES} values")
    if containers > MAX_DEPTH and _depth(skeleton) > MAX_DEPTH:
        param = _locate(body, _too_deep, top_level=True)
        raise JSONRefused(f"{_name(param)} nests deeper than {MAX_DEPTH} levels", param)
    _numbers(body, skeleton)


def _numbers(body: bytes, skeleton: bytes | None = None) -> None:
    if _suspect(body if skeleton is None else skeleton):
        param = _locate(body, _bad_number)
        if param is not None:
            raise JSONRefused(f"{_name(param)} is not a number JSON allows here: use a finite number, and "
                              f"integers within ±2^63", param)


def _suspect(data: bytes) -> bool:
    """`data` holds something that may be a number JSON cannot carry here (see `_CLASSES`)."""
    if b"NaN" in data or b"Infinity" in data:
        return True
    classes = data.translate(_CLASSES)
    return b"e000" in classes or b"e+000" in classes or _LONG_DIGITS in classes


def skeleton_of(body: bytes) -> bytes:
    """`body` with every string emptied (`"..."` -> `""`): what is left is structure, numbers and literals.
    Without an escaped quote, splitting at quotes does it at memory speed; else a (linear) expression."""
    if b'\\"' in body:
        return _STRING.sub(b'""', body)
    return b'""'.join(body.split(b'"')[::2])


def _no_constant(name: str) -> Any:
    raise JSONRefused(f"{name} is not a number JSON allows")


_DECODER = json.JSONDecoder(parse_constant=_no_constant)  # built once: json.loads(..., **kw) builds one per call


def _depth(skeleton: bytes) -> int:
    depth = deepest = 0
    for c in skeleton.translate(None, _NOT_BRACKETS):
        if c in _OPEN:
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_DEPTH:
                    break
        else:
            depth -= 1
    return deepest


def _name(param: str | None) -> str:
    return f"`{param}`" if param else "the request body"


def _too_deep(token: bytes, depth: int) -> bool:
    return depth > MAX_DEPTH


def _bad_number(token: bytes, depth: int) -> bool:
    if token[:1] == b'"' or token in (b"true", b"false", b"null"):
        return False
    if b"NaN" in token or b"Infinity" in token:
        return True
    try:
        if b"." in token or b"e" in token or b"E" in token:
            return not math.isfinite(float(token))
        if len(token.lstrip(b"-")) > 19:
            return True
        return not INT64[0] <= int(token) <= INT64[1]
    except ValueError:
        return False  # not a number at all: the parser will say the body is not JSON


def _locate(body: bytes, offends, top_level: bool = False) -> str | None:
    """The path (`messages[3].content`) of the first token for which `offends(token, depth)` is true, or
    with `top_level` only its first part (`messages`); walks at most LOCATE_TOKENS tokens. None if there
    is none within them, or the offence is the body itself."""
    path: list[Any] = []  # per open container: a key (str), or an index (int); None before an object's first key
    kinds: list[int] = []
    expect_key = False
    for n, m in enumerate(_TOKEN.finditer(body)):
        if n >= LOCATE_TOKENS:
            return None
        tok = m.group()
        c = tok[0]
        if c in _OPEN:
            kinds.append(c)
            path.append(0 if c == 0x5B else None)
            expect_key = c == 0x7B
            if offends(tok, len(kinds)):
                return _format(path[:1] if top_level else path[:-1])
        elif c in (0x5D, 0x7D):
            if kinds:
                kinds.pop()
                path.pop()
            expect_key = False
        elif c == 0x2C:  # ,
            if kinds and kinds[-1] == 0x5B:
                path[-1] += 1
            else:
                expect_key = True
        elif c == 0x3A:  # :
            expect_key = False
        elif expect_key and kinds:
            try:
                path[-1] = json.loads(tok)
            except ValueError:
                path[-1] = tok.decode("utf-8", "replace").strip('"')
            expect_key = False
        elif offends(tok, len(kinds)):
            return _format(path)
    return None


def _format(path: list[Any]) -> str | None:
    out = ""
    for p in path:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p is not None:
            out += f".{p}" if out else str(p)
    return out or None


class BoundedJSON:
    """ASGI middleware for the FastAPI apps (admin and node APIs): a JSON body is read (the listener caps
    its size) and `check`ed before the app parses it; a refusal is a 400 in the OpenAI envelope.

    `lean`: POST paths served before the app, by a handler called as `handler(scope, body, send, app)`
    with the body read and checked; `app()` hands the request, body replayed, to the app, which is how a
    handler answers whatever it does not serve itself (the node API's heartbeat, control/heartbeat_path.py)."""

    def __init__(self, app, lean: dict | None = None):
        self.app = app
        self.lean = lean or {}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                break
        body = b"".join(chunks)
        try:
            check(body)
        except JSONRefused as exc:
            from llmgw.http import errors

            err = errors.bad_request(str(exc), param=exc.param)
            data = err.body()
            await send({"type": "http.response.start", "status": 400, "headers": [
                (b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]})
            await send({"type": "http.response.body", "body": data})
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        async def app() -> None:
            await self.app(scope, replay, send)

        handler = self.lean.get(scope["path"]) if scope["method"] == "POST" else None
        if handler is not None:
            await handler(scope, body, send, app)
        else:
            await app()

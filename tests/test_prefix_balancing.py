"""Prefix-aware balancing on its own (issue 37): the prefix key (gateway/prefix.py) and the balancer's
rendezvous ranking with a load bound (gateway/balancer.py). The real path, through a gateway to sim engines
with a prefix cache and with tracing on, is in tests/test_cache_isolation.py."""

from __future__ import annotations

import math
import random

from llmgw.gateway.balancer import LOAD_FACTOR, Balancer
from llmgw.gateway.prefix import PREFIX_CHARS, prefix_key
from llmgw.gateway.routes import Endpoint
from llmgw.gateway.upstream import parse_target

CHAT = "/v1/chat/completions"


def eps(n: int) -> list[Endpoint]:
    return [Endpoint(f"replica-{i}", f"http://127.0.0.1:{9000 + i}", "n", parse_target(f"http://127.0.0.1:{9000 + i}"))
            for i in range(n)]


def chat(system: str, user: str) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def test_requests_alike_in_their_leading_characters_share_a_key():
    system = "You are a careful assistant. " * 60  # longer than PREFIX_CHARS
    assert prefix_key(CHAT, chat(system, "a"), None) == prefix_key(CHAT, chat(system, "b"), None)
    assert prefix_key(CHAT, chat("short", "a"), None) != prefix_key(CHAT, chat("short", "b"), None)
    assert prefix_key(CHAT, chat(system, "a"), "salt-1") != prefix_key(CHAT, chat(system, "a"), "salt-2")
    assert prefix_key(CHAT, chat(system, "a"), None) != prefix_key(CHAT, chat(system, "a"), "salt-1")
    comp = "/v1/completions"
    assert prefix_key(comp, {"prompt": system + "x"}, None) == prefix_key(comp, {"prompt": [system + "y", "z"]}, None)
    assert prefix_key(comp, {"prompt": list(range(1000))}, None) == prefix_key(comp, {"prompt": list(range(999)) + [5]}, None)


def test_any_shape_is_keyed_without_failing():
    odd = [None, 5, "text", {"role": 7, "content": {"a": 1}}, {"role": "user", "content": [
        "junk", {"type": "image_url", "image_url": {"url": "data:x"}}, {"type": "text", "text": 12}, {"text": "t"}]},
        {"role": "user", "content": "\udc80 lone surrogate"}]
    assert isinstance(prefix_key(CHAT, {"messages": odd}, None), int)
    for prompt in (None, 5, [], [[1, 2], [3]], [{"a": 1}], ["\udc80"], [True, 2]):
        assert isinstance(prefix_key("/v1/completions", {"prompt": prompt}, "s" * 10_000), int)


def test_the_key_reads_a_bounded_slice_of_a_huge_prompt():
    """Only the leading PREFIX_CHARS characters count: what follows (10 MB of it) changes nothing."""
    huge = "x" * 10_000_000
    assert prefix_key(CHAT, chat(huge, "u"), None) == prefix_key(CHAT, chat(huge[:PREFIX_CHARS], "v"), None)
    ids = list(range(1_000_000))
    assert prefix_key("/v1/completions", {"prompt": ids}, None) == prefix_key("/v1/completions", {"prompt": ids[:256]}, None)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "y" * 100}] * 100_000}] * 3
    assert prefix_key(CHAT, {"messages": msgs}, None) == prefix_key(CHAT, {"messages": msgs[:1]}, None)
    assert PREFIX_CHARS <= 4096


def test_one_key_goes_to_its_home_while_it_is_within_the_bound():
    b, e = Balancer(), eps(4)
    key = prefix_key(CHAT, chat("system prompt", "u"), None)
    first = b.pick(e, set(), 0, key)
    assert b.last.how == "new" and "a new prefix; homed on" in b.last.reason()
    assert all(b.pick(e, set(), 0, key) is first for _ in range(10))
    assert b.last.how == "home" and "its home " + first.replica_id in b.last.reason()
    # Another gateway homes a key it sees first alike: the rendezvous ranking breaks the tie.
    assert Balancer().pick(eps(4), set(), 0, key).replica_id == first.replica_id
    assert prefix_key(CHAT, chat("s", "u"), None, "m1") != prefix_key(CHAT, chat("s", "u"), None, "m2")


def test_few_hot_prefixes_get_even_homes():
    """Hashing alone gave 16 system prompts on 4 replicas homes of 6, 6, 4 and 0."""
    b, e = Balancer(), eps(4)
    for k in range(16):
        b.pick(e, set(), 0, prefix_key(CHAT, chat(f"system prompt {k} " * 100, "u"), None))
    assert sorted(b.held.values()) == [4, 4, 4, 4]


def test_a_busy_home_sends_one_request_elsewhere_and_keeps_the_prefix():
    b, e = Balancer(), eps(4)
    key = 12345
    home = b.pick(e, set(), 0, key)
    home.outstanding = 10  # mean with this request: 11 / 4 → bound ceil(1.25 × 2.75) = 4
    other = b.pick(e, set(), 0, key)
    assert other is not home and b.last.how == "overflow" and b.last.bound == 4
    assert "over the bound of 4" in b.last.reason() and b.homes[key] == home.replica_id
    home.outstanding = 0
    assert b.pick(e, set(), 0, key) is home


def test_a_home_that_left_is_replaced():
    b, e = Balancer(), eps(4)
    home = b.pick(e, set(), 0, 99)
    rest = [x for x in e if x is not home]
    new = b.pick(rest, set(), 0, 99)
    assert b.last.how == "rehomed" and home.replica_id in b.last.reason()
    assert b.homes[99] == new.replica_id and home.replica_id not in b.held


def test_no_replica_passes_the_bound_under_one_hot_key():
    b, e = Balancer(), eps(4)
    for n in range(1, 200):
        ep = b.pick(e, set(), 0, 99)
        ep.outstanding += 1
        assert max(x.outstanding for x in e) <= math.ceil(LOAD_FACTOR * n / 4), n
    assert min(x.outstanding for x in e) > 0  # the hot key overflowed


def test_the_homes_remembered_are_bounded(monkeypatch):
    import llmgw.gateway.balancer as balancer
    monkeypatch.setattr(balancer, "MAX_HOMES", 50)
    b, e = Balancer(), eps(3)
    rng = random.Random(7)
    for _ in range(500):
        b.pick(e, set(), 0, rng.getrandbits(64))
    assert len(b.homes) == 50 and sum(b.held.values()) == 50


def test_prefix_balancing_keeps_the_breakers_rules():
    b, e = Balancer(failures=1, open_s=10), eps(2)
    key = 777
    first = b.pick(e, set(), 0, key)
    b.failed(first, now=0)
    assert b.pick(e, set(), 1, key) is not first  # open: the key goes elsewhere
    second = b.homes[key]
    assert second != first.replica_id
    assert b.pick([first], set(), 11, key) is first and first.trial  # one endpoint: the plain path, half-open
    assert b.pick([first], set(), 11, key) is None  # one trial at a time
    assert b.pick(e, {e[0].replica_id, e[1].replica_id}, 0, key) is None

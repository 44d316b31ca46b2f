"""Reuse at the block through the shared tier: two stores ("instances") of one deployment
share a real redis-server and secret. What one saves (a full chunk with its aliases, a tail
record with its own) the other finds block by block: the aliases go to Redis as small
authenticated values, and a lookup asks for the partial keys of the first chunk it lacks in
the same pipelined round trip as the full chunks. A plain redis-py client (no secret)
rewriting or swapping alias values, or a secret holder's alias that names another namespace's
record or claims token counts that do not fit, is a miss counted like other forged values:
never served, never promoted."""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest
import redis
from conftest import Hosts
from redis_server import as_bytes
from test_blocks import ADAPTER, BASE, FMT, PER_TOKEN, prompt, read_found, save_request

from store import AdapterIdentity, Namespace, Store, boundary_keys, chain_hash
from store.tiers.remote import RemoteTier


def tier_of(s: Store) -> RemoteTier:
    assert s._sharing is not None
    return s._sharing.tier


def load(store: Store, ns: Namespace, tokens: list[int], block: int) -> tuple[int, list[bytes], int]:
    """What the connector would load (``test_blocks.load``: the tokens, each record read whole
    with its exact length), and the remote tier's round trips for the lookup."""
    calls = tier_of(store).stats().calls
    found = store.lookup(ns, tokens, block=block)
    trips = tier_of(store).stats().calls - calls
    end, records = read_found(store, found, tokens, block)
    return end, records, trips


def other_prompt(prefix: int, question: int, seed: int = 0) -> list[int]:
    """A prompt whose prefix shares no token with ``prompt``'s."""
    return [t + 50000 for t in prompt(prefix, question, seed)]


def alias_name(s: Store, ns: Namespace, tokens: list[int], chunk: int, n: int, block: int) -> str:
    """The Redis name of the alias value at boundary ``n`` of chunk ``chunk`` of ``tokens``."""
    keys = ns.chunk_keys(tokens)
    cs = FMT.chunk_size
    cands = dict(boundary_keys(ns, chain_hash(ns, keys, chunk), tokens[chunk * cs:(chunk + 1) * cs], block))
    return tier_of(s).alias_name(cands[n])


@pytest.mark.parametrize("encrypt", [False, True])
@pytest.mark.parametrize("block", [16, 128])
def test_a_second_instance_finds_a_short_prefix_through_redis_bit_exact(hosts: Hosts, block: int,
                                                                        encrypt: bool) -> None:
    """Issue 23 (b): instance A serves a 250-token prefix + question 1 (one full chunk, with
    aliases) and a 400-token prefix + question (a full chunk and a tail record); instance B,
    empty, with another question, gets each prefix down to its last block from Redis,
    bit-exact, in one round trip (two only where the partial chunk lies between full ones
    that only Redis holds), and records what it promoted with its aliases: the next lookup
    is local."""
    a = hosts("a", encrypt=encrypt)
    saved = save_request(a, ADAPTER, prompt(250, 6, seed=1), block)
    saved |= save_request(a, ADAPTER, other_prompt(400, 20, seed=3), block)
    r = hosts.redis.client()
    values = [as_bytes(r.get(n) or b"") for n in map(as_bytes, r.keys("test:*")) if n.endswith(b":a")]
    assert len(values) == (2 * 15 + 9 if block == 16 else 2)  # two chunks' boundaries and the tail's
    for v in values:  # no record key, no token count in clear: a name and value link to nothing
        assert not any(k in v or k[16:] in v for k in saved)

    cases = [(prompt(250, 23, seed=2), 250, 1),  # the partial chunk's keys with the full chunks'
             (other_prompt(400, 23, seed=2), 400, 1),  # those after the last full chunk too
             (other_prompt(400, 300, seed=2), 400, 2)]  # a partial chunk between full ones: a second trip
    for i, (q2, prefix, trips_expected) in enumerate(cases):
        b = hosts(f"b{i}", encrypt=encrypt)  # an empty instance
        end, records, trips = load(b, ADAPTER, q2, block)
        assert end == prefix // block * block, (prefix, block)
        assert trips == trips_expected
        for got in records:  # each record whole, as A saved it
            assert got in saved.values()
        # promoted with the aliases this lookup confirmed: found locally now
        local = b.lookup(ADAPTER, q2, remote=False, block=block)
        assert min(local.hit_tokens, (len(q2) - 1) // block * block) == end
        st = tier_of(b).stats()
        assert st.forged == st.foreign == st.torn == 0


def test_adapter_salt_and_fingerprint_isolate_instances(hosts: Hosts) -> None:
    """The same tokens in another namespace (the base model, another adapter digest, a salt,
    another fingerprint) find nothing of what A shared, at any block boundary."""
    a, b = hosts("a"), hosts("b")
    first = prompt(250, 6, seed=1)
    save_request(a, ADAPTER, first, 16)
    save_request(a, Namespace("m", FMT, ADAPTER.adapter, cache_salt="tenant-1", model_fingerprint="fp1"), first, 16)
    q2 = prompt(250, 23, seed=2)
    others = [BASE, Namespace("m", FMT, AdapterIdentity("civil", "cd" * 16), model_fingerprint="fp1"),
              Namespace("m", FMT, ADAPTER.adapter, cache_salt="tenant-2", model_fingerprint="fp1"),
              Namespace("m", FMT, ADAPTER.adapter, model_fingerprint="fp2")]
    for ns in others:
        found = b.lookup(ns, q2, block=16)
        assert found.hit_tokens == 0 and found.partial is None, ns
    salted = Namespace("m", FMT, ADAPTER.adapter, cache_salt="tenant-1", model_fingerprint="fp1")
    assert b.lookup(salted, q2, block=16).hit_tokens == 240  # its own tenant does find it
    assert b.lookup(ADAPTER, q2, block=16).hit_tokens == 240


def forged(s: Store) -> int:
    return tier_of(s).stats().forged


def test_rewritten_or_swapped_alias_values_are_forged_misses(hosts: Hosts) -> None:
    """A Redis client without the secret: a flipped bit, a value copied to another alias's
    name (another boundary, another namespace) or a head copied over an alias is a miss
    counted ``forged``; nothing is served or promoted. The chunk's own values still serve."""
    a, b = hosts("a"), hosts("b")
    first = prompt(250, 6, seed=1)
    save_request(a, ADAPTER, first, 16)
    save_request(a, BASE, first, 16)
    r: redis.Redis = hosts.redis.client()
    q2 = prompt(250, 23, seed=2)
    at = {n: alias_name(a, ADAPTER, first, 0, n, 16) for n in (224, 240)}
    # flip a bit of the longest alias: the lookup falls back to the next boundary, counted
    good = r.get(at[240])
    assert isinstance(good, bytes)
    r.set(at[240], good[:-1] + bytes([good[-1] ^ 1]))
    before = forged(b)
    found = b.lookup(ADAPTER, q2, block=16)
    assert forged(b) == before + 1
    assert found.partial is not None and found.partial.tokens == 224
    # swapped: the value of boundary 224 at 240's name, and the base model's at 224's
    r.set(at[240], r.get(at[224]) or b"")
    r.set(at[224], r.get(alias_name(a, BASE, first, 0, 224, 16)) or b"")
    before = forged(b)
    found = b.lookup(ADAPTER, q2, block=16)
    assert forged(b) == before + 2
    assert found.partial is not None and found.partial.tokens == 208
    # a chunk's head planted at an alias's name: another purpose, forged
    head = r.get(tier_of(a).head_key(ADAPTER.chunk_keys(first)[0]))
    r.set(at[240], head or b"")
    before = forged(b)
    b.lookup(ADAPTER, q2, block=16)
    assert forged(b) >= before + 1
    assert not list(b.iter_chunks())  # nothing promoted by lookups


def test_a_secret_holders_alias_that_does_not_fit_is_a_forged_miss_never_served(hosts: Hosts) -> None:
    """Aliases written with the secret whose claims do not fit: a record of another
    namespace, a token count other than the boundary's, a record larger than a chunk, or one
    that claims fewer tokens than the record holds (the record's read then misses on its
    length). Counted, never served, never promoted."""
    a, b = hosts("a"), hosts("b")
    first = prompt(250, 6, seed=1)
    save_request(a, ADAPTER, first, 16)
    save_request(a, BASE, first, 16)
    q2 = prompt(250, 23, seed=2)
    keys = ADAPTER.chunk_keys(first)
    cands = dict(boundary_keys(ADAPTER, chain_hash(ADAPTER, keys, 0), first[:256], 16))
    own = keys[0]
    other_ns = BASE.chunk_keys(first)[0]
    r: redis.Redis = hosts.redis.client()
    for n in range(16, 256, 16):  # only the alias at 240 is left, so each bad value is the lookup's answer
        if n != 240:
            r.delete(tier_of(a).alias_name(cands[n]))
    for target, tok, rec in ((other_ns, 240, 256), (own, 224, 256), (own, 240, 512)):
        assert tier_of(a).put_aliases([(cands[240], target, tok, rec)])
        before = forged(b)
        found = b.lookup(ADAPTER, q2, block=16)
        assert found.hit_tokens == 0 and found.partial is None, (tok, rec)
        assert forged(b) == before + 1
    # fewer tokens than the record holds: the lookup believes it, the read refuses the length
    assert tier_of(a).put_aliases([(cands[240], own, 240, 248)])
    found = b.lookup(ADAPTER, q2, block=16)
    assert found.partial is not None and found.partial.record_tokens == 248
    out = bytearray(FMT.chunk_bytes)
    assert b.get_many_into([own], [out], expect=[248 * PER_TOKEN]) == [None]
    assert tier_of(b).stats().foreign >= 1
    assert not list(b.iter_chunks()) and b.lookup(ADAPTER, q2, remote=False, block=16).hit_tokens == 0


def test_without_a_secret_all_writers_share_aliases_and_a_damaged_one_is_torn(hosts: Hosts) -> None:
    """``trust = "all-writers"``: aliases are shared with checksums against accidents only."""
    a = hosts("a", secret_file=None, trust="all-writers")
    b = hosts("b", secret_file=None, trust="all-writers")
    first = prompt(250, 6, seed=1)
    save_request(a, ADAPTER, first, 16)
    q2 = prompt(250, 23, seed=2)
    end, _, _ = load(b, ADAPTER, q2, 16)
    assert end == 240
    r: redis.Redis = hosts.redis.client()
    name = alias_name(a, ADAPTER, first, 0, 240, 16)
    good = r.get(name)
    assert isinstance(good, bytes)
    r.set(name, good[:-9] + bytes([good[-9] ^ 1]) + good[-8:])
    c = hosts("c", secret_file=None, trust="all-writers")
    found = c.lookup(ADAPTER, q2, block=16)
    assert found.partial is not None and found.partial.tokens == 224
    assert tier_of(c).stats().torn == 1


def test_a_frozen_server_costs_a_miss_within_the_lookup_deadline(hosts: Hosts) -> None:
    """A stalled server: the lookup at the block returns the local answer within its
    deadline, and the breaker then answers at once."""
    a = hosts("a")
    b = hosts("b", lookup_timeout_s=0.05)
    first = prompt(250, 6, seed=1)
    save_request(a, ADAPTER, first, 16)
    q2 = prompt(250, 23, seed=2)
    srv: Any = hosts.redis
    srv.signal(signal.SIGSTOP)
    try:
        for _ in range(4):
            t0 = time.monotonic()
            found = b.lookup(ADAPTER, q2, block=16)
            assert time.monotonic() - t0 < 1.0
            assert found.hit_tokens == 0
    finally:
        srv.signal(signal.SIGCONT)
    st = tier_of(b).stats()
    assert st.timeouts >= 1 and st.short_circuited >= 1

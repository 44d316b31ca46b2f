"""The connector's KV events (engine_hook/announce.py) on a real store, without an engine:
what a save, a promotion, a removal by another process and a restart announce, encoded
and decoded with vLLM's own event classes as its publisher sends them. The same events
reach a real router index in tests/test_router_index.py."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from conftest import env_with_path
from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from engine_hook.announce import LOG_KEYS, Announcer, BlockHash, Cleared, Record, Removed, Stored
from engine_hook.vllm import to_vllm_event
from store import KVFormat, Namespace, PutItem, Store, StoreConfig, TierConfig
from store.config import GiB, MiB

FMT = KVFormat("float32", num_layers=1, num_kv_heads=1, head_dim=4, chunk_size=256)
BS = 128  # the engine's block size: two blocks per chunk
NS = Namespace("m", FMT)
OTHER = Namespace("other-model", FMT)


def tokens(seed: int, n: int = 256 * 3) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 50_000) for _ in range(n)]


@pytest.fixture
def store(tmp_path: Path) -> Any:
    cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=1 * GiB),
                             "dram": TierConfig(capacity=64 * MiB, path=str(tmp_path / "dram"))})
    s = Store(tmp_path / "store", cfg)
    yield s
    s.close()


def put(s: Store, keys: list[bytes]) -> None:
    s.put_many([PutItem(k, os.urandom(FMT.chunk_bytes), {"dtype": "float32"}, 256) for k in keys])


def hashes(seed: int, n: int) -> list[BlockHash]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(n)]


def announcer(s: Store, ns_ids: set[bytes] | None = None, first: bool = True, **kw: Any) -> Announcer:
    """An engine's announcer on ``s``; with ``first``, its first step taken (it says that the
    engine holds nothing: AllBlocksCleared)."""
    ours = (lambda nid: True) if ns_ids is None else ns_ids.__contains__
    a = Announcer(s, ours, BS, 256, **{"poll_s": 0.0, "write_s": 0.0, "reannounce_delay_s": 0.0, **kw})
    if first:
        assert wire(a.take()) == [AllBlocksCleared()]
    return a


def save_chain(a: Announcer, ns: Namespace, toks: list[int], seed: int, lora: str | None = None) -> list[bytes]:
    """Announce a prompt's chunks as the scheduler does when it plans their saves."""
    keys = ns.chunk_keys(toks)
    h = hashes(seed, 2 * len(keys))
    for c, k in enumerate(keys):
        a.saving(k, c, h[2 * c : 2 * c + 2], h[2 * c - 1] if c else None, toks[256 * c : 256 * (c + 1)], lora)
    return keys


def vllm_event(e: Stored | Removed | Cleared) -> BlockStored | BlockRemoved | AllBlocksCleared:
    """``to_vllm_event``'s event (typed as vLLM's base class): one of those a batch holds."""
    v = to_vllm_event(e)
    assert isinstance(v, (BlockStored, BlockRemoved, AllBlocksCleared)), v
    return v


def wire(events: list[Any]) -> list[Any]:
    """Events through vLLM's wire format: msgpack of a KVEventBatch, decoded by its class."""
    batch = KVEventBatch(ts=time.time(), events=[vllm_event(e) for e in events])
    payload = msgspec.msgpack.Encoder().encode(batch)
    return list(msgspec.msgpack.Decoder(type=KVEventBatch).decode(payload).events)


def test_a_saved_chain_is_announced_in_vllms_format(store: Store) -> None:
    a = announcer(store)
    toks = tokens(1)
    keys = save_chain(a, NS, toks, seed=1, lora="civil")
    put(store, keys)
    got = wire(a.take())
    assert [type(e) for e in got] == [BlockStored] * 3
    h = hashes(1, 6)
    for c, e in enumerate(got):
        assert e.block_hashes == h[2 * c : 2 * c + 2] and e.token_ids == toks[256 * c : 256 * (c + 1)]
        assert e.parent_block_hash == (h[2 * c - 1] if c else None)
        assert e.block_size == BS and e.lora_name == "civil" and e.lora_id is None
        assert e.medium == MEDIUM_STORAGE and e.locality == "LOCAL"
        assert e.extra_keys is None  # nothing else, and never a cache salt
    assert a.take() == []  # once
    # the announcement is logged for `lmctl events --kind announce` and kept for a restart
    ev = store.events(kinds=["announce"])
    assert [(e["reason"], e["chunks"]) for e in ev] == [("stored", 3)]
    assert set(store.announcement_of(keys)) == set(keys)


def test_a_chunk_removed_by_another_process_is_announced_removed(store: Store, tmp_path: Path) -> None:
    a = announcer(store)
    keys = save_chain(a, NS, tokens(2), seed=2)
    put(store, keys)
    a.take()
    # another process on the store (the daemon's eviction, `lmctl evict`)
    code = ("import sys; from store import Store; s = Store(sys.argv[1]); "
            "print(s.evict([bytes.fromhex(k) for k in sys.argv[2:]]).chunks); s.close()")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "store"), *(k.hex() for k in keys[1:])],
                       capture_output=True, text=True, env=env_with_path(), timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "2", r.stderr
    assert a.pending()  # news in the log: an engine without requests steps to announce it
    got = wire(a.take())
    assert [type(e) for e in got] == [BlockRemoved, BlockRemoved]
    h = hashes(2, 6)
    assert sorted(map(tuple, (e.block_hashes for e in got))) == sorted([tuple(h[2:4]), tuple(h[4:6])])
    assert all(e.medium == MEDIUM_STORAGE and e.locality == "LOCAL" for e in got)
    assert set(store.announcement_of(keys)) == {keys[0]}  # their records are gone
    assert a.take() == []
    assert not a.pending()


def test_a_dropped_save_is_announced_removed(store: Store) -> None:
    a = announcer(store)
    keys = save_chain(a, NS, tokens(3, 256), seed=3)
    assert [type(e) for e in a.take()] == [Stored]  # announced when planned
    store.record_dropped_saves([(keys[0], "queue-full")])
    got = a.take()
    assert [type(e) for e in got] == [Removed]
    assert isinstance(got[0], Removed) and got[0].block_hashes == hashes(3, 2)


def test_what_was_announced_is_written_in_batches(store: Store) -> None:
    """One store transaction and one logged event per reason per ``write_s``, not per step: a
    busy engine does not push evictions out of the bounded event log."""
    now = [0.0]
    a = announcer(store, write_s=5.0, clock=lambda: now[0])
    keys = save_chain(a, NS, tokens(6), seed=6) + save_chain(a, NS, tokens(7), seed=7)
    put(store, keys)
    assert len(a.take()) == 6
    now[0] = 1.0
    store.evict(keys[:1])
    assert [type(e) for e in a.take()] == [Removed]
    assert store.events(kinds=["announce"]) == [] and store.announcement_of(keys) == {}
    now[0] = 5.0
    a.take()
    ev = store.events(kinds=["announce"])
    assert sorted((e["reason"], e["chunks"]) for e in ev) == [("removed", 1), ("stored", 6)]
    assert set(store.announcement_of(keys)) == set(keys[1:])
    save_chain(a, NS, tokens(8, 256), seed=8)
    a.take()
    a.flush()  # at the engine's shutdown
    assert len(store.events(kinds=["announce"])) == 3
    # an event counts every chunk but names at most LOG_KEYS of them (the log stays small)
    many = [save_chain(a, NS, tokens(1000 + i), seed=1000 + i) for i in range(30)]
    a.take()
    a.flush()
    last = store.events(kinds=["announce"])[-1]
    assert last["chunks"] == 90 and len(store.event_keys(last["seq"])) == LOG_KEYS
    assert len(store.announcement_of([k for c in many for k in c])) == 90


def test_a_save_that_never_arrives_is_announced_removed(store: Store) -> None:
    now = [0.0]
    a = announcer(store, verify_s=10.0, clock=lambda: now[0])
    save_chain(a, NS, tokens(4, 256), seed=4)
    a.take()
    now[0] = 9.0
    assert a.take() == []
    now[0] = 11.0
    assert [type(e) for e in a.take()] == [Removed]


def test_a_promoted_chunk_is_announced_in_its_new_tier(store: Store) -> None:
    a = announcer(store)
    keys = save_chain(a, NS, tokens(5, 256), seed=5)
    put(store, keys)
    a.take()
    a.loaded(keys)
    assert a.take() == []  # still in nvme: nothing new
    store.rewrite(keys, tier="dram")
    a.loaded(keys)
    got = wire(a.take())
    assert [(type(e), e.medium, e.locality) for e in got] == [(BlockStored, MEDIUM_CPU, "LOCAL")]
    # removed later: from every medium it was announced in
    store.evict(keys)
    got = wire(a.take())
    assert sorted(e.medium for e in got) == [MEDIUM_CPU, MEDIUM_STORAGE]


def test_chunks_a_drain_copied_to_the_remote_tier_are_announced_there_too(store: Store) -> None:
    """``lmctl drain`` (another process) logs the chunks it copied to the shared tier: routers
    learn that they are held remotely as well, once, beside the local copy."""
    a = announcer(store)
    keys = save_chain(a, NS, tokens(9), seed=9)
    put(store, keys)
    a.take()
    store.log_remote_copies(keys[:2], 2 * FMT.chunk_bytes)  # as the daemon's drain does, per batch
    assert a.pending()
    got = wire(a.take())
    h = hashes(9, 6)
    assert [(type(e), e.medium, e.locality, e.block_hashes) for e in got] == [
        (BlockStored, MEDIUM_STORAGE, "REMOTE", h[0:2]), (BlockStored, MEDIUM_STORAGE, "REMOTE", h[2:4])]
    assert got[1].parent_block_hash == h[1] and got[1].token_ids == tokens(9)[256:512]
    store.log_remote_copies(keys[:1], FMT.chunk_bytes)  # copied again: nothing new to say
    assert a.take() == []
    store.evict(keys[:1])  # the local copy leaves: removed from both media it was announced in
    got = wire(a.take())
    assert sorted((e.medium, e.locality) for e in got) == [(MEDIUM_STORAGE, "LOCAL"), (MEDIUM_STORAGE, "REMOTE")]


def test_a_loaded_chunk_no_engine_announced_is_announced_by_the_loader_and_recorded(store: Store) -> None:
    """Chunks another instance saved into the shared tier, or `lmctl warm` brought in, have no
    record here: the engine that loads them announces them where they are, by its own hashes,
    and keeps the record for its re-announce after a restart."""
    toks = tokens(11)
    keys = NS.chunk_keys(toks)
    put(store, keys)  # in the store, announced by no engine
    a = announcer(store)
    a.loaded(keys)  # without a description: nothing to announce them by
    assert a.take() == []
    h = hashes(11, 6)
    recs = [(c, Record(h[2 * c : 2 * c + 2], h[2 * c - 1] if c else None, toks[256 * c : 256 * (c + 1)], BS,
                       "civil")) for c in range(3)]
    a.loaded(keys, recs)
    got = wire(a.take())
    assert [(type(e), e.block_hashes, e.lora_name, e.medium) for e in got] == [
        (BlockStored, h[2 * c : 2 * c + 2], "civil", MEDIUM_STORAGE) for c in range(3)]
    a.loaded(keys, recs)
    assert a.take() == []  # once
    a.flush()
    assert set(store.announcement_of(keys)) == set(keys)  # re-announced after a restart
    got = wire(announcer(store, first=False).take())  # a restart: cleared, then what the store holds
    assert isinstance(got[0], AllBlocksCleared)
    assert [e.block_hashes for e in got if isinstance(e, BlockStored)] == [h[0:2], h[2:4], h[4:6]]


def test_a_restarted_engine_reannounces_roots_first_in_bounded_batches(store: Store) -> None:
    a = announcer(store)
    chains = [save_chain(a, NS, tokens(10 + i), seed=10 + i, lora="civil" if i % 2 else None) for i in range(5)]
    foreign = save_chain(a, OTHER, tokens(99), seed=99)
    put(store, [k for c in chains for k in c] + foreign)
    a.take()
    store.evict(chains[4])  # gone while no engine listened (the log says so, nobody reads it)
    # a new engine: only its own namespaces, four chunks per step
    now = [0.0]
    b = announcer(store, {NS.ns_id}, first=False, batch=4, reannounce_delay_s=3.0, clock=lambda: now[0])
    # subscribers of the previous run reconnect meanwhile; the engine steps without requests
    assert b.reannouncing and b.pending() and b.take() == [Cleared()]  # the engine holds nothing yet
    assert b.take() == []
    now[0] = 3.0
    steps = []
    while b.reannouncing:
        steps.append(b.take())
        assert len(steps) < 20
    # said again, for subscribers that were not back at the first step
    assert isinstance(steps[0][0], Cleared)
    steps[0] = steps[0][1:]
    assert all(len(s) <= 4 for s in steps)
    got = [e for s in steps for e in s]
    assert all(isinstance(e, Stored) for e in got)
    assert len(got) == 12  # 4 chains of 3 chunks: not the evicted chain, not the other model's
    seen: set[Any] = set()
    for e in got:  # every parent before its child
        assert e.parent_block_hash is None or e.parent_block_hash in seen
        seen.update(e.block_hashes)
    assert [e.parent_block_hash is None for e in got[:4]] == [True] * 4
    assert {e.lora_name for e in got} == {"civil", None}
    assert set(store.announcement_of(chains[4])) == set()  # records of gone chunks are dropped
    logged = [e for e in store.events(kinds=["announce"]) if e["reason"] == "reannounced"]
    assert sum(e["chunks"] for e in logged) == 12  # written every step here (write_s 0)
    assert sum(len(store.event_keys(e["seq"])) for e in logged) == 12


def test_hostile_records_are_skipped(store: Store) -> None:
    keys = NS.chunk_keys(tokens(20))
    put(store, keys)
    good = Record(hashes(1, 2), None, tokens(20, 256), BS, None).encode()
    bad = [b"\xff" * 10, b"[]", b'{"v":1}', good.replace(b'"b":128', b'"b":64'),
           good.replace(b'"t":[', b'"t":[-1,'), b'{"v":1,"h":[1,2],"p":null,"t":' + b"[1]" + b',"b":128,"l":null}']
    store.announced(note=[(keys[0], 0, bad[0]), (keys[1], 1, bad[1]), (keys[2], 2, bad[2])])
    k2 = NS.chunk_keys(tokens(21))
    put(store, k2)
    store.announced(note=[(k2[0], 0, bad[3]), (k2[1], 1, bad[4]), (k2[2], 2, bad[5])])
    b = announcer(store, {NS.ns_id})
    assert b.take() == [] and not b.reannouncing
    assert Record.decode(good, BS, 256) is not None

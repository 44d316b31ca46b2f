"""Reuse at the engine's block granularity: a request's partial last chunk (its tail) is a
record of its whole blocks, and the block boundaries inside a record are index aliases, so
that a lookup finds the longest cached prefix block by block, while bytes still move as whole
records. Real LMDB and segment files throughout."""

from __future__ import annotations

import hashlib
import json
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from store import (
    AdapterIdentity,
    KVFormat,
    LookupResult,
    Namespace,
    PutItem,
    Store,
    StoreError,
    boundary_keys,
    chain_hash,
    record_key,
)
from store.index.schema import alias_row, pack_alias

MakeStore = Callable[..., Store]
DATA = Path(__file__).parent / "data"
FMT = KVFormat("float32", num_layers=2, num_kv_heads=1, head_dim=8, chunk_size=256)
PER_TOKEN = FMT.chunk_bytes // FMT.chunk_size
CIVIL = AdapterIdentity("civil", "ab" * 16)
BASE = Namespace("m", FMT, model_fingerprint="fp1")
ADAPTER = Namespace("m", FMT, CIVIL, model_fingerprint="fp1")


def payload(key: bytes, tokens: int) -> bytes:
    """A record's bytes, unique to its key."""
    return hashlib.shake_256(key).digest(tokens * PER_TOKEN)


def layout(tokens: int) -> dict[str, object]:
    return {"dtype": FMT.dtype, "shape": [FMT.num_layers, 2, tokens, FMT.num_kv_heads, FMT.head_dim]}


def save_request(store: Store, ns: Namespace, tokens: list[int], block: int) -> dict[bytes, bytes]:
    """Save a request's prompt as the connector does: every full chunk with its aliases, and
    the tail's whole blocks as a partial record with its own. Returns key -> bytes."""
    keys = ns.chunk_keys(tokens)
    cs = FMT.chunk_size
    items = []
    for c in range(len(keys)):
        k, aliases = record_key(ns, keys, tokens, c, block)
        assert k == keys[c]
        items.append(PutItem(k, payload(k, cs), layout(cs), cs, aliases=aliases))
    tail = (len(tokens) - len(keys) * cs) // block * block
    if tail:
        k, aliases = record_key(ns, keys, tokens, len(keys), block, tail)
        items.append(PutItem(k, payload(k, tail), layout(tail), tail, aliases=aliases))
    assert all(store.put_many(items))
    return {it.key: bytes(it.data) for it in items}


def load(store: Store, ns: Namespace, tokens: list[int], block: int) -> tuple[int, list[bytes]]:
    """Look up and read what the connector would load: the hit tokens (rounded down to a
    block, the last token always computed) and each record read, with its exact length."""
    return read_found(store, store.lookup(ns, tokens, block=block), tokens, block)


def read_found(store: Store, found: LookupResult, tokens: list[int], block: int) -> tuple[int, list[bytes]]:
    """Read what ``found`` (a lookup of ``tokens``) lets the connector load: the hit tokens
    rounded down to a block, the last token always computed, and each record read whole."""
    end = min(found.hit_tokens, (len(tokens) - 1) // block * block)
    cs = FMT.chunk_size
    want_keys, want_len = [], []
    for c in range(-(-end // cs)):
        if c < found.hit_chunks:
            want_keys.append(found.keys[c])
            want_len.append(FMT.chunk_bytes)
        else:
            assert found.partial is not None and found.partial.chunk == c
            want_keys.append(found.partial.key)
            want_len.append(found.partial.record_tokens * PER_TOKEN)
    outs = [bytearray(FMT.chunk_bytes) for _ in want_keys]
    infos = store.get_many_into(want_keys, outs, expect=want_len)
    assert all(i is not None for i in infos)
    return end, [bytes(o[:n]) for o, n in zip(outs, want_len, strict=True)]


def prompt(prefix: int, question: int, seed: int = 0) -> list[int]:
    return list(range(1000, 1000 + prefix)) + list(range(20000 + 100 * seed, 20000 + 100 * seed + question))


@pytest.mark.parametrize("block", [16, 128])
@pytest.mark.parametrize("prefix", [250, 350])
def test_a_short_fixed_prefix_is_cached_to_its_last_block_after_a_restart(
        make_store: MakeStore, tmp_path: Path, block: int, prefix: int) -> None:
    """Issue 23's workload: a fixed prefix (250 or 350 tokens) and a question. After the
    first request and a restart, a request with another question gets at least 90% of the
    prefix (rounded down to the block) from the store, bit-exact."""
    s = make_store()
    first = prompt(prefix, 20, seed=1)
    saved = save_request(s, ADAPTER, first, block)
    s.close()
    s = make_store()  # a restart: the index is the truth
    second = prompt(prefix, 23, seed=2)
    end, records = load(s, ADAPTER, second, block)
    floor = prefix // block * block
    assert end >= 0.9 * floor and end <= floor
    assert end == {(250, 16): 240, (250, 128): 128, (350, 16): 336, (350, 128): 256}[(prefix, block)]
    for got in records:  # each record, whole, as it was saved: the engine takes its first blocks
        assert got in saved.values()
    # the same prompt again finds everything but its last, partial block
    end, _ = load(s, ADAPTER, first, block)
    assert end == (len(first) - 1) // block * block


def test_the_keys_at_block_boundaries_are_the_chain_through_each_block() -> None:
    toks = list(range(600))
    keys = BASE.chunk_keys(toks)
    inner = boundary_keys(BASE, chain_hash(BASE, keys, 1), toks[256:512], 16)
    assert [n for n, _k in inner] == list(range(16, 257, 16))
    assert inner[-1][1] == keys[1]  # through the chunk's last block: the chunk's own key
    one_shot = hashlib.sha256(keys[0][16:] + b"".join(t.to_bytes(4, "little") for t in toks[256:256 + 48]))
    assert inner[2][1] == BASE.ns_id + one_shot.digest()
    # another block size meets the same key at the same token
    assert dict(boundary_keys(BASE, chain_hash(BASE, keys, 1), toks[256:512], 128))[128] == dict(inner)[128]
    with pytest.raises(StoreError):
        record_key(BASE, keys, toks, 2, 16, 100)  # not whole blocks


@pytest.mark.parametrize("block", [16, 128])
def test_partial_records_and_aliases_never_cross_adapters_salts_or_fingerprints(
        make_store: MakeStore, block: int) -> None:
    """A tail and an alias saved under adapter A are found for A only, also after a restart:
    never for adapter B, the base model, a salted tenant or another fingerprint."""
    s = make_store()
    first = prompt(250, 120, seed=1)  # a full chunk (aliases) and a tail record
    save_request(s, ADAPTER, first, block)
    second = prompt(250, 30, seed=2)
    others = [Namespace("m", FMT, AdapterIdentity("other", "cd" * 16), model_fingerprint="fp1"),
              Namespace("m", FMT, AdapterIdentity("civil", "ef" * 16), model_fingerprint="fp1"),  # new weights
              BASE,
              Namespace("m", FMT, CIVIL, cache_salt="tenant-1", model_fingerprint="fp1"),
              Namespace("m", FMT, CIVIL, model_fingerprint="fp2")]
    for _restart in range(2):
        assert s.lookup(ADAPTER, second, block=block).hit_tokens > 0
        assert s.lookup(ADAPTER, first, block=block).hit_tokens == 256 + 120 // block * block
        for ns in others:
            for toks in (first, second):
                found = s.lookup(ns, toks, block=block)
                assert (found.hit_tokens, found.partial) == (0, None), ns
        s.close()
        s = make_store()


def test_an_alias_goes_with_its_chunk_and_survives_a_move(make_store: MakeStore) -> None:
    s = make_store()
    first = prompt(250, 20, seed=1)
    saved = save_request(s, BASE, first, 16)
    second = prompt(250, 40, seed=2)
    target = BASE.chunk_keys(first)[0]
    found = s.lookup(BASE, second, block=16)
    assert found.partial is not None and (found.partial.key, found.partial.tokens) == (target, 240)
    s.rewrite([target], codec="zstd")  # re-encoded: a new record, the same key, the same aliases
    end, records = load(s, BASE, second, 16)
    assert end == 240 and records == [saved[target]]
    s.evict([target])
    assert s.lookup(BASE, second, block=16).partial is None
    with s._index.read() as t:  # every alias row went with the chunk
        assert list(t.keys("aliases")) == []


def test_hostile_alias_rows_and_partial_records_are_misses(make_store: MakeStore) -> None:
    """Rows another writer could have planted in the index: an alias into another namespace,
    with another token count, malformed, to a missing chunk; a tail whose entry claims other
    tokens; a record longer than its tail. Each is a miss, never another request's KV."""
    s = make_store()
    first = prompt(250, 20, seed=1)
    save_request(s, BASE, first, 16)
    other = save_request(s, ADAPTER, prompt(250, 20, seed=5), 16)
    second = prompt(250, 40, seed=2)
    keys = BASE.chunk_keys(second)
    inner = dict((n, k) for n, k in boundary_keys(BASE, chain_hash(BASE, keys, 0), second[:256], 16))

    def plant(rows: dict[bytes, bytes]) -> None:
        def fn(t):  # type: ignore[no-untyped-def]
            for k in [k for k in t.keys("aliases")]:
                t.delete("aliases", k)
            for k, v in rows.items():
                t.put("aliases", k, v)
        s._index.write(fn)

    foreign = next(iter(other))  # a chunk of the adapter's namespace
    for rows in ({alias_row(inner[240]): pack_alias(foreign, 240)},        # another namespace's chunk
                 {alias_row(inner[240]): pack_alias(BASE.chunk_keys(first)[0], 224)},  # other tokens
                 {alias_row(inner[240]): b"\x00" * 7},                      # not a row of ours
                 {alias_row(inner[240]): pack_alias(BASE.ns_id + b"\x01" * 32, 240)}):  # nothing there
        plant(rows)
        assert s.lookup(BASE, second, block=16).partial is None
    plant({})
    # a tail record under a partial key that claims to hold more tokens than its key says
    k, _ = record_key(BASE, keys, second, 0, 16, 240)
    assert s.put(k, payload(k, 256), layout(256), 256)
    assert s.lookup(BASE, second, block=16).partial is None
    # a tail record whose bytes are longer than its tokens: the exact length is asked, a miss
    k2, _ = record_key(BASE, keys, second, 0, 16, 224)
    assert s.put(k2, payload(k2, 256), layout(224), 224)
    found = s.lookup(BASE, second, block=16)
    assert found.partial is not None and found.partial.key == k2
    out = bytearray(FMT.chunk_bytes)
    assert s.get_many_into([k2], [out], expect=[224 * PER_TOKEN]) == [None]
    assert not s.contains(k2)  # dropped and counted: it can never be right


def test_a_put_refuses_aliases_outside_its_namespace_or_its_tokens(make_store: MakeStore) -> None:
    s = make_store()
    toks = prompt(256, 0)
    k, aliases = record_key(BASE, BASE.chunk_keys(toks), toks, 0, 16)
    foreign = ADAPTER.ns_id + aliases[0][0][16:]
    for bad in ([(foreign, 16)], [(aliases[0][0], 256)], [(aliases[0][0], 0)], [("x", 16)]):
        with pytest.raises(StoreError, match="alias"):
            s.put_many([PutItem(k, payload(k, 256), layout(256), 256, aliases=bad)])  # type: ignore[arg-type]
    assert not s.contains(k)


def test_a_store_written_before_block_reuse_opens_and_serves(tmp_path: Path) -> None:
    """tests/data/store-main-chunks.tar.gz was written by the lmctl before reuse at block
    granularity (full 256-token chunks only; no ``aliases`` sub-database): a 250-token prefix
    with a question and a 600-token document, for the base model (pinned) and an adapter.
    Read-only and then writable, it serves every chunk bit-exact; once written to, its new
    chunks get aliases and tails like any other."""
    with tarfile.open(DATA / "store-main-chunks.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    expect = json.loads((tmp_path / "expect.json").read_text())
    base = Namespace("old-model", FMT, model_fingerprint="fp1")
    civil = Namespace("old-model", FMT, CIVIL, model_fingerprint="fp1")
    req = list(range(1000, 1250)) + list(range(5000, 5020))
    doc = list(range(7000, 7600))

    def old_payload(k: bytes) -> bytes:
        return hashlib.shake_256(k).digest(FMT.chunk_bytes)

    for readonly in (True, False):
        with Store(tmp_path / "store", readonly=readonly) as s:
            for name, ns in (("base", base), ("civil", civil)):
                keys = ns.chunk_keys(req) + ns.chunk_keys(doc)
                assert [k.hex() for k in keys] == expect["keys"][name]
                assert s.lookup(ns, doc, block=16).hit_tokens == 512
                assert s.lookup(ns, req, block=16).hit_tokens == 256
                assert s.lookup(ns, prompt(250, 9), block=16).hit_tokens == 0  # no aliases then
                for k in keys:
                    c = s.get(k)
                    assert c is not None and bytes(c.data) == old_payload(k)
            assert len(s.labels()["doc"]) == 2
    with Store(tmp_path / "store") as s:
        new = list(range(1000, 1250)) + list(range(8000, 8100))
        saved = save_request(s, base, new, 16)
        end, records = load(s, base, list(range(1000, 1250)) + list(range(9000, 9030)), 16)
        assert end == 240 and records[0] in saved.values()
        assert [p for p in s.check(deep=True) if not p.fixed] == []


def test_lmctl_lookup_reports_a_partial_hit_through_the_daemon(tmp_path: Path) -> None:
    """``lmctl lookup`` counts the leading blocks of the chunk after the cached ones, says
    which record holds them, and stays truthful for another adapter (nothing)."""
    from test_daemon import Daemon, cj

    path = tmp_path / "store"
    with Store(path) as s:
        for ns in (BASE, ADAPTER):
            s.register_namespace(ns)
        save_request(s, ADAPTER, prompt(250, 20, seed=1), 16)
    doc = tmp_path / "doc.json"
    doc.write_text(json.dumps(prompt(250, 21, seed=2)))
    d = Daemon(path)
    d.start()
    try:
        r = cj(d, "lookup", "--tokens", str(doc), "--model", "m", "--adapter", str(CIVIL))
        assert (r["hit_tokens"], r["hit_chunks"], r["first_miss"]) == (240, 0, 240)
        assert r["partial"] == {"chunk": 0, "tokens": 240, "tier": "nvme", "key": ADAPTER.chunk_keys(
            prompt(250, 20, seed=1))[0].hex(), "record_tokens": 256, "via": "alias"}
        r = cj(d, "lookup", "--tokens", str(doc), "--model", "m", "--base")
        assert (r["hit_tokens"], r["partial"]) == (0, None)
    finally:
        d.stop()

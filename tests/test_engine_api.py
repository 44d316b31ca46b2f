"""The engine side without an engine: paged-layout copies, the background writer, and the
engine-agnostic API, all on a real store."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
from conftest import flip_byte

from engine_hook.api import KVCacheClient
from engine_hook.identity import AdapterCache
from engine_hook.transfer import ChunkWriter, PagedKV, StagingPool, chunk_tensor
from store import KVFormat, Store, StoreError

FMT = KVFormat("float32", num_layers=3, num_kv_heads=2, head_dim=8, chunk_size=32)
BS = 16
NB = 10


def reference_tokens(layer_kv: torch.Tensor, layout: str) -> torch.Tensor:
    """[blocks, 2, block_size, H, D] from a layer tensor, by explicit indexing (not views)."""
    h, d = FMT.num_kv_heads, FMT.head_dim
    out = torch.empty(NB, 2, BS, h, d)
    for b in range(NB):
        for n in range(BS):
            for hh in range(h):
                if layout == "BHNC":
                    out[b, 0, n, hh] = layer_kv[b, hh, n, :d]
                    out[b, 1, n, hh] = layer_kv[b, hh, n, d:]
                elif layout == "2BNHD":
                    out[b, :, n, hh] = layer_kv[:, b, n, hh]
                elif layout == "B2NHD":
                    out[b, :, n, hh] = layer_kv[b, :, n, hh]
                else:
                    out[b, :, n, hh] = layer_kv[b, :, hh, n]
    return out


SHAPES = {
    "BHNC": (NB, 2, BS, 16),
    "2BNHD": (2, NB, BS, 2, 8),
    "B2NHD": (NB, 2, BS, 2, 8),
    "B2HND": (NB, 2, 2, BS, 8),
}


@pytest.mark.parametrize("layout", list(SHAPES))
def test_gather_and_scatter_follow_each_layout(layout: str) -> None:
    torch.manual_seed(0)
    layers = [torch.randn(SHAPES[layout]) for _ in range(FMT.num_layers)]
    if layout == "BHNC":  # physical order differs from the logical one, as on some backends
        layers = [t.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3) for t in layers]
    paged = PagedKV(layers, FMT, BS, layout=None if layout != "B2NHD" else "B2NHD")
    assert paged.layout == layout
    blocks = [7, 2]  # a chunk's blocks, in token order
    out = torch.empty(FMT.chunk_shape)
    paged.gather(blocks, out)
    for li, t in enumerate(layers):
        ref = reference_tokens(t, layout)
        want = torch.cat([ref[7], ref[2]], dim=1)  # [2, 32, H, D]
        assert torch.equal(out[li], want)
    # scatter into other blocks, skipping one that the engine already holds
    before = [t.clone() for t in layers]
    paged.scatter(out * 2, [4, None])
    for li, t in enumerate(layers):
        ref = reference_tokens(t, layout)
        assert torch.equal(ref[4], reference_tokens(before[li], layout)[7] * 2)
        for b in range(NB):
            if b != 4:
                assert torch.equal(ref[b], reference_tokens(before[li], layout)[b])


def test_unrecognised_layout_is_a_clear_error() -> None:
    with pytest.raises(StoreError, match="kv_layout"):
        PagedKV([torch.zeros(NB, 3, BS, 16)] * FMT.num_layers, FMT, BS)


class _SlowStore:
    """Fault injection: a store whose writes block until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.written: list[bytes] = []

    def save_many(self, items: list) -> list[str]:  # type: ignore[type-arg]
        self.release.wait(10)
        self.written.extend(it.key for it in items)
        return ["stored"] * len(items)


def test_writer_drops_and_counts_when_its_buffers_are_full() -> None:
    pool = StagingPool(4096, 2)
    slow = _SlowStore()
    writer = ChunkWriter(slow, pool)  # type: ignore[arg-type]
    taken = 0
    for i in range(5):
        buf = pool.acquire()
        if buf is None:
            writer.drop()
            continue
        taken += 1
        writer.submit(bytes([i]) * 48, buf, {"dtype": "uint8", "shape": [4096]}, 1)
    assert taken == 2 and writer.stats.dropped == 3
    slow.release.set()
    assert writer.flush(10)
    assert writer.stats.saved == 2 and len(slow.written) == 2
    assert pool.acquire() is not None and pool.acquire() is not None  # buffers came back
    writer.close()


def test_staging_buffers_are_page_aligned() -> None:
    pool = StagingPool(FMT.chunk_bytes, 3)
    for _ in range(3):
        buf = pool.acquire()
        assert buf is not None and buf.data_ptr() % 4096 == 0
        assert chunk_tensor(buf, FMT).shape == FMT.chunk_shape


# -- the engine-agnostic API -------------------------------------------------------------
def _kv(tokens: list[int], salt: int = 0) -> torch.Tensor:
    """KV that depends on each token and its position (as real KV does)."""
    t = torch.tensor(tokens, dtype=torch.float32)
    pos = torch.arange(len(tokens), dtype=torch.float32)
    base = (t * 0.001 + pos * 0.01 + salt)[None, None, :, None, None]
    return base.expand(FMT.num_layers, 2, len(tokens), FMT.num_kv_heads, FMT.head_dim).contiguous()


def test_client_saves_and_loads_the_longest_prefix(tmp_path: Path) -> None:
    c = KVCacheClient(tmp_path / "s", "m", FMT, tokenizer="tok-src")
    try:
        toks = list(range(100, 200))  # 3 full chunks of 32 + 4 tokens
        kv = _kv(toks)
        assert c.save(toks, kv) == 3
        assert c.flush(10)
        assert c.lookup(toks) == 96
        hit = c.load(toks + [1, 2, 3])
        assert hit.tokens == 96 and hit.chunks == 3
        assert torch.equal(hit.kv, kv[:, :, :96])
        # a prompt that diverges inside chunk 2 gets chunk 1 only
        other = toks[:40] + [7] * 60
        assert c.load(other).tokens == 32
        # saving again queues nothing (already stored)
        assert c.save(toks, kv) == 0
        infos = [i for nid, i in c.store.namespaces().items()]
        assert infos and infos[0]["info"]["tokenizer"] == "tok-src"
    finally:
        c.close()


def test_client_isolates_adapters_and_salts(tmp_path: Path) -> None:
    folder = tmp_path / "lora"
    folder.mkdir()
    (folder / "adapter_model.safetensors").write_bytes(b"weights-v1")
    c = KVCacheClient(tmp_path / "s", "m", FMT)
    try:
        toks = list(range(64))
        a = c.adapter("civil", folder)
        c.save(toks, _kv(toks, 1), adapter=a)
        c.flush(10)
        assert c.lookup(toks, adapter=a) == 64
        assert c.lookup(toks) == 0
        assert c.lookup(toks, adapter=a, cache_salt="tenant") == 0
        (folder / "adapter_model.safetensors").write_bytes(b"weights-v2")
        a2 = c.adapter("civil", folder)
        assert a2 != a and c.lookup(toks, adapter=a2) == 0
    finally:
        c.close()


def test_client_treats_a_corrupt_chunk_as_the_end_of_the_prefix(tmp_path: Path) -> None:
    c = KVCacheClient(tmp_path / "s", "m", FMT)
    try:
        toks = list(range(96))
        kv = _kv(toks)
        c.save(toks, kv)
        c.flush(10)
        keys = c.namespace().chunk_keys(toks)
        flip_byte(c.store, keys[1])
        hit = c.load(toks)
        assert hit.tokens == 32 and torch.equal(hit.kv, kv[:, :, :32])
        assert not c.store.contains(keys[1])
    finally:
        c.close()


def test_client_refuses_kv_of_the_wrong_shape(tmp_path: Path) -> None:
    c = KVCacheClient(tmp_path / "s", "m", FMT)
    try:
        with pytest.raises(StoreError, match="kv must be"):
            c.save(list(range(32)), torch.zeros(3, 2, 32, 4, 8))
    finally:
        c.close()


def test_adapter_cache_rehashes_only_on_change(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import engine_hook.identity as ident

    calls: list[str | os.PathLike[str]] = []
    real = ident.adapter_digest

    def counted_digest(folder: str | os.PathLike[str]) -> str:
        calls.append(folder)
        return real(folder)

    monkeypatch.setattr(ident, "adapter_digest", counted_digest)
    (tmp_path / "adapter_config.json").write_text("{}")
    cache = AdapterCache()
    first = cache.identity("x", tmp_path)
    assert cache.identity("x", tmp_path) == first and len(calls) == 1
    (tmp_path / "adapter_config.json").write_text('{"r": 8}')
    assert cache.identity("x", tmp_path) != first and len(calls) == 2


def test_shared_store_is_one_instance_per_folder(tmp_path: Path) -> None:
    from store import open_shared, release_shared

    a = open_shared(tmp_path / "s")
    b = open_shared(str(tmp_path / "s") + "/")
    assert a is b
    release_shared(a)
    assert not a._closed
    release_shared(b)
    assert a._closed
    assert isinstance(open_shared(tmp_path / "s"), Store)


def test_recent_save_claims_expire_so_dropped_saves_are_retried() -> None:
    from engine_hook.scheduler import RecentKeys

    now = [0.0]
    rk = RecentKeys(ttl=30, limit=3, clock=lambda: now[0])
    assert rk.claim(b"a") and not rk.claim(b"a")  # a second request in flight skips it
    now[0] = 29.0
    assert not rk.claim(b"a")
    now[0] = 31.0
    assert rk.claim(b"a")  # the first save may have been dropped: save again
    for k in (b"b", b"c", b"d"):
        assert rk.claim(k)
    assert rk.claim(b"a")  # bounded: the oldest claims make room

"""``Store.get_many_into``: a request's chunks read together, whole records several in flight,
with every check a single ``get_into`` makes (checksums, lengths, drops, counts)."""

from __future__ import annotations

import mmap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import SMALL_LAYOUT, content, key

from store import MiB, PutItem, Store, StoreError
from store.format.record import segment_name
from store.format.segment import SegmentIO

MakeStore = Callable[..., Store]
N = 32 * 1024  # a chunk of whole pages


@pytest.fixture
def whole_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The offsets of the records read whole (the real ``start_whole_read`` runs; this only counts)."""
    seen: list[int] = []
    real = SegmentIO.start_whole_read

    def spy(self: SegmentIO, seg_id: int, offset: int, stored_len: int, dst: memoryview) -> object:
        seen.append(offset)
        return real(self, seg_id, offset, stored_len, dst)

    monkeypatch.setattr(SegmentIO, "start_whole_read", spy)
    yield seen


def direct_store(make_store: MakeStore) -> Store:
    store = make_store(segment_bytes=8 * MiB)
    if not store.stats().tiers["nvme"].direct_io:
        pytest.skip("the tier's filesystem does not take O_DIRECT")
    return store


def put(store: Store, ids: range, n: int = N, codec: str | None = None) -> list[bytes]:
    keys = [key(i) for i in ids]
    assert all(store.put_many([PutItem(k, content(k, n), SMALL_LAYOUT, 16, codec) for k in keys]))
    return keys


def buffers(count: int, n: int = N) -> list[mmap.mmap]:
    out = []
    for _ in range(count):
        m = mmap.mmap(-1, n)
        m[:] = b"\xee" * n
        out.append(m)
    return out


def read_failures(store: Store) -> dict[str, int]:
    store.flush()
    return {c.labels["reason"]: int(c.value) for c in store.metric_cells() if c.name == "read_failures_total"}


def test_each_chunk_lands_in_its_own_buffer_read_whole_and_counted(make_store: MakeStore,
                                                                    whole_reads: list[int]) -> None:
    store = direct_store(make_store)
    keys = put(store, range(6))
    outs = buffers(6)
    infos = store.get_many_into(keys, outs, expect=N)
    assert [i.key if i else None for i in infos] == keys
    assert all(i is not None and i.raw_bytes == N and i.tier == "nvme" for i in infos)
    for k, o in zip(keys, outs, strict=True):
        assert o[:] == content(k, N)
    assert len(whole_reads) == 6, "every raw chunk of whole pages is read in one request"
    store.flush()
    assert store.stats().counters["hits"] == 6
    loads = {c.labels["tier"]: int(c.value) for c in store.metric_cells() if c.name == "loads_total"}
    assert loads == {"nvme": 6}


def test_a_corrupt_record_among_them_is_a_miss_dropped_and_counted(make_store: MakeStore, tmp_path: Path,
                                                                   whole_reads: list[int]) -> None:
    store = direct_store(make_store)
    keys = put(store, range(5))
    bad = store.info(keys[2])
    assert bad is not None
    seg = next(tmp_path.rglob(segment_name(bad.segment)))
    with open(seg, "r+b") as f:  # one byte of the payload flipped on disk
        f.seek(bad.offset + 1000)
        b = f.read(1)
        f.seek(bad.offset + 1000)
        f.write(bytes([b[0] ^ 0xFF]))
    outs = buffers(5)
    infos = store.get_many_into(keys, outs, expect=N)
    assert [i is not None for i in infos] == [True, True, False, True, True]
    for i in (0, 1, 3, 4):
        assert outs[i][:] == content(keys[i], N)
    assert not store.contains(keys[2])
    assert store.event_counters()["corrupt_total"] == {"bad-record": 1}
    assert read_failures(store) == {"bad-record": 1}
    store.flush()
    assert store.stats().counters["hits"] == 4 and store.stats().counters["misses"] == 1


def test_missing_unaligned_compressed_and_odd_sized_chunks_take_the_single_path(make_store: MakeStore,
                                                                                whole_reads: list[int]) -> None:
    store = direct_store(make_store)
    raw = put(store, range(3))
    packed = put(store, range(10, 11), codec="zstd")
    odd = put(store, range(20, 21), n=N - 100)
    missing = key(99)
    keys = [raw[0], missing, raw[1], packed[0], raw[2], odd[0]]
    outs: list[mmap.mmap | bytearray] = list(buffers(6))
    outs[2] = bytearray(b"\xee" * N)  # not page-aligned: through the staging path
    infos = store.get_many_into(keys, outs)
    assert [i is not None for i in infos] == [True, False, True, True, True, True]
    assert outs[0][:] == content(raw[0], N)
    assert bytes(outs[2]) == content(raw[1], N)
    assert outs[3][:] == content(packed[0], N)
    assert outs[4][:] == content(raw[2], N)
    assert outs[5][: N - 100] == content(odd[0], N - 100)
    assert outs[5][N - 100 :] == b"\xee" * 100, "nothing lands past an odd-sized chunk"
    assert len(whole_reads) == 2, "only the raw chunks of whole pages in aligned buffers are read whole"
    store.flush()
    assert store.stats().counters["misses"] == 1


def test_a_length_other_than_expected_is_a_bad_length_miss(make_store: MakeStore) -> None:
    store = direct_store(make_store)
    keys = put(store, range(3))
    infos = store.get_many_into(keys, buffers(3, 2 * N), expect=2 * N)
    assert infos == [None, None, None]
    assert read_failures(store) == {"bad-length": 3}
    assert not any(store.contains(k) for k in keys)


def test_buffers_that_cannot_take_the_chunks_are_refused_clearly(make_store: MakeStore) -> None:
    store = direct_store(make_store)
    keys = put(store, range(2))
    with pytest.raises(StoreError, match="2 keys but 1 buffers"):
        store.get_many_into(keys, buffers(1))
    with pytest.raises(StoreError, match="cannot take the"):
        store.get_many_into(keys, buffers(2, N // 2), expect=N)

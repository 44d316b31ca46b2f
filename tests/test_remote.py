"""The remote tier's client (store/tiers/remote.py) against real redis-server processes: round trips,
torn and foreign values, OOM, eviction, a frozen and a dead server, URLs and passwords, key
prefixes, a Unix socket, TLS and a three-node Redis Cluster.

Each test starts its own ``redis-server`` (Debian's package; scripts/setup.sh installs it) on a
free loopback port, with persistence off, and stops it by pid.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis_server import Server, as_bytes, free_port, secret_file

from store.clock import ManualClock
from store.errors import StoreError
from store.tiers.breaker import CircuitBreaker
from store.tiers.remote import RemoteMeta, RemoteTier, redacted

KiB = 1024


def key(i: int) -> bytes:
    return b"\x07" * 16 + i.to_bytes(32, "big")


def payload(i: int, n: int) -> bytes:
    seed = i.to_bytes(8, "little")
    block = (seed * (4096 // 8 + 1))[:4096]
    return bytes((b + j) & 0xFF for j, b in enumerate(block)) * (n // 4096) + os.urandom(n % 4096)


def meta(n: int, **kw: Any) -> RemoteMeta:
    return RemoteMeta(raw_len=n, codec=kw.pop("codec", "raw"), layout=kw.pop("layout", {"dtype": "bfloat16"}),
                      tokens=kw.pop("tokens", 16), **kw)


@pytest.fixture
def tiers(tmp_path: Path) -> Iterator[Callable[..., RemoteTier]]:
    """Tiers of one deployment: they share a secret, unless told otherwise (``trust``)."""
    made: list[RemoteTier] = []
    secret = secret_file(tmp_path)

    def make(url: str, **kw: Any) -> RemoteTier:
        kw.setdefault("key_prefix", "t")
        kw.setdefault("piece_bytes", 64 * KiB)
        if "trust" not in kw:
            kw.setdefault("secret_file", secret)
        t = RemoteTier(url, **kw)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


def get(tier: RemoteTier, k: bytes) -> tuple[RemoteMeta, bytearray] | None:
    return tier.get(k, max_stored=64 << 20)


def names(r: redis.Redis, tier: RemoteTier, k: bytes) -> list[bytes]:
    """The Redis names of a chunk's pieces (not its head), in order."""
    tag = tier.head_key(k)[:-2]
    return sorted((n for n in r.scan_iter(match=f"{tag}:*") if not n.endswith(b":h")),
                  key=lambda n: int(n.rsplit(b":", 1)[1]))


def roundtrip(tier: RemoteTier, i: int, n: int) -> bytes:
    data = payload(i, n)
    assert tier.put(key(i), data, meta(n, tokens=i))
    got = get(tier, key(i))
    assert got is not None
    m, buf = got
    assert bytes(buf) == data
    assert (m.stored_len, m.raw_len, m.tokens, m.codec, m.layout) == (n, n, i, "raw", {"dtype": "bfloat16"})
    return data


# -- round trips ---------------------------------------------------------------------------
def test_round_trips_are_byte_identical_at_every_size(servers: Callable[..., Server],
                                                       tiers: Callable[..., RemoteTier]) -> None:
    srv = servers()
    pb = 64 * KiB
    tier = tiers(srv.url, piece_bytes=pb)
    r = srv.client()
    for i, n in enumerate([0, 1, pb - 1, pb, pb + 1, 3 * pb + 5]):
        data = roundtrip(tier, i, n)
        # get_into: a larger buffer, and the size chosen from the metadata
        out = bytearray(n + 100)
        m = tier.get_into(key(i), out)
        assert m is not None and bytes(out[:n]) == data and m.piece_bytes == pb
        assert m.written is not None and abs(m.written - time.time()) < 60
        m = tier.get_into(key(i), lambda m: memoryview(bytearray(m.stored_len or 0)), max_stored=n)
        assert m is not None
        pieces = len(names(r, tier, key(i)))
        assert pieces == -(-n // pb)
    # a compressed payload's metadata travels as given
    assert tier.put(key(50), b"zz" * 100, RemoteMeta(raw_len=4096, codec="zstd-shuffle", level=3, tokens=256,
                                                      layout={"shape": [2, 2, 16, 2, 32]}))
    got = get(tier, key(50))
    assert got is not None and got[0].codec == "zstd-shuffle" and got[0].level == 3 and got[0].raw_len == 4096
    assert got[0].layout == {"shape": [2, 2, 16, 2, 32]} and got[0].tokens == 256
    st = tier.stats()
    assert st.errors == 0 and st.torn == 0 and st.misses == 0 and st.puts == 7 and st.hits == 19
    total = sum([0, 1, pb - 1, pb, pb + 1, 3 * pb + 5])
    assert (st.bytes_out, st.bytes_in) == (total + 200, 3 * total + 200)


@pytest.mark.parametrize(("protocol", "direct"), [(2, True), (3, True), (3, False)])
def test_reads_keep_the_connection_in_step_whatever_they_find(servers: Callable[..., Server],
                                                              tiers: Callable[..., RemoteTier],
                                                              protocol: int, direct: bool) -> None:
    """A read asks for as many pieces as the last chunk had, before it knows this one's count:
    every reply it does not use (a miss, a foreign or damaged head, a buffer too small, a
    chunk with fewer pieces) is consumed, so the next read on the same connection gets its
    own replies. On a single server the tier reads the replies itself (RESP2 or RESP3);
    through a cluster client with redis-py's pipelines (``direct=False``)."""
    srv = servers()
    pb = 4 * KiB
    tier = tiers(srv.url, piece_bytes=pb, protocol=protocol)
    assert tier.direct_reads
    tier.direct_reads = direct
    if direct:  # and it does read them itself
        tier._read_pipelined = None  # type: ignore[method-assign,assignment]
    r = srv.client()
    roundtrip(tier, 1, 7 * pb + 3)
    roundtrip(tier, 2, pb // 2)
    big = roundtrip(tier, 1, 7 * pb + 3)  # the next reads ask for 8 pieces
    assert get(tier, key(9)) is None  # absent: 8 nil replies consumed
    assert tier.get_into(key(1), bytearray(100)) is None and tier.stats().too_small == 1
    r.set(tier.head_key(key(3)), b"LMRC" + bytes(200))  # foreign, with pieces-shaped keys beside it
    for i in range(8):
        r.set(tier.piece_keys(key(3), 8)[i], b"p" * pb)
    assert get(tier, key(3)) is None and tier.stats().foreign == 1
    r.set(tier.head_key(key(4)), b"x")
    r.hset(tier.piece_keys(key(4), 1)[0], "f", "v")  # a piece of another type: an error reply
    assert get(tier, key(4)) is None
    got = get(tier, key(1))
    assert got is not None and bytes(got[1]) == big
    # a chunk with more pieces than the guess: the rest in a second round trip
    roundtrip(tier, 5, pb)
    roundtrip(tier, 6, 20 * pb)
    st = tier.stats()
    assert st.errors == 0 and st.torn == 0 and r.dbsize() == 1 + 8 + 1 + 1 + 1 + 1 + 1 + 8 + 1 + 1 + 1 + 20


def test_overwrite_leaves_no_stale_pieces_and_delete_removes_everything(servers: Callable[..., Server],
                                                                        tiers: Callable[..., RemoteTier]) -> None:
    srv = servers()
    tier = tiers(srv.url, piece_bytes=4 * KiB)
    r = srv.client()
    for n in (20 * KiB, 9 * KiB, 13 * KiB):
        roundtrip(tier, 1, n)
    assert r.dbsize() == 1 + 4  # head + the 4 pieces of the last put: the 5th of the first one is gone
    roundtrip(tier, 2, 5 * KiB)
    assert tier.contains_many([key(1), key(3), key(2)]) == [True, False, True]
    assert tier.contains_many([]) == []
    assert tier.delete([key(1), key(3)]) == 1
    assert tier.contains_many([key(1), key(2)]) == [False, True]
    assert r.dbsize() == 1 + 2
    assert get(tier, key(1)) is None and tier.stats().misses == 1


def test_concurrent_writers_and_readers_never_see_mixed_bytes(servers: Callable[..., Server],
                                                             tiers: Callable[..., RemoteTier]) -> None:
    """Readers racing writers that replace one chunk get one whole version or a miss."""
    srv = servers()
    tier = tiers(srv.url, piece_bytes=8 * KiB)
    versions = [payload(v, 40 * KiB) for v in range(3)]
    assert tier.put(key(1), versions[0], meta(40 * KiB))
    stop = time.monotonic() + 1.0
    seen: list[int] = []
    wrong: list[int] = []

    def write(v: int) -> None:
        while time.monotonic() < stop:
            assert tier.put(key(1), versions[v], meta(40 * KiB))

    def read() -> None:
        while time.monotonic() < stop:
            got = get(tier, key(1))
            if got is not None:
                data = bytes(got[1])
                (seen if data in versions else wrong).append(1)

    threads = [threading.Thread(target=write, args=(v,)) for v in (1, 2)] + \
        [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong and seen
    st = tier.stats()
    assert (st.errors, st.foreign, st.torn) == (0, 0, 0)
    assert srv.client().dbsize() == 1 + 5  # one generation left: replaced ones were deleted


def test_buffers_and_arguments(servers: Callable[..., Server], tiers: Callable[..., RemoteTier]) -> None:
    srv = servers()
    tier = tiers(srv.url)
    roundtrip(tier, 1, 1000)
    assert tier.get_into(key(1), bytearray(999)) is None
    assert tier.stats().too_small == 1
    with pytest.raises(TypeError):
        tier.get_into(key(1), b"\0" * 2000)  # read-only
    with pytest.raises(TypeError):
        tier.contains_many(["not bytes"])  # type: ignore[list-item]
    with pytest.raises(StoreError):
        tier.put(key(1), b"x", meta(1, codec="lz5"))
    assert get(tier, key(1)) is not None


# -- torn and foreign values -----------------------------------------------------------------
@pytest.mark.parametrize("trust", [None, "all-writers"])
def test_damaged_values_are_misses_and_counted(servers: Callable[..., Server], tiers: Callable[..., RemoteTier],
                                               trust: str | None) -> None:
    """Damaged values, with a secret (bytes that fail a MAC are ``forged``) and without one
    (they fail a checksum: ``torn``); pieces of the wrong length are torn either way."""
    srv = servers()
    pb = 4 * KiB
    tier = tiers(srv.url, piece_bytes=pb, **({"trust": trust} if trust else {}))
    bad = "torn" if trust else "forged"
    r = srv.client()

    def pieces(i: int) -> list[bytes]:
        return names(r, tier, key(i))

    def counted() -> tuple[int, int, int]:
        st = tier.stats()
        return st.evicted_discovered, st.torn, st.forged

    def plus(evicted: int = 0, torn: int = 0, forged: int = 0) -> tuple[int, int, int]:
        b = before
        return b[0] + evicted, b[1] + torn + (forged if bad == "torn" else 0), b[2] + (forged if bad == "forged" else 0)

    # a piece deleted (as an eviction would): evicted_discovered, and the chunk is dropped
    before = counted()
    roundtrip(tier, 1, 3 * pb)
    r.delete(pieces(1)[1])
    assert get(tier, key(1)) is None and counted() == plus(evicted=1)
    assert tier.contains_many([key(1)]) == [False] and r.dbsize() == 0

    # a piece corrupted, same length
    before = counted()
    roundtrip(tier, 2, 3 * pb)
    p = pieces(2)[2]
    v = bytearray(as_bytes(r.get(p) or b""))
    v[7] ^= 1
    r.set(p, bytes(v))
    assert get(tier, key(2)) is None and counted() == plus(forged=1)
    assert r.dbsize() == 0

    # a piece cut short: torn
    before = counted()
    roundtrip(tier, 3, 2 * pb + 10)
    r.set(pieces(3)[2], b"short")
    out = bytearray(3 * pb)
    assert tier.get_into(key(3), out) is None and counted() == plus(torn=1)

    # an older head over pieces of other bytes of the same length: dropped
    before = counted()
    roundtrip(tier, 4, 2 * pb)
    head1 = r.get(tier.head_key(key(4)))
    assert tier.put(key(4), payload(5, 2 * pb), meta(2 * pb))  # other bytes, same length
    r.set(tier.head_key(key(4)), head1 or b"")
    assert get(tier, key(4)) is None and counted() == plus(forged=1) and r.dbsize() == 0
    # a head whose last piece is gone: evicted
    before = counted()
    roundtrip(tier, 4, 3 * pb)
    r.delete(tier.piece_keys(key(4), 3)[2])
    assert get(tier, key(4)) is None and counted() == plus(evicted=1)

    # a damaged head (its MAC or checksum fails)
    before = counted()
    roundtrip(tier, 5, 100)
    h = bytearray(as_bytes(r.get(tier.head_key(key(5))) or b""))
    h[40] ^= 0xFF
    r.set(tier.head_key(key(5)), bytes(h))
    assert get(tier, key(5)) is None and counted() == plus(forged=1)
    assert tier.stats().misses == 6 and tier.stats().errors == 0 and tier.stats().foreign == 0


def test_foreign_values_are_misses_and_counted(servers: Callable[..., Server],
                                               tiers: Callable[..., RemoteTier]) -> None:
    srv = servers()
    tier = tiers(srv.url)
    r = srv.client()
    r.set(tier.head_key(key(1)), b"somebody else's value")
    assert tier.contains_many([key(1)]) == [True]
    assert get(tier, key(1)) is None
    assert tier.stats().foreign == 1
    r.delete(tier.head_key(key(1)))
    r.hset(tier.head_key(key(2)), "f", "v")  # another type: WRONGTYPE, foreign, not a failing server
    assert get(tier, key(2)) is None
    roundtrip(tier, 3, 5000)
    r.set(tier.head_key(key(4)), r.get(tier.head_key(key(3))) or b"")  # another chunk's head: its MAC fails
    assert get(tier, key(4)) is None
    h = bytearray(as_bytes(r.get(tier.head_key(key(3))) or b""))
    h[4] = 9  # another format version
    r.set(tier.head_key(key(3)), bytes(h))
    assert get(tier, key(3)) is None
    st = tier.stats()
    assert (st.foreign, st.forged, st.torn, st.errors, st.breaker) == (3, 1, 0, 0, "closed")
    # a put over a foreign value of another type replaces it
    roundtrip(tier, 2, 300)


# -- a full server, an evicting server -------------------------------------------------------
def test_oom_makes_put_return_false_and_is_counted(servers: Callable[..., Server],
                                                   tiers: Callable[..., RemoteTier]) -> None:
    srv = servers("--maxmemory", "3mb", "--maxmemory-policy", "noeviction")
    tier = tiers(srv.url, piece_bytes=64 * KiB, oom_pause_s=0.0)
    r = srv.client()
    stored: list[int] = []
    for i in range(200):
        if not tier.put(key(i), payload(i, 200 * KiB), meta(200 * KiB)):
            break
        stored.append(i)
    else:
        pytest.fail("a 3 MB server took 40 MB")
    st = tier.stats()
    assert st.oom == 1 and st.errors == 1 and st.put_failures == 1 and st.breaker == "closed"
    # the refused chunk left nothing behind: every key is part of a whole stored chunk
    assert r.dbsize() == len(stored) * (1 + 4)
    assert not r.exists(tier.head_key(key(len(stored))))
    # reads go on
    got = get(tier, key(stored[-1]))
    assert got is not None and bytes(got[1]) == payload(stored[-1], 200 * KiB)
    # with a pause after OOM, puts are refused without a round trip for a while
    paused = tiers(srv.url, piece_bytes=64 * KiB, oom_pause_s=30.0, key_prefix="p")
    assert not paused.put(key(900), payload(1, 200 * KiB), meta(200 * KiB))
    calls = paused.stats().calls
    assert not paused.put(key(901), b"x", meta(1))
    st = paused.stats()
    assert (st.oom, st.calls, st.short_circuited, st.put_failures) == (1, calls, 1, 2)


def test_lru_eviction_of_pieces_is_a_counted_miss(servers: Callable[..., Server],
                                                  tiers: Callable[..., RemoteTier]) -> None:
    srv = servers("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru", "--maxmemory-samples", "3")
    tier = tiers(srv.url, piece_bytes=16 * KiB)
    n, size = 150, 64 * KiB
    for i in range(n):
        assert tier.put(key(i), payload(i, size), meta(size))
    hits = 0
    for i in range(n):
        got = get(tier, key(i))
        if got is not None:
            assert bytes(got[1][:4096]) == payload(i, size)[:4096]
            hits += 1
    st = tier.stats()
    assert st.evicted_discovered >= 1 and hits >= 1
    assert (st.torn, st.foreign, st.errors, st.hits, st.misses) == (0, 0, 0, hits, n - hits)


# -- a frozen, a dead server: deadlines and the breaker ---------------------------------------
def test_frozen_server_calls_keep_their_deadline_and_the_breaker_recovers(
        servers: Callable[..., Server], tiers: Callable[..., RemoteTier], caplog: pytest.LogCaptureFixture) -> None:
    srv = servers()
    clock = ManualClock()
    tier = tiers(srv.url, lookup_timeout_s=0.05, io_timeout_s=0.25, breaker_failures=2, breaker_backoff_s=0.3,
                 breaker_backoff_max_s=0.6, clock=clock)
    data = roundtrip(tier, 1, 200 * KiB)
    caplog.set_level(logging.INFO, logger="lmctl.store")
    srv.signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        assert tier.contains_many([key(1)]) == [False]
        assert time.monotonic() - t0 < 1.0
        t0 = time.monotonic()
        assert get(tier, key(1)) is None
        assert time.monotonic() - t0 < 2.0
        st = tier.stats()
        assert st.breaker == "open" and st.timeouts >= 2 and st.breaker_opened == 1
        # open: answered at once, without the network
        t0 = time.monotonic()
        assert tier.contains_many([key(1)]) == [False]
        assert not tier.put(key(2), b"abc", meta(3))
        assert get(tier, key(1)) is None
        assert time.monotonic() - t0 < 0.05
        assert tier.stats().calls == st.calls and tier.stats().short_circuited == 3
        # a probe after the backoff fails again: open for longer
        assert tier.breaker.state == "open"
        clock.advance(0.35)
        t0 = time.monotonic()
        assert not tier.put(key(2), b"abc", meta(3))
        assert time.monotonic() - t0 < 2.0
        assert tier.breaker.backoff == pytest.approx(0.6) and tier.stats().breaker == "open"
    finally:
        srv.signal(signal.SIGCONT)
    # the server is back: the next probe closes the breaker by itself
    deadline = time.monotonic() + 5
    while tier.contains_many([key(1)]) != [True]:
        assert time.monotonic() < deadline, tier.stats()
        time.sleep(0.05)
        clock.advance(0.05)  # the breaker's backoff passes on its clock
    assert tier.stats().breaker == "closed"
    got = get(tier, key(1))
    assert got is not None and bytes(got[1]) == data
    assert tier.put(key(2), b"abc", meta(3))
    assert "circuit breaker open" in caplog.text and "circuit breaker closed" in caplog.text


def test_dead_server_fails_fast_and_a_restarted_one_is_used_again(servers: Callable[..., Server],
                                                                  tiers: Callable[..., RemoteTier]) -> None:
    srv = servers()
    tier = tiers(srv.url, breaker_failures=1, breaker_backoff_s=0.2)
    roundtrip(tier, 1, 1000)
    srv.signal(signal.SIGKILL)
    assert srv.proc is not None
    srv.proc.wait(5)
    t0 = time.monotonic()
    assert not tier.put(key(2), b"x" * 100, meta(100))
    assert get(tier, key(1)) is None and tier.contains_many([key(1)]) == [False]
    assert time.monotonic() - t0 < 1.0
    st = tier.stats()
    assert st.breaker == "open" and st.errors == 1 and st.short_circuited == 2
    srv.start()
    srv.wait(srv.client)
    deadline = time.monotonic() + 5
    while not tier.put(key(2), b"x" * 100, meta(100)):
        assert time.monotonic() < deadline, tier.stats()
        time.sleep(0.05)
    assert tier.stats().breaker == "closed"
    assert get(tier, key(1)) is None  # the restarted server lost it: a plain miss
    got = get(tier, key(2))
    assert got is not None and bytes(got[1]) == b"x" * 100


def test_circuit_breaker_states() -> None:
    now = [0.0]
    b = CircuitBreaker(failures=3, backoff_s=1.0, backoff_max_s=3.0, clock=lambda: now[0])
    assert b.allow() and not b.failure() and not b.failure()
    assert b.success() is False and b.failures == 0  # success resets the count
    assert not b.failure() and not b.failure() and b.failure()
    assert b.state == "open" and not b.allow()
    now[0] = 1.0
    assert b.allow() and b.state == "half-open"
    assert not b.allow()  # one probe at a time
    b.failure()
    assert b.state == "open" and b.backoff == 2.0 and not b.allow()
    now[0] = 3.0
    assert b.allow()
    b.failure()
    assert b.backoff == 3.0  # capped
    now[0] = 6.0
    assert b.allow()
    b.release()  # a probe that ended without a verdict lets another one try
    assert b.allow() and b.success() and b.state == "closed" and b.backoff == 1.0 and b.opened == 3


# -- URLs, passwords, prefixes ---------------------------------------------------------------
def test_redacted_urls() -> None:
    assert redacted("redis://:hunter2@cache:6379/0") == "redis://:***@cache:6379/0"
    assert redacted("rediss://lmctl:hunter2@cache:6380/1?ssl_ca_certs=/ca.pem") == \
        "rediss://lmctl:***@cache:6380/1?ssl_ca_certs=/ca.pem"
    assert redacted("redis://cache:6379/0?password=hunter2&cluster=1") == "redis://cache:6379/0?password=***&cluster=1"
    assert redacted("unix:///run/redis.sock?db=3") == "unix:///run/redis.sock?db=3"
    assert redacted("redis://lmctl@cache") == "redis://lmctl@cache"
    assert "hunter2" not in redacted("redis://a:b:hunter2@c")


def test_passwords_from_the_url_and_from_a_file_are_never_shown(
        servers: Callable[..., Server], tiers: Callable[..., RemoteTier], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    secret = "s3cr3t-Pw_9"
    srv = servers("--requirepass", secret, password=secret)
    admin = srv.client(password=secret)
    # the ACL the operator guide recommends: its own prefix, only the commands the tier uses
    admin.acl_setuser("engine", enabled=True, passwords=["+other-" + secret], keys=["team-a:*"],
                      commands=["+get", "+set", "+exists", "+del", "+getdel", "+multi", "+exec", "+discard",
                                "+watch", "+unwatch", "+ping"])
    caplog.set_level(logging.DEBUG, logger="lmctl.store")
    url = f"redis://:{secret}@127.0.0.1:{srv.port}/0"
    t1 = tiers(url)
    roundtrip(t1, 1, 3000)
    assert secret not in repr(t1) and secret not in t1.url and "***" in t1.url
    pw = tmp_path / "redis.pass"
    pw.write_text(secret + "\n")
    pw.chmod(0o600)
    t2 = tiers(srv.url, password_file=pw)
    assert get(t2, key(1)) is not None
    # an ACL user restricted to its own prefix, password from a file
    pw2 = tmp_path / "engine.pass"
    pw2.write_text("other-" + secret)
    pw2.chmod(0o600)
    t3 = tiers(f"redis://engine@127.0.0.1:{srv.port}/0", password_file=pw2, key_prefix="team-a", piece_bytes=1000)
    roundtrip(t3, 2, 3000)
    roundtrip(t3, 2, 2500)  # an overwrite in place
    admin.delete(t3.piece_keys(key(2), 3)[1])
    assert get(t3, key(2)) is None and t3.stats().evicted_discovered == 1  # dropped under WATCH
    assert t3.contains_many([key(2)]) == [False] and t3.delete([key(2)]) == 0
    assert t3.stats().errors == 0
    t4 = tiers(f"redis://engine@127.0.0.1:{srv.port}/0", password_file=pw2, key_prefix="team-b")
    assert not t4.put(key(3), b"x", meta(1)) and t4.stats().errors == 1  # NOPERM: counted, not raised
    # a wrong password: counted failures, never an exception
    t5 = tiers(f"redis://:wrong-{secret}@127.0.0.1:{srv.port}/0", breaker_failures=1)
    assert not t5.put(key(1), b"x", meta(1)) and get(t5, key(1)) is None
    assert t5.stats().errors == 1 and t5.stats().breaker == "open"
    # a password file readable by others still works, with a warning
    pw.chmod(0o644)
    assert get(tiers(srv.url, password_file=pw), key(1)) is not None
    assert "can be read by other users" in caplog.text
    with pytest.raises(StoreError, match="give it once"):
        RemoteTier(url, key_prefix="t", password_file=pw, trust="all-writers")
    with pytest.raises(StoreError, match="cannot read"):
        RemoteTier(srv.url, key_prefix="t", password_file=tmp_path / "missing", trust="all-writers")
    assert secret not in caplog.text and caplog.text


def test_key_prefixes_isolate_deployments(servers: Callable[..., Server], tiers: Callable[..., RemoteTier]) -> None:
    srv = servers()
    a, b = tiers(srv.url, key_prefix="site-a"), tiers(srv.url, key_prefix="site-b")
    assert a.put(key(1), b"A" * 5000, meta(5000))
    assert b.contains_many([key(1)]) == [False] and get(b, key(1)) is None
    assert b.put(key(1), b"B" * 7000, meta(7000))
    ga, gb = get(a, key(1)), get(b, key(1))
    assert ga is not None and bytes(ga[1]) == b"A" * 5000
    assert gb is not None and bytes(gb[1]) == b"B" * 7000
    assert a.delete([key(1)]) == 1
    assert b.contains_many([key(1)]) == [True] and a.contains_many([key(1)]) == [False]
    assert all(as_bytes(k).startswith(b"site-b:{") for k in srv.client().keys())
    assert (a.stats().foreign, b.stats().foreign) == (0, 0)


def test_settings_are_checked() -> None:
    for prefix in ("", "a{b", "a}b", "with space", "x" * 101):
        with pytest.raises(StoreError, match="key prefix"):
            RemoteTier("redis://127.0.0.1:1/0", key_prefix=prefix)
    with pytest.raises(StoreError, match="must start with"):
        RemoteTier("http://127.0.0.1:1/0", key_prefix="t", trust="all-writers")
    with pytest.raises(StoreError, match="Unix socket"):
        RemoteTier("unix:///tmp/x.sock?cluster=1", key_prefix="t", trust="all-writers")
    with pytest.raises(StoreError, match="database 0"):
        RemoteTier("redis://127.0.0.1:1/3", key_prefix="t", cluster=True, trust="all-writers")
    with pytest.raises(StoreError, match="piece_bytes"):
        RemoteTier("redis://127.0.0.1:1/0", key_prefix="t", piece_bytes=0, trust="all-writers")
    with pytest.raises(StoreError, match="redis option"):
        RemoteTier("redis://127.0.0.1:1/0", key_prefix="t", password="x", trust="all-writers")
    with pytest.raises(StoreError, match="cannot be parsed"):
        RemoteTier("redis://:pw@127.0.0.1:notaport/0", key_prefix="t", trust="all-writers")
    t = RemoteTier("redis://127.0.0.1:1/0?cluster=yes", key_prefix="t", trust="all-writers")  # nothing is contacted yet
    assert t.cluster and "cluster" not in t._target
    t.close()


# -- other transports --------------------------------------------------------------------------
def test_unix_socket_url(servers: Callable[..., Server], tiers: Callable[..., RemoteTier], tmp_path: Path) -> None:
    sock = tmp_path / "r.sock"
    srv = servers("--unixsocket", str(sock), "--unixsocketperm", "700", wait=False)
    srv.wait(lambda: redis.Redis(unix_socket_path=str(sock)))
    tier = tiers(f"unix://{sock}?db=2")
    roundtrip(tier, 1, 100 * KiB)
    assert redis.Redis(unix_socket_path=str(sock), db=2).exists(tier.head_key(key(1)))
    assert redis.Redis(unix_socket_path=str(sock), db=0).dbsize() == 0


def test_tls_url(servers: Callable[..., Server], tiers: Callable[..., RemoteTier], tmp_path: Path) -> None:
    cert, pkey = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(pkey), "-out", str(cert)], check=True, capture_output=True)
    port = free_port()
    srv = servers("--tls-port", str(port), "--tls-cert-file", str(cert), "--tls-key-file", str(pkey),
                  "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no", wait=False)
    srv.port = port
    srv.wait(lambda: redis.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=str(cert)))
    tier = tiers(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}")
    roundtrip(tier, 1, 300 * KiB)
    # without the CA the certificate is refused: a counted failure, not an exception
    bad = tiers(f"rediss://127.0.0.1:{port}/0")
    assert get(bad, key(1)) is None and bad.stats().errors == 1
    plain = tiers(f"redis://127.0.0.1:{port}/0", io_timeout_s=0.5)
    assert get(plain, key(1)) is None and plain.stats().errors == 1


# -- Redis Cluster -------------------------------------------------------------------------
@pytest.fixture
def cluster(servers: Callable[..., Server]) -> list[Server]:
    nodes = [servers("--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", "2000") for _ in range(3)]
    subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes),
                    "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
    deadline = time.monotonic() + 20
    while not all(n.client().cluster("info")["cluster_state"] == "ok" for n in nodes):
        assert time.monotonic() < deadline, "the cluster did not come up"
        time.sleep(0.1)
    return nodes


def test_redis_cluster_keeps_each_chunk_on_one_node(cluster: list[Server], tiers: Callable[..., RemoteTier]) -> None:
    pb = 8 * KiB
    tier = tiers(f"{cluster[0].url}?cluster=1", piece_bytes=pb, key_prefix="cl")
    sizes = {i: (i * 7919) % (5 * pb) for i in range(24)}
    for i, n in sizes.items():
        roundtrip(tier, i, n)
    roundtrip(tier, 1, 3 * pb)  # overwrites: pieces the last put does not have are deleted on their node
    roundtrip(tier, 1, 2 * pb)
    tags = {i: tier.head_key(key(i))[3:-2].strip("{}") for i in range(30)}  # each chunk's hash tag
    assert sum(len(n.client().keys(f"cl:{{{tags[1]}}}:*")) for n in cluster) == 1 + 2
    sizes[1] = 2 * pb
    where: dict[str, set[int]] = {}
    for node_no, srv in enumerate(cluster):
        for k in srv.client().keys("cl:*"):
            tag = as_bytes(k).split(b"{", 1)[1].split(b"}", 1)[0].decode()
            where.setdefault(tag, set()).add(node_no)
    assert len(where) == len(sizes)
    assert all(len(nodes) == 1 for nodes in where.values())  # every key of a chunk on one node
    assert len(set().union(*where.values())) >= 2  # and the chunks spread over the nodes
    keys = [key(i) for i in range(30)]
    assert tier.contains_many(keys) == [i < 24 for i in range(30)]
    # a piece gone on its node: a counted miss, and the chunk is dropped (WATCH on that node)
    victim = max(sizes, key=lambda i: sizes[i])
    node = cluster[next(iter(where[tags[victim]]))].client()
    piece = next(k for k in node.keys(f"cl:{{{tags[victim]}}}:*") if not as_bytes(k).endswith(b":h"))
    node.delete(piece)
    assert get(tier, key(victim)) is None and tier.stats().evicted_discovered == 1
    assert tier.contains_many([key(victim)]) == [False]
    assert tier.delete(keys) == 23
    assert sum(n.client().dbsize() for n in cluster) == 0
    st = tier.stats()
    assert (st.errors, st.torn, st.foreign) == (0, 0, 0)

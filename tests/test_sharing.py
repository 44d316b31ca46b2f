"""Two engine hosts sharing chunks through a real Redis server (store/tiers/sharing.py)."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import SMALL_FMT, SMALL_LAYOUT, Hosts, content
from redis_server import Server

from store import MiB, Namespace, PutItem, Store, StoreConfig, StoreError, TierConfig
from store.config import RemoteConfig

N = SMALL_FMT.chunk_bytes
NS = Namespace("shared-model", SMALL_FMT)
TOKENS = list(range(16 * 6))


def test_a_chunk_saved_on_one_host_is_found_and_read_on_another(hosts: Hosts) -> None:
    a, b = hosts("a"), hosts("b")
    keys = NS.chunk_keys(TOKENS)
    assert all(a.put_many([PutItem(k, content(k, N), SMALL_LAYOUT, 16) for k in keys[:4]]))
    found = b.lookup(NS, TOKENS)
    assert found.hit_chunks == 4 and found.tiers[:4] == ["remote"] * 4 and found.tiers[4:] == [None, None]
    out = bytearray(N)
    info = b.get_into(keys[0], out)
    assert info is not None and info.tier == "remote" and bytes(out) == content(keys[0], N)
    # promoted: the next read is local, and a lookup no longer needs the server
    assert b.locate(keys[:1], remote=False) == ["nvme"]
    c = b.get(keys[1])
    assert c is not None and bytes(c.data) == content(keys[1], N) and c.tier == "remote"
    stats = b.stats().remote
    assert stats is not None and stats["promoted"] == 2 and stats["hits"] == 2 and "test" == stats["key_prefix"]


def test_never_writes_only_reads_and_prefixes_isolate(hosts: Hosts) -> None:
    a = hosts("a", write="never")
    keys = NS.chunk_keys(TOKENS)
    assert a.put(keys[0], content(keys[0], N), SMALL_LAYOUT, 16)
    assert hosts("b").locate(keys[:1]) == [None]  # a never shared it
    w = hosts("c")
    assert w.put(keys[1], content(keys[1], N), SMALL_LAYOUT, 16)
    assert hosts("d", prefix="other").locate(keys[1:2]) == [None]  # another deployment
    assert hosts("e").locate(keys[1:2]) == ["remote"]


def test_move_to_remote_and_pins_of_remote_chunks(hosts: Hosts) -> None:
    a = hosts("a", write="never")
    keys = NS.chunk_keys(TOKENS)
    assert all(a.put_many([PutItem(k, content(k, N), SMALL_LAYOUT, 16) for k in keys[:3]]))
    a.pin("doc", keys[:1])
    dry = a.rewrite(keys[:3], tier="remote", dry_run=True)
    assert (dry.chunks, dry.skipped) == (2, 1) and a.locate(keys[:3], remote=False) == ["nvme"] * 3
    res = a.rewrite(keys[:3], tier="remote")
    assert (res.chunks, res.skipped) == (2, 1)
    assert a.locate(keys[:3], remote=False) == ["nvme", None, None]
    assert a.locate(keys[:3]) == ["nvme", "remote", "remote"]
    with pytest.raises(StoreError, match="only in the remote tier"):
        a.pin("doc2", keys[1:2])
    b = hosts("b")
    c = b.get(keys[2])
    assert c is not None and bytes(c.data) == content(keys[2], N)


def test_a_dead_or_frozen_server_costs_misses_never_errors(hosts: Hosts) -> None:
    a, b = hosts("a"), hosts("b")
    keys = NS.chunk_keys(TOKENS)
    assert a.put(keys[0], content(keys[0], N), SMALL_LAYOUT, 16)
    redis: Server = hosts.redis
    redis.signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        for _ in range(5):
            assert b.lookup(NS, TOKENS).hit_tokens == 0  # a miss, not an error or a stall
            assert b.get(keys[0]) is None
        assert time.monotonic() - t0 < 15
        assert a.put(keys[1], content(keys[1], N), SMALL_LAYOUT, 16)  # local writes go on
        assert a.locate(keys[1:2], remote=False) == ["nvme"]
        assert b.stats().remote["breaker"] in ("open", "half-open")  # type: ignore[index]
    finally:
        redis.signal(signal.SIGCONT)
    deadline = time.monotonic() + 60
    while b.locate(keys[:1]) != ["remote"]:  # sharing resumes by itself
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_settings_of_the_remote_tier_are_checked(tmp_path: Path) -> None:
    for bad, why in ((RemoteConfig("http://x"), "redis://"), (RemoteConfig("redis://x", key_prefix="a:b"), "prefix"),
                     (RemoteConfig("redis://x", write="sometimes"), "write policy")):
        with pytest.raises(StoreError, match=why):
            Store(tmp_path / "s", StoreConfig(remote=bad))


def test_the_scheduler_asks_the_remote_tier_off_its_thread(hosts: Hosts, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt the local store lacks: a near server's answer comes in the same call (the
    remote hit); with a slow one the scheduler answers vLLM "ask again later" (None) at once
    while the tier is asked in the background, and a lookup that times out is a plain miss.

    On a loaded machine a lookup can take longer than its production deadlines (50 ms for the
    lookup, 5 ms of waiting in the scheduler): the near half gets generous ones, so what it
    checks is that the answer comes in the same call, not how fast this machine is."""
    from types import SimpleNamespace

    import engine_hook.scheduler as scheduler_mod
    from engine_hook.config import ConnectorSettings
    from engine_hook.context import ConnectorContext
    from engine_hook.scheduler import LMCtlConnectorScheduler

    # the reader's store, made first with a lookup deadline the slow half still runs out of
    Store(tmp_path / "b", StoreConfig(remote=RemoteConfig(hosts.redis.url, key_prefix="test",
                                                          lookup_timeout_s=1.0, secret_file=hosts.secret))).close()
    a = hosts("a")
    url = a.config.remote.url  # type: ignore[union-attr]
    ns = Namespace("m", SMALL_FMT)
    keys = ns.chunk_keys(TOKENS)
    assert all(a.put_many([PutItem(k, content(k, N), SMALL_LAYOUT, 16) for k in keys[:4]]))
    settings = ConnectorSettings.parse({"store_path": str(tmp_path / "b"), "chunk_size": 16, "model_fingerprint": "off",
                                        "remote_url": url, "remote_key_prefix": "test",
                                        "remote_secret_file": hosts.secret})
    sched = LMCtlConnectorScheduler(ConnectorContext(settings, "m", SMALL_FMT, ["l0", "l1"], 16, None, None, {}))
    try:
        assert sched.store.has_remote and sched.store.config.remote.key_prefix == "test"  # type: ignore[union-attr]
        def req(rid: str) -> Any:
            return SimpleNamespace(request_id=rid, prompt_token_ids=TOKENS, lora_request=None, cache_salt=None)

        assert sched.store.config.remote.lookup_timeout_s == 1.0  # type: ignore[union-attr]
        with monkeypatch.context() as m:
            m.setattr(scheduler_mod, "REMOTE_ASK_WAIT_S", 5.0)  # patience (a near server answers well within)
            assert sched.get_num_new_matched_tokens(req("r1"), 0) == (64, True)  # a near server: in the same call
        redis: Server = hosts.redis
        redis.signal(signal.SIGSTOP)  # a slow server: vLLM is told to ask again, the scheduler never waits
        try:
            t0 = time.monotonic()
            assert sched.get_num_new_matched_tokens(req("r2"), 0) == (None, False)
            assert time.monotonic() - t0 < 0.5
            deadline = time.monotonic() + 10
            while (got := sched.get_num_new_matched_tokens(req("r2"), 0)) == (None, False):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert got == (0, False)  # the lookup timed out: a miss, computed locally
        finally:
            redis.signal(signal.SIGCONT)
    finally:
        sched.close()


def test_connector_remote_settings_are_checked() -> None:
    from engine_hook.config import ConnectorSettings

    with pytest.raises(StoreError, match="redis://"):
        ConnectorSettings.parse({"store_path": "/x", "remote_url": "http://cache"})
    with pytest.raises(StoreError, match="need remote_url"):
        ConnectorSettings.parse({"store_path": "/x", "remote_write": "never"})
    with pytest.raises(StoreError, match="write policy"):
        ConnectorSettings.parse({"store_path": "/x", "remote_url": "redis://c:1/0", "remote_write": "sometimes"})
    with pytest.raises(StoreError, match="has no secret.*remote_secret_file.*lmctl remote secret"):
        ConnectorSettings.parse({"store_path": "/x", "remote_url": "redis://c:1/0"})
    with pytest.raises(StoreError, match="need remote_url"):
        ConnectorSettings.parse({"store_path": "/x", "remote_secret_file": "/s"})
    with pytest.raises(StoreError, match="remote_encrypt must be true or false"):
        ConnectorSettings.parse({"store_path": "/x", "remote_url": "redis://c:1/0", "remote_encrypt": "yes"})
    with pytest.raises(StoreError, match="remote_encrypt need remote_secret_file"):
        ConnectorSettings.parse({"store_path": "/x", "remote_url": "redis://c:1/0", "remote_trust": "all-writers",
                                 "remote_encrypt": True})
    s = ConnectorSettings.parse({"store_path": "/x", "remote_url": "redis://c:1/0", "remote_key_prefix": "prod",
                                 "remote_secret_file": "/etc/lmctl/remote.secret", "remote_encrypt": True})
    assert (s.remote_url, s.remote_key_prefix, s.remote_write) == ("redis://c:1/0", "prod", None)
    assert (s.remote_secret_file, s.remote_encrypt, s.remote_trust) == ("/etc/lmctl/remote.secret", True, None)


def test_write_evict_puts_what_eviction_takes_and_nothing_else(hosts: Hosts, tmp_path: Path) -> None:
    redis: Server = hosts.redis
    cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=16 * MiB)}, segment_bytes=1 * MiB,
                      remote=RemoteConfig(redis.url, key_prefix="test", write="evict",
                                          secret_file=hosts.secret))
    a = Store(tmp_path / "small", cfg)
    try:
        big = 1 << 20
        keys = [bytes([7]) * 16 + i.to_bytes(32, "big") for i in range(40)]
        for k in keys:  # 40 MiB through a 16 MiB tier
            assert a.put(k, content(k, big), {"dtype": "uint8"})
        local = a.locate(keys, remote=False)
        gone = [k for k, t in zip(keys, local, strict=True) if t is None]
        assert gone and local[-1] == "nvme"
        b = hosts("b")
        assert b.locate(gone) == ["remote"] * len(gone)  # every evicted chunk went to the server
        kept = [k for k, t in zip(keys, local, strict=True) if t is not None]
        assert b.locate(kept) == [None] * len(kept)  # and nothing else did
        c = b.get(gone[0])
        assert c is not None and bytes(c.data) == content(gone[0], big)
    finally:
        a.close()

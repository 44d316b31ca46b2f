"""Reliability on an operator's bad day: a disk that fills up under the store."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import content, loop_ext4

from store import DiskFullError, KVFormat, MiB, Namespace, Store, StoreConfig, TierConfig


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """An 85 MB ext4 filesystem, loop-mounted (needs root and loop devices)."""
    with loop_ext4(tmp_path) as mnt:
        yield mnt


def on_disk(store: Store) -> int:
    d = Path(store.path) / "nvme"
    return sum(p.stat().st_size for p in d.glob("seg-*.lseg"))


def test_a_full_disk_costs_misses_never_the_cached_chunks(small_disk: Path) -> None:
    """The tier's capacity (320 MiB) is larger than its disk (85 MB). Before, each failed
    batch kept its reserved space in the index; that phantom usage then evicted every real
    chunk. Now a failed write gives its space back, raises DiskFullError, and evicts nothing."""
    fmt = KVFormat("uint8", num_layers=1, num_kv_heads=1, head_dim=1, chunk_size=16)
    ns = Namespace("m", fmt)
    size = 2 << 20
    keys = ns.chunk_keys(list(range(16 * 200)))
    store = Store(small_disk / "s", StoreConfig(tiers={"nvme": TierConfig(capacity=320 * MiB)},
                                                 segment_bytes=16 * MiB))
    acked: list[bytes] = []
    fulls = 0
    fds: list[int] = []
    for k in keys:
        try:
            assert store.put(k, content(k, size), {"dtype": "uint8"}, tokens=16)
            acked.append(k)
        except DiskFullError as exc:
            assert "is full" in str(exc) and "nvme" in str(exc)
            fulls += 1
            fds.append(len(os.listdir("/proc/self/fd")))
            if fulls >= 20:
                break
    assert fulls == 20 and len(acked) > 20
    assert fds[-1] <= fds[1]  # failed writes and segment creations leak no file descriptors
    st = store.stats()
    assert st.counters["evicted"] == 0  # no phantom usage drove eviction
    assert st.tiers["nvme"].disk_bytes == on_disk(store)  # the index counts what is on disk
    assert store.locate(acked) == ["nvme"] * len(acked)
    for k in acked[:: max(1, len(acked) // 8)]:
        c = store.get(k)
        assert c is not None and bytes(c.data) == content(k, size)
    # space comes back: saving resumes
    store.evict(acked[: len(acked) // 2])
    store.compact(min_dead_ratio=0.0)
    assert store.put(keys[-1], content(keys[-1], size), {"dtype": "uint8"}, tokens=16)
    assert [p for p in store.check(deep=True) if not p.fixed] == []
    assert store.stats().tiers["nvme"].disk_bytes == on_disk(store)
    store.close()
    # and a reopened store agrees
    with Store(small_disk / "s") as again:
        assert [p for p in again.check(deep=True) if not p.fixed] == []
        assert again.stats().tiers["nvme"].disk_bytes == on_disk(again)


# -- a hostile or careless client ------------------------------------------------------------
def test_a_trickled_frame_is_cut_off_at_the_frame_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a frame has begun, all of it must arrive within the deadline however slowly it
    trickles (before, each byte restarted the clock: one byte a second held a thread forever)."""
    import socket
    import threading
    import time

    from lmctl import protocol

    monkeypatch.setattr(protocol, "FRAME_TIMEOUT", 0.6)
    a, b = socket.socketpair()
    frame = protocol.encode({"id": 1, "cmd": "status", "args": {}})
    stop = threading.Event()

    def trickle() -> None:
        for byte in frame:
            if stop.is_set():
                return
            try:
                a.send(bytes([byte]))
            except OSError:
                return
            time.sleep(0.1)

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    t0 = time.monotonic()
    with pytest.raises(protocol.ProtocolError, match="within"):
        protocol.read_frame(b, idle_timeout=5)
    assert time.monotonic() - t0 < 2
    stop.set()
    c, d = socket.socketpair()
    with pytest.raises(TimeoutError):  # an idle connection has its own deadline
        protocol.read_frame(d, idle_timeout=0.2)
    for s in (a, b, c, d):
        s.close()


def test_the_client_reconnects_when_the_daemon_closed_an_idle_connection(tmp_path: Path) -> None:
    import socket
    import threading

    from lmctl import protocol
    from lmctl.client import Client

    path = str(tmp_path / "fake.sock")
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(4)

    def serve() -> None:
        first, _ = srv.accept()
        protocol.read_frame(first)
        protocol.send(first, {"id": 1, "ok": True, "result": {"n": 1}})
        first.close()  # idle for too long: the daemon hangs up
        second, _ = srv.accept()
        msg = protocol.read_frame(second)
        assert msg is not None
        protocol.send(second, {"id": msg["id"], "ok": True, "result": {"n": 2}})
        second.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    c = Client(path, timeout=10)
    assert c.call("status") == {"n": 1}
    assert c.call("status") == {"n": 2}  # the kept connection was closed: made anew, once
    t.join(5)
    c.close()
    srv.close()


def test_connection_cap_nesting_idle_clients_and_huge_folders(tmp_path: Path) -> None:
    import json
    import socket
    import struct
    import time

    from test_daemon import Daemon, cli, fill

    from lmctl import protocol
    from lmctl.daemon import MAX_CLIENTS

    fill(tmp_path / "store")
    d = Daemon(tmp_path / "store")
    d.start()
    held: list[socket.socket] = []
    try:
        for _ in range(MAX_CLIENTS):
            s = socket.socket(socket.AF_UNIX)
            s.connect(str(d.sock))
            held.append(s)
        time.sleep(0.5)
        extra = socket.socket(socket.AF_UNIX)
        extra.settimeout(10)
        extra.connect(str(d.sock))
        r = protocol.read_frame(extra, 10)
        assert r is not None and "busy" in r["error"]["message"]
        extra.close()
        assert d.proc is not None
        threads = int(next(line.split()[1] for line in open(f"/proc/{d.proc.pid}/status")
                           if line.startswith("Threads:")))
        assert threads <= MAX_CLIENTS + 8  # one per client, no more
        for s in held[:8]:
            s.close()
        held = held[8:]
        time.sleep(0.3)
        # deeply nested JSON: an error reply, and the daemon serves on
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(10)
        s.connect(str(d.sock))
        body = b"[" * 200_000 + b"]" * 200_000
        s.sendall(struct.pack(">2sBxI", b"LM", protocol.VERSION, len(body)) + body)
        r = protocol.read_frame(s, 10)
        assert r is not None and "nested too deeply" in r["error"]["message"]
        s.close()
        r2 = cli(d, "--json", "status")
        assert r2.returncode == 0 and json.loads(r2.stdout)["daemon"]["clients"] >= 1
        # a folder that is no adapter is not walked (it was: all of /usr, for seconds)
        t0 = time.monotonic()
        r3 = cli(d, "ls", "--adapter", "/usr")
        assert r3.returncode == 2 and "not an adapter folder" in r3.stderr
        assert time.monotonic() - t0 < 20
        # SIGTERM with idle clients connected stops at once, not after a wait per client
        t0 = time.monotonic()
        assert d.stop() == 0
        assert time.monotonic() - t0 < 5
    finally:
        for s in held:
            s.close()
        if d.proc is not None:
            d.stop()


def test_a_read_only_store_serves_lookups_on_a_read_only_filesystem(small_disk: Path) -> None:
    """A store copied to (or mounted from) read-only media: lookups and reads work (before,
    opening it failed: LMDB wanted its lock file, the tiers wanted their folders)."""
    fmt = KVFormat("uint8", num_layers=1, num_kv_heads=1, head_dim=256, chunk_size=16)  # 8 KiB chunks
    ns = Namespace("m", fmt)
    tokens = list(range(16 * 6))
    keys = ns.chunk_keys(tokens)
    with Store(small_disk / "s", StoreConfig(tiers={"nvme": TierConfig(capacity=64 * MiB)})) as s:
        s.register_namespace(ns, {"model_id": "m"})
        for k in keys:
            s.put(k, content(k, 8192), {"dtype": "uint8"}, tokens=16)
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    try:
        with Store(small_disk / "s", readonly=True) as ro:
            assert ro.lookup(ns, tokens).hit_tokens == 16 * 6
            c = ro.get(keys[3])
            assert c is not None and bytes(c.data) == content(keys[3], 8192)
            assert ro.stats().tiers["nvme"].chunks == 6
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], check=False)

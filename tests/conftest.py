from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from store import GiB, KVFormat, MiB, Namespace, Store, StoreConfig, TierConfig
from testsupport.lmctl import env_with_path as env_with_path  # the tests import it from here

if TYPE_CHECKING:
    from redis_server import Server

    from store.clock import Clock
    from testsupport.lmctl import Daemon

ROOT = Path(__file__).resolve().parent.parent


#: modules that start a vLLM engine: the fast lane does not even import them
SLOW_MODULES = {"test_vllm_connector.py", "test_vllm_metrics.py", "test_router_index.py", "test_demo_tours.py"}


def slow_tests() -> set[str]:
    """The tests tests/slow.txt names (``file::function``), which the fast lane leaves out."""
    lines = (ROOT / "tests" / "slow.txt").read_text().splitlines()
    return {ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast", action="store_true",
                     help="the fast lane: leave out the engine modules and the tests tests/slow.txt names")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if config.getoption("--fast") and collection_path.name in SLOW_MODULES:
        return True
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With ``--fast``, the slow tests are deselected. Tests marked ``gpu`` run only where
    torch sees a CUDA device."""
    if config.getoption("--fast"):
        slow = slow_tests()
        keep = [i for i in items if i.nodeid.split("[")[0] not in slow]
        if len(keep) < len(items):
            config.hook.pytest_deselected(items=[i for i in items if i.nodeid.split("[")[0] in slow])
            items[:] = keep
    gpu = [i for i in items if i.get_closest_marker("gpu")]
    if not gpu:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in gpu:
            item.add_marker(skip)


def content(key: bytes, n: int) -> bytes:
    """Deterministic payload for a key, so any process can check what it reads."""
    seed = hashlib.sha256(key).digest()
    block = hashlib.shake_256(seed).digest(min(n, 1 << 16))
    out = (block * (n // len(block) + 1))[:n]
    # make every 64 KiB window unique to the key and position
    mv = bytearray(out)
    for i in range(0, n, 1 << 16):
        mv[i : i + 8] = i.to_bytes(8, "little")
    return bytes(mv)


def key(i: int) -> bytes:
    """The test suite's chunk key number ``i`` (a fixed namespace prefix, then ``i``)."""
    return b"\x01" * 16 + i.to_bytes(32, "big")


SMALL_FMT = KVFormat("bfloat16", num_layers=2, num_kv_heads=2, head_dim=32, chunk_size=16)
SMALL_LAYOUT = {"dtype": "bfloat16", "shape": list(SMALL_FMT.chunk_shape)}


@pytest.fixture
def ns() -> Namespace:
    return Namespace("test-model", SMALL_FMT)


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[Callable[..., Store]]:
    opened: list[Store] = []

    def make(path: Path | None = None, capacity: int = 1 * GiB, segment_bytes: int = 4 * MiB, *,
             pin_budget: float = 0.5, clock: Clock | None = None, **kw: object) -> Store:
        # clock: a store.clock.ManualClock, where the test moves time instead of sleeping
        cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=capacity, pin_budget=pin_budget)},
                          segment_bytes=segment_bytes, **kw)  # type: ignore[arg-type]
        s = Store(path or tmp_path / "store", cfg, clock=clock)
        opened.append(s)
        return s

    yield make
    for s in opened:
        s.close()


@pytest.fixture
def store(make_store: Callable[..., Store]) -> Store:
    return make_store()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    """``lmctl serve`` over a store of six chunks (``test_daemon.fill``); it must stop cleanly."""
    from test_daemon import Daemon, fill

    fill(tmp_path / "store")
    d = Daemon(tmp_path / "store")
    d.start()
    yield d
    if d.proc is not None:
        assert d.stop() == 0
    assert not d.sock.exists()


@contextmanager
def loop_ext4(tmp_path: Path, size: str = "85M", options: str = "loop") -> Iterator[Path]:
    """A small ext4 filesystem in an image file, mounted with ``options`` (loop); skips the
    test where that cannot be done (needs root, mkfs.ext4 and loop devices)."""
    import shutil
    import subprocess

    if os.geteuid() != 0 or not shutil.which("mkfs.ext4"):
        pytest.skip("needs root and mkfs.ext4 to mount a small filesystem")
    img, mnt = tmp_path / "disk.img", tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run(["truncate", "-s", size, str(img)], check=True)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True)
    r = subprocess.run(["mount", "-o", options, str(img), str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot loop-mount a filesystem here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=False)  # still busy (a failed test): detach


def flip_byte(store: Store, k: bytes, where: str = "payload") -> None:
    """Corrupt one byte of a stored chunk's payload (or its trailer) on disk."""
    info = store.info(k)
    assert info is not None
    path = Path(store.path) / info.tier / f"seg-{info.segment:012d}.lseg"
    # the payload starts the record; its trailer follows at the next 4 KiB boundary
    trailer = info.offset + (info.stored_bytes + 4095) // 4096 * 4096
    pos = info.offset + 200 if where == "payload" else trailer + 20
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)
        f.seek(pos)
        f.write(bytes([b[0] ^ 0x5A]))


@contextmanager
def fake_engine(on_post: Callable[[str, Any], None] | None = None) -> Iterator[tuple[str, list[tuple[str, Any]]]]:
    """A stand-in for an engine's OpenAI-compatible server on loopback: ``(url, requests)``,
    each request its path and JSON body; every POST is answered ``{}`` (after
    ``on_post(path, body)``, which may store what an engine would)."""
    import http.server
    import json
    import threading

    requests: list[tuple[str, Any]] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            requests.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
            if on_post is not None:
                on_post(*requests[-1])
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *a: object) -> None:
            return

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", requests
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """Start redis-servers (tests/redis_server.py: plain, on a free port, unless told
    otherwise); all are stopped at the end."""
    from redis_server import Server

    started: list[Server] = []

    def start(*args: str, wait: bool = True, **client_kw: Any) -> Server:
        s = Server(tmp_path / f"redis{len(started)}", *args)
        started.append(s)
        if wait:
            s.wait(lambda: s.client(**client_kw))
        return s

    yield start
    for s in started:
        s.stop()


class Hosts:
    """The ``hosts`` fixture: stores on "machines" (folders under ``root``) of one deployment,
    on one Redis server, ``redis``; ``secret`` is the deployment's secret's file."""

    def __init__(self, root: Path, redis: Server, secret: str) -> None:
        self.root = root
        self.redis = redis
        self.secret = secret
        self.opened: list[Store] = []

    def __call__(self, name: str, write: str = "always", url: str | None = None, prefix: str = "test",
                 **remote: Any) -> Store:
        from store.config import RemoteConfig

        remote.setdefault("secret_file", self.secret)
        cfg = StoreConfig(tiers={"nvme": TierConfig(capacity=256 * MiB)},
                          remote=RemoteConfig(url or self.redis.url, key_prefix=prefix, write=write, **remote))
        s = Store(self.root / name, cfg)
        self.opened.append(s)
        return s


@pytest.fixture
def hosts(tmp_path: Path, servers: Callable[..., Any]) -> Iterator[Hosts]:
    """Stores on "machines" (folders) of one deployment, on one Redis server: ``hosts(name,
    write="always", url=None, prefix="test", **remote)`` (``remote``: more of the store's
    ``RemoteConfig``; the deployment's secret unless told otherwise). ``hosts.redis`` is the
    server, ``hosts.secret`` the secret's file."""
    from redis_server import secret_file

    host = Hosts(tmp_path, servers(), str(secret_file(tmp_path)))
    yield host
    for s in host.opened:
        s.close()


def recount(store: Store) -> dict[str, Any]:
    """The counts ``Store.counts`` keeps, taken here from every chunk and label instead (an
    oracle independent of the index's bookkeeping), in the same shape as ``counts_of``."""
    from store import Counts

    ns: dict[tuple[bytes, str], Counts] = {}
    infos = {c.key: c for c in store.iter_chunks()}
    for c in infos.values():
        pinned = c.pin_refs > 0
        d = Counts(1, c.stored_bytes, c.disk_bytes, int(pinned), c.stored_bytes * pinned, c.disk_bytes * pinned)
        ns.setdefault((c.key[:16], c.tier), Counts()).add(d)
    labels: dict[tuple[str, bytes, str], Counts] = {}
    label_keys: dict[str, int] = {}
    for label, keys in store.labels().items():
        label_keys[label] = len(keys)
        for k in keys:
            i = infos.get(k)
            if i is not None:
                d = Counts(1, i.stored_bytes, i.disk_bytes, 1, i.stored_bytes, i.disk_bytes)
                labels.setdefault((label, k[:16], i.tier), Counts()).add(d)
    return {"namespaces": {k: v for k, v in ns.items()}, "labels": labels, "label_keys": label_keys}


def counts_of(store: Store) -> dict[str, Any]:
    """``Store.counts`` flattened like ``recount``."""
    c = store.counts()
    return {"namespaces": {(nid, t): v for nid, tiers in c.namespaces.items() for t, v in tiers.items()},
            "labels": {(label, nid, t): v for label, nss in c.labels.items() for nid, tiers in nss.items()
                       for t, v in tiers.items()},
            "label_keys": dict(c.label_keys)}


def assert_counts_match(store: Store) -> None:
    """The kept counts equal a recount from the chunks, and verify finds no drift."""
    assert counts_of(store) == recount(store)
    drift = [p for p in store.check() if p.kind in ("counts", "counter", "segment-count")]
    assert drift == [], drift

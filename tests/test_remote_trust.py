"""The authenticated remote tier against an attacker: two stores of one deployment share a real
redis-server, and a plain redis-py client with full access to their prefix (but not the
deployment secret) rewrites, swaps, plants and forges values. Nothing it writes is ever served:
a forged value is a miss counted ``forged``, dropped from the server and never promoted; names
tell it neither documents nor salts; a head's claims cannot make a reader allocate.

Also: the deployment secret's file (its checks, ``lmctl remote secret``), rotation, payload
encryption, a tier without a secret (refused unless ``trust = "all-writers"``), and the
provenance of promoted chunks.
"""

from __future__ import annotations

import json
import os
import re
import stat
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from conftest import SMALL_FMT, SMALL_LAYOUT, Hosts, content, env_with_path
from redis_server import Server, as_bytes, secret_file
from test_cli import lmctl
from test_daemon import Daemon, cj

from lmctl.settings import apply_settings
from store import MiB, Namespace, PutItem, Store, StoreConfig, StoreError
from store.config import RemoteConfig
from store.format.remote_auth import MODE_MAC, MODE_PLAIN, Keys, new_nonce, read_secret
from store.format.remote_value import MAX_STORED, RemoteMeta, pack_meta
from store.tiers.remote import RemoteTier

N = SMALL_FMT.chunk_bytes
NS = Namespace("public-model", SMALL_FMT)  # unsalted: anyone can compute its keys
TOKENS = list(range(16 * 4))
PREFIX = "test"


def remote(s: Store) -> dict[str, Any]:
    st = s.stats().remote
    assert st is not None
    return st


def tier_of(s: Store) -> RemoteTier:
    assert s._sharing is not None
    return s._sharing.tier


def heads(r: redis.Redis) -> list[bytes]:
    return sorted(n for n in map(as_bytes, r.keys(f"{PREFIX}:*")) if n.endswith(b":h"))


def pieces_of(r: redis.Redis, head: bytes) -> list[bytes]:
    tag = head[:-2]
    return sorted((n for n in map(as_bytes, r.keys(tag + b":*")) if not n.endswith(b":h")),
                  key=lambda n: int(n.rsplit(b":", 1)[1]))


def forge_plain(r: redis.Redis, head: str, key: bytes, payload: bytes, piece_bytes: int = 4 << 20) -> None:
    """What an attacker can write without the secret: a complete value of the format at
    ``head`` for ``key``, every checksum valid (xxh3, as the format has without a secret)."""
    import xxhash

    meta = RemoteMeta(raw_len=len(payload), layout=dict(SMALL_LAYOUT), tokens=16)
    body = pack_meta(meta, len(payload), piece_bytes, time.time(), 0,
                      xxhash.xxh3_64(payload).digest() + bytes(24))
    r.set(head, Keys.derive(None).seal_head(MODE_PLAIN, head, key, new_nonce(), body))
    tag = head[:-2]
    for i in range(0, max(1, -(-len(payload) // piece_bytes))):
        r.set(f"{tag}:{i}", payload[i * piece_bytes:(i + 1) * piece_bytes])


def commands_of(r: redis.Redis, fn: Callable[[], object]) -> list[str]:
    """The commands the server ran while ``fn`` ran (MONITOR), as text."""
    seen: list[str] = []
    ready, done = threading.Event(), threading.Event()

    def watch() -> None:
        with r.monitor() as m:
            ready.set()
            for cmd in m.listen():
                seen.append(str(cmd.get("command", "")))
                if "lmx-monitor-end" in seen[-1]:
                    done.set()
                    return

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    assert ready.wait(5)
    time.sleep(0.1)
    fn()
    r.echo("lmx-monitor-end")
    assert done.wait(10)
    return seen


# -- (a) a forged value with valid checksums ------------------------------------------------------
def test_a_forged_value_with_valid_checksums_is_a_miss_counted_forged_dropped_and_never_served(
        hosts: Hosts) -> None:
    a, b = hosts("a"), hosts("b")
    r = hosts.redis.client()
    k, ok = NS.chunk_keys(TOKENS)[:2]
    evil = bytes(N)  # the attacker's KV: all zeros
    # 1. the pieces rewritten under a head the writer made (its MAC is good, the payload's fails)
    assert a.put(k, content(k, N), SMALL_LAYOUT, 16)
    [head] = heads(r)
    for p in pieces_of(r, head):
        r.set(p, evil[:len(r.get(p) or b"")])
    assert b.get_into(k, bytearray(N)) is None
    assert remote(b)["forged"] == 1 and r.dbsize() == 0  # dropped from the server
    # 2. a whole value of the format at the chunk's name, every checksum recomputed
    assert a.evict([k]).chunks == 1 and a.put(k, content(k, N), SMALL_LAYOUT, 16)  # shared again
    [head] = heads(r)
    forge_plain(r, head.decode(), k, evil)
    assert b.get(k) is None and b.get_into(k, bytearray(N)) is None
    st = remote(b)
    assert (st["forged"], st["hits"], st["foreign"], st["torn"]) == (2, 0, 0, 0) and r.dbsize() == 0
    assert b.locate([k], remote=False) == [None] and b.stats().counters["puts"] == 0  # never promoted
    # what was not attacked is served as it was written
    assert a.put(ok, content(ok, N), SMALL_LAYOUT, 16)
    out = bytearray(N)
    assert b.get_into(ok, out) is not None and bytes(out) == content(ok, N)
    assert b.check(deep=True) == []
    cells = b.metric_cells()
    assert [c.value for c in cells if c.name == "remote_bad_values_total" and c.labels == {"kind": "forged"}] == [2]
    r.flushall()
    assert b.get(k) is None and b.locate([k]) == [None]  # nothing of it stayed behind


# -- (b) a value swapped in from another chunk ------------------------------------------------------
def test_a_value_swapped_from_another_chunk_is_forged(hosts: Hosts) -> None:
    a, b = hosts("a"), hosts("b")
    r = hosts.redis.client()
    k1, k2 = NS.chunk_keys(TOKENS)[:2]
    assert a.put(k1, content(k1, N), SMALL_LAYOUT, 16) and a.put(k2, content(k2, N), SMALL_LAYOUT, 16)
    h1, h2 = heads(r)
    v1 = {n: r.get(n) for n in [h1, *pieces_of(r, h1)]}
    v2 = {n: r.get(n) for n in [h2, *pieces_of(r, h2)]}
    # the attacker cannot tell which name is which chunk's: it swaps the two whole values
    for (n1, x1), (n2, x2) in zip(v1.items(), v2.items(), strict=True):
        r.set(n1, x2 or b"")
        r.set(n2, x1 or b"")
    assert b.get(k1) is None and b.get(k2) is None
    assert remote(b)["forged"] == 2 and remote(b)["hits"] == 0 and r.dbsize() == 0
    # only the pieces swapped, under each chunk's own head
    assert a.evict([k1, k2]).chunks == 2
    assert a.put(k1, content(k1, N), SMALL_LAYOUT, 16) and a.put(k2, content(k2, N), SMALL_LAYOUT, 16)
    h1, h2 = heads(r)
    p1, p2 = pieces_of(r, h1)[0], pieces_of(r, h2)[0]
    x1, x2 = r.get(p1), r.get(p2)
    r.set(p1, x2 or b"")
    r.set(p2, x1 or b"")
    assert b.get(k1) is None and b.get(k2) is None and remote(b)["forged"] == 4


# -- (c) a value planted where anyone can compute a name ------------------------------------------
def test_a_value_planted_at_a_name_computed_without_the_secret_is_never_read(hosts: Hosts) -> None:
    b = hosts("b")
    r = hosts.redis.client()
    keys = NS.chunk_keys(TOKENS)  # the chunks of a public model's unsalted system prompt
    planted = []
    for k in keys:
        for head in (f"{PREFIX}:{{{k.hex()}}}:h",  # the names of earlier versions
                     f"{PREFIX}:{{{Keys.derive(None).tag(k)}}}:h"):  # those of a tier without a secret
            forge_plain(r, head, k, bytes(N))
            planted.append(head[:-2])
    seen = commands_of(hosts.redis.client(), lambda: (
        b.lookup(NS, TOKENS), [b.get(k) for k in keys], b.get_into(keys[0], bytearray(N))))
    assert seen and not [c for c in seen if any(p in c for p in planted)]  # never even asked for
    assert b.lookup(NS, TOKENS).hit_tokens == 0
    st = remote(b)
    assert st["hits"] == 0 and st["forged"] == 0 and st["foreign"] == 0 and b.stats().counters["puts"] == 0


# -- (d) names and heads reveal nothing -------------------------------------------------------------
def test_names_reveal_neither_documents_nor_salts_and_heads_no_metadata(hosts: Hosts) -> None:
    a = hosts("a")
    r = hosts.redis.client()
    salted = Namespace("public-model", SMALL_FMT, cache_salt="tenant-7")
    keys = salted.chunk_keys(TOKENS)
    assert all(a.put_many([PutItem(k, content(k, N), SMALL_LAYOUT, 16) for k in keys]))
    names = [as_bytes(n).decode() for n in r.keys("*")]
    assert len(names) == 2 * len(keys)
    tags = {re.fullmatch(rf"{PREFIX}:\{{([0-9a-f]{{32}})\}}:(?:h|\d+)", n).group(1) for n in names}  # type: ignore[union-attr]
    assert len(tags) == len(keys)
    for n in names:  # no key, namespace id or salt in a name
        assert all(k.hex()[:32] not in n and k.hex()[32:] not in n for k in keys) and "tenant" not in n
    # an offline guess of the salt (the document known) matches no name: names are keyed
    for guess in [f"tenant-{i}" for i in range(100)] + [None]:
        for k in Namespace("public-model", SMALL_FMT, cache_salt=guess).chunk_keys(TOKENS):
            for tag in (k.hex(), Keys.derive(None).tag(k)):
                assert tag not in tags
                assert r.exists(f"{PREFIX}:{{{tag}}}:h", f"{PREFIX}:{{{tag}}}:0") == 0  # nor tests residency
    # a head holds nothing a reader without the secret can use: no layout, length or token count
    for n in names:
        if n.endswith(":h"):
            h = r.get(n) or b""
            assert len(h) < 300 and b"dtype" not in h and b"bfloat16" not in h and b"shape" not in h
            assert struct.pack("<Q", N) not in h and struct.pack("<I", N) not in h


# -- (e) rotation -------------------------------------------------------------------------------
def test_rotation_reads_both_secrets_writes_the_new_one_and_forgets_the_old(hosts: Hosts,
                                                                          tmp_path: Path) -> None:
    old, new = hosts.secret, str(secret_file(tmp_path, "new.secret"))
    a = hosts("a", secret_file=old)
    b = hosts("b", secret_file=old, promote=False)
    k1, k2, k3 = NS.chunk_keys(TOKENS)[:3]
    assert a.put(k1, content(k1, N), SMALL_LAYOUT, 16)

    def reconfigure(s: Store, **kw: Any) -> None:
        cfg = StoreConfig.from_json(s.config.to_json())
        assert cfg.remote is not None
        for name, v in kw.items():
            setattr(cfg.remote, name, v)
        s.configure(cfg)

    reconfigure(b, secret_file=new, previous_secret_file=old)  # both: the old values still read
    assert remote(b)["rotating"]
    got = b.get(k1)
    assert got is not None and bytes(got.data) == content(k1, N)
    assert b.put(k2, content(k2, N), SMALL_LAYOUT, 16)  # written under the new secret only
    assert b.locate([k1, k2, k3]) == ["remote", "nvme", None]
    assert b.evict([k2]).chunks == 1 and b.locate([k2]) == ["remote"]
    assert a.locate([k2]) == [None] and a.get(k2) is None and remote(a)["forged"] == 0  # a has only the old
    reconfigure(b, previous_secret_file=None)  # the rotation is over: the old secret is gone
    assert b.locate([k1, k2]) == [None, "remote"] and b.get(k1) is None
    got = b.get(k2)
    assert got is not None and bytes(got.data) == content(k2, N)
    st = remote(b)
    assert (st["forged"], st["foreign"], st["rotating"]) == (0, 0, False)


# -- (f) encryption -------------------------------------------------------------------------------
def test_encrypted_values_hold_no_plaintext_and_pieces_cannot_be_swapped_or_reordered(
        hosts: Hosts, servers: Callable[..., Server]) -> None:
    a, b = hosts("a", encrypt=True), hosts("b", encrypt=True)
    r = hosts.redis.client()
    k = NS.chunk_keys(TOKENS)[0]
    known = content(k, N)
    assert a.put(k, known, SMALL_LAYOUT, 16)
    values = [r.get(n) or b"" for n in r.keys("*")]
    assert all(known[i:i + 16] not in v for v in values for i in range(0, N - 16, 64))
    assert remote(a)["trust"] == "secret+encrypt"
    out = bytearray(N)
    assert b.get_into(k, out) is not None and bytes(out) == known
    # pieces of one value reordered, or one taken from another value: forged
    pb = 4096
    tier = tier_of(a)
    t = RemoteTier(hosts.redis.url, key_prefix="enc", secret_file=hosts.secret, encrypt=True,
                   piece_bytes=pb)
    try:
        def put(i: int) -> bytes:
            data = content(bytes([i]) * 48, 3 * pb)
            assert t.put(bytes([i]) * 48, data, RemoteMeta(raw_len=len(data)))
            return data

        data = put(1)
        names = t.piece_keys(bytes([1]) * 48, 3)
        assert all(len(r.get(n) or b"") == pb + 16 for n in names)  # each with its GCM tag
        got = t.get(bytes([1]) * 48, max_stored=3 * pb)
        assert got is not None and bytes(got[1]) == data
        x0, x1 = r.get(names[0]), r.get(names[1])
        r.set(names[0], x1 or b"")
        r.set(names[1], x0 or b"")
        assert t.get(bytes([1]) * 48, max_stored=3 * pb) is None and t.stats().forged == 1
        put(1)
        put(2)
        r.set(names[2], r.get(t.piece_keys(bytes([2]) * 48, 3)[2]) or b"")
        assert t.get(bytes([1]) * 48, max_stored=3 * pb) is None and t.stats().forged == 2
        put(1)
        r.set(names[2], (r.get(names[2]) or b"")[:-16])  # its tag cut off: a piece of the wrong length
        assert t.get(bytes([1]) * 48, max_stored=3 * pb) is None and t.stats().torn == 1
        assert tier.stats().forged == 0 and t.stats().hits == 1
    finally:
        t.close()


# -- (g) no secret -------------------------------------------------------------------------------
def one_line(exc: pytest.ExceptionInfo[StoreError]) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_a_tier_without_a_secret_refuses_to_start_unless_all_writers_are_trusted(
        hosts: Hosts, tmp_path: Path) -> None:
    url = hosts.redis.url
    with pytest.raises(StoreError) as e:
        RemoteConfig(url).validate()
    assert "has no secret" in one_line(e) and "lmctl remote secret PATH" in one_line(e)
    with pytest.raises(StoreError, match="has no secret"):
        Store(tmp_path / "s", StoreConfig(remote=RemoteConfig(url)))
    with pytest.raises(StoreError, match="has no secret"):
        apply_settings(StoreConfig(), {"remote.url": url})
    with pytest.raises(StoreError, match="has no secret"):
        RemoteTier(url, key_prefix="t")
    for bad, why in (({"remote.trust": "everyone"}, "not known"),
                     ({"remote.trust": "all-writers", "remote.encrypt": "true"}, "need remote.secret_file"),
                     ({"remote.trust": "all-writers", "remote.secret_file": hosts.secret},
                      "contradict")):
        with pytest.raises(StoreError, match=why):
            apply_settings(StoreConfig(), {"remote.url": url, **bad})
    # the daemon refuses such settings with one line and exit 2
    r = subprocess.run([sys.executable, "-m", "lmctl.cli", "serve", "--store", str(tmp_path / "d"), "--init",
                        "--remote", url], capture_output=True, text=True, env=env_with_path(), timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "lmctl remote secret" in r.stderr
    # trust = "all-writers": it starts, and trusts every writer: a forged value with valid
    # checksums is served (what the operator guide says this setting means)
    a, b = hosts("a", secret_file=None, trust="all-writers"), hosts("b", secret_file=None, trust="all-writers")
    k = NS.chunk_keys(TOKENS)[0]
    assert a.put(k, content(k, N), SMALL_LAYOUT, 16)
    rc = hosts.redis.client()
    [head] = heads(rc)
    forge_plain(rc, head.decode(), k, bytes(N))
    got = b.get(k)
    assert got is not None and bytes(got.data) == bytes(N) and remote(b)["trust"] == "all-writers"
    # settings an older lmctl recorded without a secret: the store opens, its remote tier stays off
    c = hosts("c", secret_file=None, trust="all-writers")
    insecure = StoreConfig.from_json(c.config.to_json())
    assert insecure.remote is not None
    insecure.remote.trust = None
    c._index.write(lambda t: t.raw.put(b"config", insecure.to_json().encode(), db=c._index.meta))
    c.close()
    with Store(tmp_path / "c") as c2:
        assert not c2.has_remote and "has no secret" in (c2.stats().remote_refused or "")
        assert c2.put(k, content(k, N), SMALL_LAYOUT, 16) and c2.get(k) is not None  # local tiers serve


def test_trust_settings_by_name_and_in_a_config_file(hosts: Hosts, tmp_path: Path) -> None:
    from lmctl.settings import read_config_file

    url, secret = hosts.redis.url, hosts.secret
    cfg = apply_settings(StoreConfig(), {"remote.url": url, "remote.secret_file": secret,
                                         "remote.previous_secret_file": secret, "remote.encrypt": "yes"})
    assert cfg.remote is not None and (cfg.remote.secret_file, cfg.remote.previous_secret_file, cfg.remote.encrypt,
                                       cfg.remote.trust) == (secret, secret, True, None)
    cfg = apply_settings(cfg, {"remote.secret_file": "none", "remote.previous_secret_file": "",
                               "remote.encrypt": "false", "remote.trust": "all-writers"})
    assert cfg.remote is not None and (cfg.remote.secret_file, cfg.remote.trust) == (None, "all-writers")
    toml = tmp_path / "lmctl.toml"
    toml.write_text(f'[remote]\nurl = "{url}"\nsecret_file = "{secret}"\nencrypt = true\n')
    _daemon, changes = read_config_file(str(toml))
    cfg = apply_settings(StoreConfig(), changes)
    assert cfg.remote is not None and cfg.remote.encrypt and cfg.remote.secret_file == secret
    with pytest.raises(StoreError, match="remote.secret_file must be a string"):
        apply_settings(StoreConfig(), {"remote.url": url, "remote.secret_file": 7})


def test_the_secret_file_must_be_private_regular_and_hold_a_secret(tmp_path: Path,
                                                                   hosts: Hosts) -> None:
    good = Path(hosts.secret)
    assert len(read_secret(good)) == 32

    def refused(path: Path, why: str) -> None:
        with pytest.raises(StoreError) as e:
            read_secret(path)
        assert why in one_line(e), str(e.value)

    loose = secret_file(tmp_path, "loose")
    loose.chmod(0o640)
    refused(loose, "can be read or written by other users (mode 0640)")
    if os.geteuid() == 0:  # only root can give a file away (CI runs as root)
        theirs = secret_file(tmp_path, "theirs")
        os.chown(theirs, 54321, -1)  # another user's (no such account is needed for a uid)
        refused(theirs, "belongs to uid 54321")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    t0 = time.monotonic()
    refused(fifo, "not a regular file")
    assert time.monotonic() - t0 < 5  # the FIFO did not hang the open
    short = tmp_path / "short"
    short.write_text("abcd\n")
    short.chmod(0o600)
    refused(short, "64 to 256 hex digits")
    refused(tmp_path / "missing", "cannot read")
    link = tmp_path / "link"
    link.symlink_to(good)  # a link to a good secret (as a mounted Kubernetes secret is) is that secret
    assert read_secret(link) == read_secret(good)
    # a store refuses settings naming a bad file, and changes nothing
    s = hosts("s")
    before = s.config.to_json()
    cfg = StoreConfig.from_json(before)
    assert cfg.remote is not None
    cfg.remote.secret_file = str(loose)
    with pytest.raises(StoreError, match="other users"):
        s.configure(cfg)
    assert s.config.to_json() == before and s.has_remote
    with s._index.read() as t:
        stored = t.raw.get(b"config", db=s._index.meta)
        assert stored is not None and bytes(stored) == before.encode()


def test_lmctl_remote_secret_makes_a_private_secret_and_never_overwrites(tmp_path: Path) -> None:
    path = tmp_path / "remote.secret"
    r = lmctl(None, "--json", "remote", "secret", str(path))
    assert r.exit_code == 0, r.stdout
    assert json.loads(r.stdout) == {"path": str(path), "bytes": 32, "mode": "0600"}
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and re.fullmatch(r"[0-9a-f]{64}\n", path.read_text())
    assert len(read_secret(path)) == 32
    text = path.read_text()
    r = lmctl(None, "remote", "secret", str(path))
    assert r.exit_code == 2 and "never overwrites" in r.stderr and path.read_text() == text
    (tmp_path / "elsewhere").symlink_to(tmp_path / "target")
    r = lmctl(None, "remote", "secret", str(tmp_path / "elsewhere"))
    assert r.exit_code == 2 and not (tmp_path / "target").exists()  # a link is not followed
    r = lmctl(None, "remote", "secret", str(tmp_path / "no-such-folder" / "s"))
    assert r.exit_code == 1 and "cannot create" in r.stderr


# -- (h) forged lengths -------------------------------------------------------------------------
def plant_huge_head(r: redis.Redis, tier: RemoteTier, key: bytes, keys: Keys | None = None) -> None:
    """A head (with a valid MAC: a trusted writer's bug, or any client without a secret)
    claiming a chunk of 16 GiB - 1 bytes, in 32 pieces of 512 MiB."""
    keys = keys or tier.keyring[0]
    head = tier.head_key(key, keys)
    size, piece = MAX_STORED - 1, 512 * MiB
    meta = RemoteMeta(raw_len=size, layout=dict(SMALL_LAYOUT), tokens=16)
    body = pack_meta(meta, size, piece, time.time(), 0, bytes(32))
    r.set(head, keys.seal_head(MODE_MAC if keys.authenticated else MODE_PLAIN, head, key, new_nonce(), body))


def test_a_16_GiB_head_claim_allocates_nothing(hosts: Hosts, tmp_path: Path) -> None:
    a, b = hosts("a"), hosts("b")
    r = hosts.redis.client()
    k, other = NS.chunk_keys(TOKENS)[:2]
    plant_huge_head(r, tier_of(a), k)
    tracemalloc.start()
    try:
        assert b.get_into(k, bytearray(N)) is None
        assert b.get(k) is None  # no namespace record: the conservative bound
        b.register_namespace(NS)
        assert b.get(k) is None  # the namespace's chunk bytes
        _size, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * MiB
    assert remote(b)["foreign"] == 3 and remote(b)["hits"] == 0
    # a chunk longer than the buffer, or shorter than the namespace's chunk: a miss, not an error
    assert a.put(other, content(other, 2 * N), SMALL_LAYOUT, 16)
    assert b.get_into(other, bytearray(N)) is None and b.get(other) is None and remote(b)["foreign"] == 5
    # the tier alone, in a process that may map only 2 GiB: the claim is refused before any allocation
    code = f"""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
from store.tiers.remote import RemoteTier
t = RemoteTier({hosts.redis.url!r}, key_prefix={PREFIX!r}, secret_file={hosts.secret!r})
assert t.get({k!r}, max_stored={N}) is None
assert t.get_into({k!r}, bytearray({N})) is None
st = t.stats()
assert (st.foreign, st.too_small, st.errors) == (1, 1, 0), st
print("refused")
"""
    env = {**env_with_path(), "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0 and "refused" in p.stdout, p.stderr[-2000:]


def test_a_16_GiB_head_claim_without_a_secret_allocates_nothing(hosts: Hosts) -> None:
    """Without a secret any client can write a head whose checksum is good: bounded all the same."""
    b = hosts("b", secret_file=None, trust="all-writers")
    r = hosts.redis.client()
    k = NS.chunk_keys(TOKENS)[0]
    plant_huge_head(r, tier_of(b), k)
    tracemalloc.start()
    try:
        assert b.get_into(k, bytearray(N)) is None and b.get(k) is None
        _size, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * MiB and remote(b)["foreign"] == 2


# -- provenance -------------------------------------------------------------------------------------
def test_a_promoted_chunk_keeps_its_provenance(hosts: Hosts, tmp_path: Path) -> None:
    a, b = hosts("a"), hosts("b")
    keys = NS.chunk_keys(TOKENS)
    k, mine = keys[0], keys[1]
    assert a.put(k, content(k, N), SMALL_LAYOUT, 16)
    t0 = time.time()
    assert b.get_into(k, bytearray(N)) is not None  # read remotely, promoted
    assert b.put(mine, content(mine, N), SMALL_LAYOUT, 16)  # computed here
    writer = int(remote(a)["writer"], 16)
    info = b.info(k)
    assert info is not None and info.tier == "nvme" and info.origin is not None
    assert (info.origin.tier, info.origin.writer) == ("remote", writer) and t0 - 1 < info.origin.at < time.time() + 1
    assert (b.info(mine) or info).origin is None
    assert b.rewrite([k], codec="zstd-shuffle").chunks == 1  # re-encoded: still from the remote tier
    assert (b.info(k) or info).origin == info.origin
    b.close()
    with Store(tmp_path / "b") as again:  # durable
        assert (again.info(k) or info).origin == info.origin
    import shutil

    shutil.rmtree(tmp_path / "b" / "index")  # the index lost: rebuilt from the records, provenance too
    with Store(tmp_path / "b") as rebuilt:
        got = rebuilt.info(k)
        assert got is not None and got.origin is not None and (got.origin.tier, got.origin.writer) == ("remote", writer)
        assert (rebuilt.info(mine) or got).origin is None
    d = Daemon(tmp_path / "b")
    d.start()
    try:
        rows = {c["key"]: c for c in cj(d, "ls")["chunks"]}
        assert rows[k.hex()]["origin"]["tier"] == "remote" and rows[k.hex()]["origin"]["writer"] == f"{writer:08x}"
        assert rows[mine.hex()]["origin"] is None
        assert cj(d, "inspect", "--key", k.hex())["chunk"]["origin"]["writer"] == f"{writer:08x}"
        assert cj(d, "evict", "--key", k.hex())["chunks"] == 1  # dropped with the chunk
    finally:
        d.stop()
    with Store(tmp_path / "b") as s:
        assert s.info(k) is None
        assert s.put(k, content(k, N), SMALL_LAYOUT, 16) and (s.info(k) or info).origin is None


# -- large values: checks on a helper thread (a lane) or inline ------------------------------------
@pytest.mark.parametrize("encrypt", [False, True])
@pytest.mark.parametrize("lanes", [False, True])
def test_large_values_are_checked_alike_inline_and_on_a_lane(hosts: Hosts, encrypt: bool,
                                                             lanes: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A value of several MiB is MAC'd (or decrypted) as it lands, inline or on a helper thread
    (where the process has the cores for one): the same verdicts either way, and a read cut off
    in the middle leaves nothing running on the caller's buffer."""
    import store.tiers.resp as resp

    srv = hosts.redis
    r = srv.client()
    size, pb = 3 << 20, 1 << 20
    t = RemoteTier(srv.url, key_prefix="big", secret_file=hosts.secret, encrypt=encrypt, piece_bytes=pb)
    t.use_lanes = lanes
    try:
        k = b"\x05" * 48
        data = content(k, size)

        def put() -> None:
            assert t.put(k, data, RemoteMeta(raw_len=size))

        put()
        out = bytearray(size)
        assert t.get_into(k, out) is not None and bytes(out) == data
        assert (t._lanes is not None) == lanes
        p = t.piece_keys(k, 3)[1]
        v = bytearray(as_bytes(r.get(p) or b""))
        v[12345] ^= 0x40
        r.set(p, bytes(v))
        assert t.get_into(k, out) is None and t.stats().forged == 1 and r.dbsize() == 0
        put()
        real = resp.ReplyReader.read_into
        calls = [0]

        def cut(self: Any, dst: memoryview, land: Any = None, end: bool = True) -> None:
            calls[0] += 1
            if calls[0] == 3:
                raise redis.ConnectionError("cut off")
            real(self, dst, land, end)

        monkeypatch.setattr(resp.ReplyReader, "read_into", cut)
        assert t.get_into(k, out) is None and t.stats().errors == 1
        monkeypatch.setattr(resp.ReplyReader, "read_into", real)
        assert t.get_into(k, out) is not None and bytes(out) == data
    finally:
        t0 = time.monotonic()
        t.close()  # no lane is left waiting
        assert time.monotonic() - t0 < 5


# -- the payload's MAC (GMAC under the value's own key) ---------------------------------------------
def test_the_payload_mac_is_the_same_over_any_slicing_and_bound_to_its_value() -> None:
    """The reader MACs each slice as it lands from the socket, at whatever lengths recv gives:
    the tag must not depend on them. It must depend on every byte, the chunk, the name and the
    value's nonce."""
    import random

    from store.format.remote_auth import TAG_BYTES

    keys = Keys.derive(os.urandom(32))
    k1, k2 = NS.chunk_keys(TOKENS)[:2]
    nonce = new_nonce()
    data = os.urandom(3 * 65536 + 4093)

    def tag(parts: list[memoryview | bytes | bytearray], name: str = "p:{a}:h", key: bytes = k1,
            n: bytes = nonce) -> bytes:
        mac = keys.payload_mac(name, key, n)
        for p in parts:
            mac.update(p)
        out = mac.digest()
        assert len(out) == TAG_BYTES and mac.digest() == out
        return bytes(out)

    whole = tag([data])
    rng = random.Random(7)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(data)), rng.randint(1, 40)))
        mv = memoryview(data)
        assert tag([mv[i:j] for i, j in zip([0, *cuts], [*cuts, len(data)], strict=True)]) == whole
    flipped = bytearray(data)
    for pos in (0, 15, 16, 65535, 65536, len(data) - 1):
        flipped[pos] ^= 1
        assert tag([flipped]) != whole
        flipped[pos] ^= 1
    assert tag([data[:-1]]) != whole and tag([data + b"\0"]) != whole
    assert tag([data], name="p:{b}:h") != whole and tag([data], key=k2) != whole
    assert tag([data], n=new_nonce()) != whole
    assert Keys.derive(os.urandom(32)).payload_mac("p:{a}:h", k1, nonce).digest() != tag([])  # another secret


def test_any_flipped_bit_of_any_piece_is_forged(hosts: Hosts) -> None:
    """Values of several pieces, the last one short: one bit flipped by a client without the
    secret, at the start, the end or a boundary of a piece, is a miss counted ``forged``."""
    from store import KVFormat

    fmt = KVFormat("bfloat16", num_layers=4, num_kv_heads=4, head_dim=64, chunk_size=50)  # 200 KiB: 3.125 pieces
    layout = {"dtype": "bfloat16", "shape": list(fmt.chunk_shape)}
    ns = Namespace("public-model", fmt)
    n = fmt.chunk_bytes
    a, b = hosts("a", piece_bytes=64 << 10), hosts("b", piece_bytes=64 << 10)
    r = hosts.redis.client()
    spots = [(0, 0), (0, 65535), (1, 0), (2, 65535), (3, 0), (3, n - 3 * 65536 - 1)]
    keys = ns.chunk_keys(list(range(50 * (len(spots) + 1))))
    for i, (piece, off) in enumerate(spots):
        k = keys[i]
        assert a.put(k, content(k, n), layout, 50)
        [head] = [h for h in heads(r) if len(pieces_of(r, h)) == 4]
        p = pieces_of(r, head)[piece]
        v = bytearray(as_bytes(r.get(p) or b""))
        v[off] ^= 0x10
        r.set(p, bytes(v))
        assert b.get_into(k, bytearray(n)) is None
        assert remote(b)["forged"] == i + 1 and r.dbsize() == 0
    k = keys[-1]
    assert a.put(k, content(k, n), layout, 50)  # untouched: exact bytes
    out = bytearray(n)
    assert b.get_into(k, out) is not None and bytes(out) == content(k, n) and remote(b)["hits"] == 1


def test_a_value_of_the_earlier_format_is_foreign_not_forged(hosts: Hosts) -> None:
    """Values that an lmctl of the previous format wrote (keyed-BLAKE3 payloads, head version 3)
    are misses counted ``foreign`` that the next put overwrites: an upgrade is not an attack."""
    a, b = hosts("a"), hosts("b")
    r = hosts.redis.client()
    k = NS.chunk_keys(TOKENS)[0]
    assert a.put(k, content(k, N), SMALL_LAYOUT, 16)
    [head] = heads(r)
    old = bytearray(as_bytes(r.get(head) or b""))
    struct.pack_into("<H", old, 4, 3)  # the version field after the magic
    r.set(head, bytes(old))
    assert b.get_into(k, bytearray(N)) is None
    st = remote(b)
    assert (st["foreign"], st["forged"], st["hits"]) == (1, 0, 0)
    assert a.evict([k]).chunks == 1 and a.put(k, content(k, N), SMALL_LAYOUT, 16)  # overwritten
    out = bytearray(N)
    assert b.get_into(k, out) is not None and bytes(out) == content(k, N)

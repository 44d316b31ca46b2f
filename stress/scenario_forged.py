"""The reliability suite's ``forged`` scenario: two stores of one deployment share a real
redis-server while a plain Redis client with full access to their prefix (but not the
deployment secret) attacks the values at random: it rewrites a piece, swaps in another
chunk's whole value or one of its pieces, truncates a piece, or writes a value of the format
whose checksums are all valid. Every read of the victim returns the exact bytes or a miss;
every forged value is a miss counted ``forged`` (a truncated one ``torn``), and none is ever
promoted into the victim's local tier. Untouched values are hits. Ends with ``verify --deep``
on the victim.
"""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path

import xxhash

from store import MiB, Store, StoreConfig, TierConfig
from store.config import RemoteConfig
from store.format.remote_auth import MODE_PLAIN, Keys, new_nonce
from store.format.remote_value import RemoteMeta, pack_meta
from store.tiers.remote import RemoteTier
from stress.common import Tally, content, key

SIZE = 160 << 10  # three pieces of 64 KiB
ATTACKS = ("rewrite", "swap", "swap-piece", "truncate", "forge", "none")


def scenario_forged(work: Path, n: int) -> Tally:
    t = Tally("forged")
    if shutil.which("redis-server") is None:
        t.facts["skipped"] = "no redis-server (scripts/setup.sh installs it)"
        return t
    from testsupport.redis import Server, secret_file

    srv = Server(work / "redis")
    srv.wait(srv.client)
    try:
        _attack(t, srv.url, srv.client(), secret_file(work), work, n)
    finally:
        srv.stop()
    return t


def _attack(t: Tally, url: str, r: object, secret: Path, work: Path, n: int) -> None:
    import redis

    assert isinstance(r, redis.Redis)
    rng = random.Random(18)

    def store(name: str) -> Store:
        return Store(work / name, StoreConfig(tiers={"nvme": TierConfig(capacity=256 * MiB)}, remote=RemoteConfig(
            url, key_prefix="stress", piece_bytes=64 << 10, secret_file=str(secret))))

    a, b = store("writer"), store("victim")
    keys = [key(i) for i in range(24)]
    names = RemoteTier(url, key_prefix="stress", secret_file=secret)  # the names, for the harness only
    done = {k: 0 for k in ATTACKS}
    wrong = promoted = 0
    t0 = time.monotonic()
    try:
        for k in keys:
            a.put(k, content(k, SIZE), {"dtype": "uint8"}, tokens=16)
        for _trial in range(n):
            k, other = rng.sample(keys, 2)
            for c in (k, other):  # both whole on the server, and k not in the victim's local tier
                a.evict([c])
                a.put(c, content(c, SIZE), {"dtype": "uint8"}, tokens=16)
            b.evict([k])
            how = rng.choice(ATTACKS)
            head, pieces = names.head_key(k), names.piece_keys(k, 3)
            if how == "rewrite":
                p = rng.choice(pieces)
                r.set(p, rng.randbytes(len(r.get(p) or b"")))
            elif how == "swap":
                for src, dst in zip([names.head_key(other), *names.piece_keys(other, 3)], [head, *pieces],
                                    strict=True):
                    r.set(dst, r.get(src) or b"")
            elif how == "swap-piece":
                i = rng.randrange(3)
                r.set(pieces[i], r.get(names.piece_keys(other, 3)[i]) or b"")
            elif how == "truncate":
                p = rng.choice(pieces)
                r.set(p, (r.get(p) or b"")[:-rng.randrange(1, 4096)])
            elif how == "forge":  # a value of the format, every checksum valid: all zeros as KV
                evil = bytes(SIZE)
                meta = pack_meta(RemoteMeta(raw_len=SIZE, layout={"dtype": "uint8"}, tokens=16), SIZE, 64 << 10,
                                  time.time(), 0, xxhash.xxh3_64(evil).digest() + bytes(24))
                r.set(head, Keys.derive(None).seal_head(MODE_PLAIN, head, k, new_nonce(), meta))
                for i, p in enumerate(pieces):
                    r.set(p, evil[i * (64 << 10):(i + 1) * (64 << 10)])
            done[how] += 1
            t.trials += 1
            out = bytearray(SIZE)
            try:
                got = b.get_into(k, out)
            except Exception as exc:  # a read is a hit or a miss, never an exception
                t.check(False, f"{how}: the read raised {type(exc).__name__}: {exc}")
                continue
            if got is not None and bytes(out) != content(k, SIZE):
                wrong += 1
                t.check(False, f"{how}: wrong bytes served")
            if how == "none":
                t.check(got is not None, "an untouched value was a miss")
            else:
                t.check(got is None, f"{how}: an attacked value was served")
                if b.locate([k], remote=False) != [None]:
                    promoted += 1
                    t.check(False, f"{how}: an attacked value was promoted")
        st = b.stats().remote or {}
        forging = done["rewrite"] + done["swap"] + done["swap-piece"] + done["forge"]
        t.check(st.get("forged") == forging, f"forged counted {st.get('forged')}, attacks that forge {forging}")
        t.check(st.get("torn") == done["truncate"], f"torn counted {st.get('torn')}, truncations {done['truncate']}")
        t.check(st.get("hits") == done["none"], f"hits {st.get('hits')}, untouched reads {done['none']}")
        problems = [p.kind for p in b.check(deep=True)]
        t.check(not problems, f"verify --deep on the victim: {problems}")
        t.facts.update({"attacks": {k: v for k, v in done.items() if k != "none"}, "untouched": done["none"],
                        "forged_counted": st.get("forged"), "torn_counted": st.get("torn"),
                        "wrong_bytes": wrong, "promoted": promoted, "seconds": round(time.monotonic() - t0, 1)})
    finally:
        names.close()
        a.close()
        b.close()

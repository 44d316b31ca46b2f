"""Why a lookup misses: the reason the first missing chunk of a document is not stored.

The evidence, in the order it is weighed:

1. the remote tier, when the store has one and it does not answer (it may hold the chunk);
2. the event log (``store/index/events.py``): the latest event that names the chunk's key says
   it was evicted, dropped as corrupt, or that an engine dropped its save;
3. the ``prefixes`` rows of the index: other namespaces that hold a chunk ending the same
   token prefix (the prefix id is namespace-free, ``keys.prefix_ids``). Each one's record is
   compared with the asked namespace field by field; the closest one names the reason
   (another adapter, another version of the adapter, another salt, model, checkpoint
   fingerprint or KV format);
4. else the prefix was never stored.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, NamedTuple

from ..format.keys import Namespace, NamespaceRecord
from ..index import Index
from ..index.schema import prefix_row
from ..types import Explanation, LookupResult

if TYPE_CHECKING:
    from ..index.events import EventLog
    from ..store import Store
    from ..tiers.sharing import Sharing

#: differences between two namespaces, the one that names the reason first; of holders that
#: differ in as many fields, the one whose first difference comes earlier here is the closer:
#: another version of the asked adapter (its weights changed) before another adapter, which
#: the base model and sibling adapters of a shared document always are
ORDER = ("other-model", "other-adapter-version", "other-adapter", "other-salt", "other-model-fingerprint",
         "other-kv-format")

_EVICTED = {"lru": "it was the least recently used chunk when tier {tier} needed room",
            "retired": "its model fingerprint was retired (a newer checkpoint of the model is served) when tier "
                       "{tier} needed room",
            "operator": "an operator evicted it (lmctl evict{who})",
            "moved-remote": "it was moved to the remote tier (lmctl move --to remote{who}), which no longer has it"}
_CORRUPT = {"bad-record": "its bytes failed verification on a read",
            "bad-entry": "its index entry could not be decoded",
            "segment-missing": "its segment file vanished",
            "verify": "lmctl verify --fix found it damaged"}
_DROPPED = {"queue-full": "the engine's save queue was full (the disk did not keep up)",
            "disk-full": "the disk was full",
            "failed": "the write failed"}


def when(t: float, now: float) -> str:
    """A time for a sentence: local date and time, and how long ago (it is ``now``)."""
    ago = max(0.0, now - t)
    if ago < 120:
        rel = f"{ago:.0f} s ago"
    elif ago < 7200:
        rel = f"{ago / 60:.0f} min ago"
    elif ago < 172800:
        rel = f"{ago / 3600:.0f} h ago"
    else:
        rel = f"{ago / 86400:.0f} days ago"
    return f"{time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(t))} ({rel})"


class _Holder(NamedTuple):
    """A chunk of another namespace that ends the same token prefix, and how far its namespace
    is from the asked one: ``distance`` = (reasons that differ, the first one's place in
    ``ORDER``, fields that differ); the closest holder names the reason."""

    distance: tuple[int, int, int]
    code: str
    what: str
    key: bytes
    record: NamespaceRecord | None


def differences(asked: Namespace, asked_salt: str | None, rec: NamespaceRecord) -> list[tuple[str, str, int]]:
    """How a recorded namespace differs from the asked one: (reason code, what differs, how
    many fields), in ``ORDER``."""
    out: list[tuple[str, str, int]] = []
    if rec.model != asked.model:
        out.append(("other-model", f"model {rec.model} (asked {asked.model})", 1))
    a, b = asked.adapter, rec.adapter
    if a != b:
        if a is not None and b is not None and a.name == b.name:
            out.append(("other-adapter-version", f"adapter {b} (another version of {b.name}; asked {a})", 1))
        else:
            out.append(("other-adapter", f"{'the base model' if b is None else f'adapter {b}'} (asked "
                                         f"{'the base model' if a is None else f'adapter {a}'})", 1))
    if rec.salted != (asked_salt is not None) or (rec.salted and rec.salt_digest != asked_salt):
        if not rec.salted:
            what = "no cache salt (the lookup gave one)"
        elif asked_salt is None:
            what = f"a cache salt (keyed digest {(rec.salt_digest or '?')[:12]}…; the lookup gave none)"
        else:
            what = f"another cache salt (keyed digest {(rec.salt_digest or '?')[:12]}…)"
        out.append(("other-salt", what, 1))
    if rec.model_fingerprint != asked.model_fingerprint:
        out.append(("other-model-fingerprint", f"model fingerprint {(rec.model_fingerprint or 'none')[:12]} "
                                               f"(asked {(asked.model_fingerprint or 'none')[:12]})", 1))
    fa, fb = asdict(asked.kv_format), asdict(rec.kv_format)
    changed = [f"{k} {fb[k]} (asked {fa[k]})" for k in fa if fa[k] != fb.get(k)]
    if changed:
        out.append(("other-kv-format", "KV format " + ", ".join(changed), len(changed)))
    return out


def holders(index: Index, prefix: bytes) -> list[bytes]:
    """Keys of the stored chunks, in any namespace, that end the token prefix ``prefix``."""
    lo = prefix_row(prefix)
    out: list[bytes] = []
    if not index.has_events:
        return out
    with index.read() as t:
        for _k, v in t.rows("prefixes", lo):
            key = bytes(v)
            if t.entry_raw(key) is not None:
                out.append(key)
    return out


def _remote_unavailable(sharing: Sharing | None, key: bytes) -> bool:
    """Whether the remote tier failed to answer about ``key`` now (or its breaker is open)."""
    if sharing is None:
        return False
    tier = sharing.tier
    if tier.breaker.state == tier.breaker.OPEN:
        return True
    before = tier.stats()
    tier.contains_many([key])
    after = tier.stats()
    return (after.errors + after.short_circuited) > (before.errors + before.short_circuited)


def _event_sentence(ev: dict[str, Any], now: float, remote_down: bool = False,
                    no_remote: bool = False) -> tuple[str, str]:
    """The reason code and sentence of a logged event about a chunk, at ``now`` (``remote_down``: the
    remote tier did not answer, so whether it still holds a moved chunk is unknown;
    ``no_remote``: the store's settings have no remote tier any more)."""
    kind, why = str(ev.get("kind")), str(ev.get("reason"))
    at = when(float(ev.get("time", 0)), now)
    who = f", uid {ev['uid']}" if ev.get("uid") is not None else ""
    tier = ev.get("tier") or "?"
    if kind == "evict":
        text = _EVICTED.get(why, f"reason {why}").format(tier=tier, who=who)
        if remote_down and why == "moved-remote":
            text = text.replace("which no longer has it", "which may still hold it")
        elif no_remote and why == "moved-remote":
            text = text.replace("which no longer has it", "which this store no longer has in its settings")
        return "evicted", f"it was evicted at {at}: {text}"
    if kind == "corrupt":
        text = _CORRUPT.get(why, why)
        detail = f" ({ev['detail']})" if ev.get("detail") else ""
        return "corrupt", f"it was dropped as corrupt at {at}: {text}{detail}; the next save stores it again"
    text = _DROPPED.get(why, why)
    return "save-dropped", f"an engine computed it but dropped its save at {at}: {text}"


def explain_miss(store: Store, ns: Namespace, tokens: Sequence[int], found: LookupResult, events: EventLog,
                 index: Index, sharing: Sharing | None) -> Explanation | None:
    """See ``Store.explain``."""
    i = found.hit_chunks
    if i >= len(found.keys):
        return None
    key = found.keys[i]
    cs = found.chunk_size
    where = f"chunk {i} (tokens {i * cs}-{(i + 1) * cs - 1})"
    details: dict[str, Any] = {}
    ev = events.latest([key]).get(key)
    if ev is not None and ev.get("kind") not in ("evict", "corrupt", "save-dropped"):
        ev = None
    if ev is not None:
        details["event"] = ev

    # other namespaces that hold the same token prefix
    best: _Holder | None = None
    prefixes = store.prefix_ids(tokens, cs, limit=i + 1)
    if len(prefixes) > i:
        records = store.namespace_records()
        asked_salt = store.salt_digest(ns.cache_salt)
        for other in holders(index, prefixes[i]):
            nid = other[:16]
            if nid == ns.ns_id:
                continue
            got = records.get(nid)
            cand: _Holder
            if got is None:
                cand = _Holder((99, 99, 0), "other-namespace", f"namespace {nid.hex()[:12]} (not recorded)", other,
                               None)
            else:
                diffs = differences(ns, asked_salt, got[0]) or [
                    ("other-namespace", f"namespace {nid.hex()[:12]}", 0)]
                code = diffs[0][0]
                rank = ORDER.index(code) if code in ORDER else 99
                cand = _Holder((len(diffs), rank, sum(n for _c, _w, n in diffs)), code,
                               "; ".join(w for _c, w, _n in diffs), other, got[0])
            if best is None or cand.distance < best.distance:
                best = cand
    if best is not None:
        rec = best.record
        holder: dict[str, Any] = {"key": best.key.hex(), "differs": best.what, "reason": best.code}
        if rec is not None:
            holder["namespace"] = {"model": rec.model, "adapter": None if rec.adapter is None else str(rec.adapter),
                                   "salted": rec.salted, "salt_digest": rec.salt_digest,
                                   "model_fingerprint": rec.model_fingerprint, "kv_format": rec.kv_format.doc()}
        details["holder"] = holder

    if _remote_unavailable(sharing, key):
        assert sharing is not None
        details["remote"] = {"url": sharing.url, "breaker": sharing.tier.breaker.state}
        local = ""
        if ev is not None:
            local = "; locally, " + _event_sentence(ev, index.clock.time(), remote_down=True)[1]
        state = sharing.tier.breaker.state
        why = "its circuit breaker is open" if state == "open" else "the call failed or timed out"
        return Explanation(i, i * cs, key, "remote-unavailable",
                           f"{where} misses: the remote tier ({sharing.url}) does not answer ({why}), and it may "
                           f"hold the chunk{local}", details)
    if ev is not None:
        code, text = _event_sentence(ev, index.clock.time(), no_remote=sharing is None)
        also = f"; the same tokens are stored for {best.what}" if best is not None else ""
        return Explanation(i, i * cs, key, code, f"{where} misses: {text}{also}", details)
    if best is not None:
        code, what = best.code, best.what
        why = {"other-adapter": "two adapters never share KV",
               "other-adapter-version": "the adapter's weights changed since",
               "other-salt": "chunks of different cache salts are kept apart",
               "other-model": "another model's KV does not fit",
               "other-model-fingerprint": "a new checkpoint never meets the old one's chunks",
               "other-kv-format": "KV of another format does not load into this engine"}.get(code, "")
        return Explanation(i, i * cs, key, code, f"{where} misses: the same tokens are stored for {what}"
                           + (f": {why}" if why else ""), details)
    return Explanation(i, i * cs, key, "never-stored",
                       f"{where} misses: no namespace of this store holds these tokens and no logged event names "
                       "the chunk: it was never stored (or its event has left the bounded log)", details)

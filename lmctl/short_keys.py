"""Short chunk keys, git-style (the daemon's side of ``--key``).

A chunk key is 96 hex digits: 32 of namespace, then 64 of chunk hash. The CLI's tables show
the start of the chunk hash (the namespace is the same for every chunk of a model and
adapter), so ``--key 48c937a7583e21f2`` names the one stored chunk whose chunk hash starts
with those digits; failing that, the one whose whole key does. A prefix that several
stored chunks share, or none, is a usage error that says so.
"""

from __future__ import annotations

from collections.abc import Iterator

from store import Store, StoreError, parse_key

from .errors import UsageError

KEY_DIGITS = 96
HASH_DIGITS = 64
MIN_DIGITS = 4


def _starting(store: Store, digits: str) -> Iterator[bytes]:
    """Keys of stored chunks whose hex starts with ``digits``, in key order."""
    whole = bytes.fromhex(digits[: len(digits) // 2 * 2])  # an odd last digit is checked by hand
    for info in store.iter_chunks(prefix=whole):
        if info.key.hex().startswith(digits):
            yield info.key


def _first_two(keys: Iterator[bytes]) -> list[bytes]:
    out: list[bytes] = []
    for k in keys:
        if k not in out:
            out.append(k)
        if len(out) > 1:
            break
    return out


def resolve_key(store: Store, text: str) -> bytes:
    """The chunk key ``text`` names: a whole key (stored or not), or a unique start of a
    stored chunk's hash or key."""
    digits = text.strip().lower()
    if len(digits) == KEY_DIGITS or len(digits) > KEY_DIGITS:
        try:
            return parse_key(digits)
        except StoreError as exc:
            raise UsageError(f"{exc}: a chunk key is {KEY_DIGITS} hex digits, this has {len(digits)}") from None
    if not digits or any(c not in "0123456789abcdef" for c in digits):
        raise UsageError(f"chunk key {text!r} is not hex: a chunk key is {KEY_DIGITS} hex digits (or the start "
                         "of its chunk hash, as the tables show it)")
    if len(digits) < MIN_DIGITS:
        raise UsageError(f"chunk key {digits!r} is too short: a chunk key is {KEY_DIGITS} hex digits, this has "
                         f"{len(digits)} (a short key needs {MIN_DIGITS} digits of the chunk hash)")
    found: list[bytes] = []
    if len(digits) <= HASH_DIGITS:
        def by_hash() -> Iterator[bytes]:
            for nid in store.namespaces():
                yield from _starting(store, nid.hex() + digits)

        found = _first_two(by_hash())
    if not found:
        found = _first_two(_starting(store, digits))
    if len(found) == 1:
        return found[0]
    if found:
        raise UsageError(f"chunk key {digits} is ambiguous: more than one stored chunk's hash or key starts with it "
                         f"({', '.join(k.hex()[32:48] for k in found)}, ...): give more digits")
    raise UsageError(f"no stored chunk's hash or key starts with {digits} (a chunk key is {KEY_DIGITS} hex "
                     f"digits, this has {len(digits)})")

"""The remote tier's cryptography: the deployment secret, keyed names, authenticated heads and
payloads, and optional payload encryption.

Everything a Redis client without the deployment secret could change is checked here with keys
it does not have. From the secret (32 random bytes, hex, in a 0600 file: ``read_secret``) come
four keys (BLAKE3's key derivation, one context string each):

* the *name* key: a chunk's Redis names hold ``BLAKE3(name key, chunk key)[:16]`` in hex, so a
  name links to no document, namespace or salt, and nobody can compute the name of a guessed
  chunk (to test it with EXISTS, or to plant a value there);
* the *MAC* key: keyed BLAKE3 over the head (its Redis name, the namespace id, the chunk key
  and every head byte); and the payload's key: the payload's MAC is GMAC (AES-256-GCM's
  authenticator, with the payload as associated data and nothing encrypted) under a key of
  the value's own, ``BLAKE3(MAC key, binding + nonce)`` (so no key ever authenticates two
  payloads), over every piece in order, or with ``encrypt`` over every piece's GCM tag, which
  authenticates that piece. GMAC (a Wegman-Carter MAC: a universal hash with a secret key,
  then a one-time mask) runs at about 20 GB/s a core with the CPU's carry-less multiply,
  where keyed BLAKE3 runs at about 6: a payload is megabytes and its MAC is on the read path.
  The payload's tag is inside the head, under the head's MAC;
* the *metadata* key: the head's fields (lengths, times, codec, layout, tokens, writer) are
  encrypted with a keystream ``BLAKE3-XOF(metadata key, nonce)`` under the MAC (encrypt then
  MAC), so a reader without the secret learns none of them;
* the *encryption* key (``encrypt``): each piece is AES-256-GCM under a key of its own value,
  ``BLAKE3(encryption key, nonce)``, with the piece index as its 96-bit GCM nonce (so nonces
  never repeat under one key) and associated data binding the Redis name, the namespace id,
  the piece index and the piece count: pieces cannot be swapped, reordered or cut off.

A head is ``magic "LMRC", version, mode, 0, nonce (24 random bytes per put), metadata length``
in clear, then the metadata (encrypted in the modes with a secret), then the tag (32 bytes of
keyed BLAKE3; in ``MODE_PLAIN``, 8 bytes of xxh3 that catch accidents only). ``MODE_PLAIN`` is
for a deployment that trusts every client that can write to its prefix
(``remote.trust = "all-writers"``, no secret): names are then unkeyed digests and nothing is
authenticated. A reader with a secret never accepts a plain value.

An *alias value* (``seal_alias``: which record holds the leading tokens of a partial key) is
framed and tagged the same way, with its own magic (``LMRA``) and purpose in the MAC, bound to
its Redis name and the alias key.
"""

from __future__ import annotations

import hmac
import os
import re
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash

from ..errors import StoreError

if TYPE_CHECKING:
    from typing_extensions import Buffer

HEAD_MAGIC = b"LMRC"
ALIAS_MAGIC = b"LMRA"  # an alias value: which record holds the leading tokens of a partial key
HEAD_VERSION = 4  # 4: GMAC payloads (3: keyed BLAKE3 payloads, foreign since)
MODE_PLAIN, MODE_MAC, MODE_SEALED = 0, 1, 2  # no secret; a MAC; a MAC and encrypted pieces
NONCE_BYTES = 24
TAG_BYTES = 32  # keyed BLAKE3 (the head's MAC)
GMAC_BYTES = 16  # the payload's MAC, padded to TAG_BYTES with zeros in the head
PLAIN_TAG_BYTES = 8  # xxh3-64
AEAD_TAG_BYTES = 16  # AES-GCM's tag, after each encrypted piece
NAME_BYTES = 16
#: magic, version, mode, reserved, nonce, metadata length
_CLEAR = struct.Struct("<4sHBB24sH")
CLEAR_BYTES = _CLEAR.size
_U32 = struct.Struct("<I")
#: how ``lmctl remote secret`` writes a secret, and the least a secret file must hold
SECRET_HINT = "generate one with `lmctl remote secret PATH` (32 random bytes, hex, mode 0600)"
_SECRET_RE = re.compile(r"(?:[0-9a-fA-F]{2}){32,128}")
_CONTEXT = "lmctl 2026-01 remote tier v3 {} key"  # the keys did not change in v4
#: the ``remote.trust`` that lets a tier without a secret start
ALL_WRITERS = "all-writers"


class Foreign(Exception):
    """Not a value of this format and deployment (another format, version or mode)."""


class Forged(Exception):
    """A value whose MAC fails: written by someone without the deployment secret, or copied
    from another chunk's name."""


class Torn(Exception):
    """A value without a secret (``MODE_PLAIN``) whose checksum fails: damaged."""


def _blake3() -> Any:
    try:
        import blake3
    except ImportError:
        raise StoreError("the remote tier needs the blake3 package: pip install 'lmctl[remote]'") from None
    return blake3


def check_trust(prefix: str, secret_file: object, previous: object, encrypt: bool, trust: str | None) -> None:
    """Refuse (``StoreError``, one line) trust settings that do not go together: no secret
    without ``trust = "all-writers"``, no rotation or encryption without a secret, no secret
    with that trust."""
    if trust not in (None, ALL_WRITERS):
        raise StoreError(f'remote.trust {trust!r} is not known: the only one is "{ALL_WRITERS}" (without a secret)')
    if secret_file is None:
        if trust != ALL_WRITERS:
            raise StoreError(f"the remote tier (prefix {prefix!r}) has no secret: any client that can write to its "
                             f"prefix could serve its own KV to every engine. Set remote.secret_file ({SECRET_HINT}), "
                             f'or remote.trust = "{ALL_WRITERS}" if every client of that Redis is trusted')
        if previous is not None or encrypt:
            raise StoreError("remote.previous_secret_file and remote.encrypt need remote.secret_file")
    elif trust is not None:
        raise StoreError(f'remote.trust = "{trust}" and remote.secret_file contradict each other: with a secret '
                         "only its holders are trusted; remove one of them")


def read_secret(path: str | os.PathLike[str], setting: str = "remote.secret_file") -> bytes:
    """The deployment secret in ``path``: a regular file owned by this user (or root), that
    no other user can read or write, holding 64 or more hex digits. Anything else is a
    ``StoreError`` of one line that says what to do."""
    where = f"{setting} {os.fspath(path)}"
    try:
        # O_NONBLOCK: a FIFO planted there must not hang the open; it fails the check below
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as exc:
        raise StoreError(f"cannot read {where}: {exc.strerror}; {SECRET_HINT}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StoreError(f"{where} is not a regular file; {SECRET_HINT}")
        if st.st_uid not in (os.geteuid(), 0):
            raise StoreError(f"{where} belongs to uid {st.st_uid}, not to this user ({os.geteuid()}) or root: whoever "
                             "owns it can change the secret; make it yours (chown) and mode 0600")
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise StoreError(f"{where} can be read or written by other users (mode {stat.S_IMODE(st.st_mode):04o}): "
                             "chmod 600 it, and rotate the secret if anyone else may have read it")
        data = os.read(fd, 1024)
    except OSError as exc:
        raise StoreError(f"cannot read {where}: {exc.strerror}") from None
    finally:
        os.close(fd)
    text = data.decode("ascii", "replace").strip()
    if not _SECRET_RE.fullmatch(text):
        raise StoreError(f"{where} does not hold a secret of 64 to 256 hex digits; {SECRET_HINT}")
    return bytes.fromhex(text)


@dataclass(frozen=True)
class Keys:
    """The keys of one deployment secret (``secret`` None: no secret, ``MODE_PLAIN``)."""

    authenticated: bool
    name_key: bytes
    mac_key: bytes
    meta_key: bytes
    enc_key: bytes

    @classmethod
    def derive(cls, secret: bytes | None) -> Keys:
        if secret is None:
            return cls(False, b"", b"", b"", b"")
        b3 = _blake3()
        PayloadMac(bytes(32))  # the payload's MAC needs cryptography: one line now, not at the first read
        sub = [b3.blake3(secret, derive_key_context=_CONTEXT.format(what)).digest()
               for what in ("name", "mac", "metadata", "encryption")]
        return cls(True, *sub)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], setting: str = "remote.secret_file") -> Keys:
        return cls.derive(read_secret(Path(path), setting))

    def __repr__(self) -> str:  # never the keys themselves
        return f"Keys(authenticated={self.authenticated})"

    # -- names -----------------------------------------------------------------------------
    def tag(self, key: bytes) -> str:
        """The hash tag of a chunk's Redis names: a keyed digest of its key (an unkeyed one
        without a secret)."""
        b3 = _blake3()
        h = b3.blake3(key, key=self.name_key) if self.authenticated else b3.blake3(b"lmctl/remote/name/v3\0" + key)
        return str(h.hexdigest(length=NAME_BYTES))

    # -- heads -----------------------------------------------------------------------------
    def _head_mac(self, what: bytes, name: str, key: bytes, body: Buffer) -> bytes:
        h = _blake3().blake3(key=self.mac_key)
        _bind(h.update, what, name, key)
        h.update(body)
        return bytes(h.digest())

    def _keystream(self, nonce: bytes, n: int) -> int:
        return int.from_bytes(_blake3().blake3(nonce, key=self.meta_key).digest(length=n), "little")

    def seal_head(self, mode: int, name: str, key: bytes, nonce: bytes, meta: bytes) -> bytes:
        """A head: the clear part, ``meta`` (encrypted with a secret) and its tag."""
        return self._seal(b"head", HEAD_MAGIC, mode, name, key, nonce, meta)

    def open_head(self, name: str, key: bytes, raw: bytes) -> tuple[int, bytes, bytes]:
        """``(mode, nonce, metadata)`` of a head read from ``name``; ``Foreign``, ``Forged``
        or ``Torn`` if it is not a head of this deployment for this chunk."""
        return self._open(b"head", HEAD_MAGIC, name, key, raw)

    def seal_alias(self, mode: int, name: str, alias: bytes, nonce: bytes, body: bytes) -> bytes:
        """An alias value: framed and tagged like a head, under its own purpose and magic (so
        neither can stand for the other), bound to its Redis name and the alias key."""
        return self._seal(b"alias", ALIAS_MAGIC, mode, name, alias, nonce, body)

    def open_alias(self, name: str, alias: bytes, raw: bytes) -> bytes:
        """The body of an alias value read from ``name``; ``Foreign``, ``Forged`` or ``Torn``."""
        return self._open(b"alias", ALIAS_MAGIC, name, alias, raw)[2]

    def _seal(self, what: bytes, magic: bytes, mode: int, name: str, key: bytes, nonce: bytes, meta: bytes) -> bytes:
        if self.authenticated != (mode != MODE_PLAIN):
            raise ValueError(f"mode {mode} does not go with these keys")
        if mode == MODE_PLAIN:
            body = _CLEAR.pack(magic, HEAD_VERSION, mode, 0, nonce, len(meta)) + meta
            return body + xxhash.xxh3_64(_binding(what, name, key) + body).digest()
        sealed = (int.from_bytes(meta, "little") ^ self._keystream(nonce, len(meta))).to_bytes(len(meta), "little")
        body = _CLEAR.pack(magic, HEAD_VERSION, mode, 0, nonce, len(meta)) + sealed
        return body + self._head_mac(what, name, key, body)

    def _open(self, what: bytes, magic: bytes, name: str, key: bytes, raw: bytes) -> tuple[int, bytes, bytes]:
        if len(raw) < CLEAR_BYTES or raw[:4] != magic:
            raise Foreign(f"not an lmctl remote {what.decode()}")
        _magic, version, mode, _zero, nonce, meta_len = _CLEAR.unpack_from(raw, 0)
        if version != HEAD_VERSION:
            raise Foreign(f"a {what.decode()} of format version {version}; this lmctl reads {HEAD_VERSION}")
        end = CLEAR_BYTES + meta_len
        if not self.authenticated:
            if mode != MODE_PLAIN:
                raise Foreign(f"a {what.decode()} of a deployment with a secret; this tier has none")
            if len(raw) != end + PLAIN_TAG_BYTES or \
                    xxhash.xxh3_64(_binding(what, name, key) + raw[:end]).digest() != raw[end:]:
                raise Torn(f"the {what.decode()} fails its checksum")
            return mode, nonce, raw[CLEAR_BYTES:end]
        if mode == MODE_PLAIN:
            raise Forged(f"a {what.decode()} without a MAC, where this deployment requires one")
        if mode not in (MODE_MAC, MODE_SEALED) or len(raw) != end + TAG_BYTES or \
                not hmac.compare_digest(self._head_mac(what, name, key, memoryview(raw)[:end]), raw[end:]):
            raise Forged(f"the {what.decode()} fails its MAC")
        sealed = raw[CLEAR_BYTES:end]
        meta = (int.from_bytes(sealed, "little") ^ self._keystream(nonce, meta_len)).to_bytes(meta_len, "little")
        return mode, nonce, meta

    # -- payloads --------------------------------------------------------------------------
    def payload_mac(self, name: str, key: bytes, nonce: bytes) -> Any:
        """An incremental check of a payload (``update``, ``digest``): GMAC under the value's
        own key (bound to the chunk and the value's nonce), over the pieces (encrypted: over
        their GCM tags); xxh3-64 without a secret."""
        if not self.authenticated:
            return xxhash.xxh3_64()
        return PayloadMac(_blake3().blake3(_binding(b"payload", name, key) + nonce, key=self.mac_key).digest())

    def pieces(self, name: str, key: bytes, nonce: bytes, count: int) -> PieceCipher:
        """The AES-256-GCM of the pieces of the value ``nonce`` names (``MODE_SEALED``)."""
        return PieceCipher(_blake3().blake3(nonce, key=self.enc_key).digest(), name, key, count)


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def _binding(what: bytes, name: str, key: bytes) -> bytes:
    """What every tag binds: its purpose, the Redis name, the namespace id and the chunk key."""
    n = name.encode()
    return b"lmctl/remote/" + what + b"/v3\0" + _U32.pack(len(n)) + n + key[:16] + _U32.pack(len(key)) + key


def _bind(update: Callable[[bytes], object], what: bytes, name: str, key: bytes) -> None:
    update(_binding(what, name, key))


class PayloadMac:
    """GMAC of one payload under that value's own AES-256 key: ``update`` with each slice of
    the payload as it lands (any lengths; OpenSSL's GHASH carries partial blocks across
    calls), ``digest`` the 16-byte tag padded with zeros to the head's 32. The GCM nonce is
    fixed because the key is the value's own: no (key, nonce) pair ever repeats."""

    def __init__(self, value_key: bytes) -> None:
        try:
            from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
        except ImportError:
            raise StoreError("the remote tier needs the cryptography package: pip install 'lmctl[remote]'") from None
        self._gmac: Any = Cipher(algorithms.AES(value_key), modes.GCM(bytes(12))).encryptor()
        self._tag: bytes | None = None

    def update(self, data: Buffer) -> None:
        if self._tag is not None:
            raise ValueError("this payload's MAC is already final")
        self._gmac.authenticate_additional_data(data)

    def digest(self) -> bytes:
        if self._tag is None:
            self._gmac.finalize()
            self._tag = bytes(self._gmac.tag) + bytes(TAG_BYTES - GMAC_BYTES)
        return self._tag


class PieceCipher:
    """AES-256-GCM of one value's pieces under that value's own key."""

    def __init__(self, value_key: bytes, name: str, key: bytes, count: int) -> None:
        try:
            from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        except ImportError:
            raise StoreError("remote.encrypt needs the cryptography package: pip install 'lmctl[remote]'") from None
        self._key = value_key
        self._aead = AESGCM(value_key)
        self._cipher, self._algo, self._gcm = Cipher, algorithms.AES, modes.GCM
        self._ad = _binding(b"piece", name, key) + _U32.pack(count)

    def _nonce_ad(self, i: int) -> tuple[bytes, bytes]:
        return i.to_bytes(12, "little"), self._ad + _U32.pack(i)

    def seal(self, i: int, piece: Buffer) -> bytes:
        """Piece ``i`` encrypted, its GCM tag after it."""
        nonce, ad = self._nonce_ad(i)
        return bytes(self._aead.encrypt(nonce, bytes(piece), ad))

    def opener(self, i: int) -> Any:
        """A decryptor of piece ``i`` (``update_into(data, out)`` decrypts as the bytes land,
        into a buffer that does not overlap them; ``finalize_with_tag(tag)`` raises
        ``InvalidTag`` when they are not the piece that was sealed)."""
        nonce, ad = self._nonce_ad(i)
        d = self._cipher(self._algo(self._key), self._gcm(nonce)).decryptor()
        d.authenticate_additional_data(ad)
        return d


def invalid_tag() -> type[Exception]:
    """The exception a GCM decryptor raises for a piece that fails its tag."""
    from cryptography.exceptions import InvalidTag

    return InvalidTag

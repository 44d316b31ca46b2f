"""The record format: what one chunk looks like inside a segment file, and the segment file's header.

Record layout: the payload first, at a 4 KiB-aligned offset, zero-padded to a
multiple of 4 KiB, then one 4 KiB trailer that describes it (integers little-endian)::

    0   magic        8s  b"LMCTLREC"
    8   version      H
    10  codec        B
    11  flags        B
    12  key_len      H
    14  meta_len     H
    16  stored_len   Q   payload bytes as stored (after the codec)
    24  raw_len      Q   payload bytes after decoding
    32  checksum     Q   xxh3-64 of the stored payload
    40  created      d   unix time
    48  crc          I   crc32 of bytes 0..47 + key + meta
    52  reserved     12x
    64  key, meta (JSON: layout, tokens), zero padding to 4096

Every record is self-describing, so the index can be rebuilt from segments alone.
The trailer comes last because it carries the payload's checksum, computed while the
payload streams out; it goes to disk in the same write as the payload's last span,
so a record is one sequential append.
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import xxhash

from ..errors import StoreError
from .codec import max_encoded

if TYPE_CHECKING:
    from typing_extensions import Buffer

ALIGN = 4096
REC_MAGIC = b"LMCTLREC"
SEG_MAGIC = b"LMCTLSEG"
REC_VERSION = 1
SEG_VERSION = 1
_REC = struct.Struct("<8sHBBHHQQQdI12x")
#: magic, version, segment id, created, the id of the store that made it (zeros: written
#: before store ids; its first 4 KiB is the header, the rest zeros)
SEGMENT_HEADER = struct.Struct("<8sHQd16s")
REC_FIXED = _REC.size  # 64
#: no chunk is this large (a 256-token chunk of a 70B model's KV is under 100 MB): a length
#: claimed past it, by an index entry or a trailer, is damage
MAX_CHUNK_BYTES = 1 << 34
TRAILER_BLOCK = ALIGN  # every record ends with one 4 KiB trailer block
assert REC_FIXED == 64


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def checksum(data: Buffer) -> int:
    return xxhash.xxh3_64_intdigest(data)


def record_len(stored_len: int) -> int:
    return TRAILER_BLOCK + align_up(stored_len)


def is_aligned(view: memoryview) -> bool:
    import numpy as np

    if len(view) == 0:
        return False
    return bool(np.frombuffer(view, dtype=np.uint8).ctypes.data % ALIGN == 0)


def header_problem(head: bytes) -> str | None:
    """Why a segment file's first bytes rule it out as a segment this lmctl reads, or None."""
    magic, version, _seg_id, _created, _store = SEGMENT_HEADER.unpack_from(head, 0)
    if magic != SEG_MAGIC:
        return "not an lmctl segment (its header has no segment magic)"
    if version != SEG_VERSION:
        return (f"segment format {version}, which this lmctl (format {SEG_VERSION}) does not read"
                + ("; use a newer lmctl" if version > SEG_VERSION else ""))
    return None


def segment_name(seg_id: int) -> str:
    return f"seg-{seg_id:012d}.lseg"


@dataclass(frozen=True)
class RecordTrailer:
    codec: int
    key: bytes
    meta: dict[str, Any]
    stored_len: int
    raw_len: int
    checksum: int
    created: float
    trailer_len: int

    @property
    def record_len(self) -> int:
        return self.trailer_len + align_up(self.stored_len)

    @property
    def trailer_offset(self) -> int:
        """Offset of the trailer from the record's start."""
        return align_up(self.stored_len)


def encode_trailer(
    key: bytes, codec: int, meta: dict[str, Any], stored_len: int, raw_len: int, csum: int,
    created: float,
) -> bytes:
    meta_b = json.dumps(meta, separators=(",", ":"), sort_keys=True).encode()
    body = _REC.pack(REC_MAGIC, REC_VERSION, codec, 0, len(key), len(meta_b), stored_len,
                     raw_len, csum, created, 0)
    crc = zlib.crc32(body[:48] + key + meta_b)
    body = body[:48] + struct.pack("<I", crc) + body[52:]
    trailer = body + key + meta_b
    if len(trailer) > TRAILER_BLOCK:
        raise StoreError(f"record trailer of {len(trailer)} bytes is over {TRAILER_BLOCK}; shorten the metadata")
    return trailer + b"\0" * (TRAILER_BLOCK - len(trailer))


def decode_trailer(buf: Buffer) -> RecordTrailer | None:
    """Parse a record trailer at the start of ``buf``; None if it is not a valid trailer."""
    mv = memoryview(buf)
    if len(mv) < REC_FIXED:
        return None
    (magic, version, codec, _flags, key_len, meta_len, stored_len, raw_len, csum, created,
     crc) = _REC.unpack_from(mv, 0)
    if magic != REC_MAGIC or version != REC_VERSION:
        return None
    if raw_len >= MAX_CHUNK_BYTES or stored_len > max_encoded(codec, raw_len) or (codec == 0 and stored_len != raw_len):
        return None  # lengths no writer makes: nothing may be sized by them
    end = REC_FIXED + key_len + meta_len
    if end > min(len(mv), TRAILER_BLOCK):
        return None
    key = bytes(mv[REC_FIXED : REC_FIXED + key_len])
    meta_b = bytes(mv[REC_FIXED + key_len : end])
    if zlib.crc32(bytes(mv[:48]) + key + meta_b) != crc:
        return None
    try:
        meta = json.loads(meta_b)
    except ValueError:
        return None
    return RecordTrailer(codec, key, meta, stored_len, raw_len, csum, created, TRAILER_BLOCK)

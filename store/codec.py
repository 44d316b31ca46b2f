"""Payload codecs. Each chunk records the codec it was written with; all are lossless.

* ``raw``          bytes as given
* ``zstd``         zstandard
* ``zstd-shuffle`` byte-plane shuffle (all first bytes of each element, then all
                   second bytes, ...) followed by zstandard. Wide elements (bf16, fp16,
                   fp32) compress much better this way: on real bf16 KV the ratio goes
                   from about 1.27 to about 1.45 at level 1.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import StoreError

if TYPE_CHECKING:
    from typing_extensions import Buffer

CODEC_IDS = {"raw": 0, "zstd": 1, "zstd-shuffle": 2}
CODEC_NAMES = {v: k for k, v in CODEC_IDS.items()}


def codec_id(name: str) -> int:
    try:
        return CODEC_IDS[name]
    except KeyError:
        raise StoreError(f"unknown codec {name!r}; choose one of {', '.join(CODEC_IDS)}") from None


def shuffle(data: Buffer, itemsize: int) -> bytes:
    """Byte-plane shuffle: [b0 of every element][b1 of every element]..."""
    import numpy as np

    arr = np.frombuffer(memoryview(data), dtype=np.uint8)
    if itemsize <= 1 or len(arr) % itemsize:
        return arr.tobytes()
    return np.ascontiguousarray(arr.reshape(-1, itemsize).T).tobytes()


def unshuffle(data: Buffer, itemsize: int, out: memoryview | None = None) -> memoryview:
    import numpy as np

    arr = np.frombuffer(memoryview(data), dtype=np.uint8)
    if out is None:
        dst = np.empty(len(arr), dtype=np.uint8)
    else:
        dst = np.frombuffer(out, dtype=np.uint8)[: len(arr)]
    if itemsize <= 1 or len(arr) % itemsize:
        dst[:] = arr
    else:
        dst.reshape(-1, itemsize)[:] = arr.reshape(itemsize, -1).T
    return dst.data.cast("B")


@dataclass
class Codec:
    """Encode/decode payloads. One instance per store; zstd contexts are per thread."""

    level: int = 1

    def __post_init__(self) -> None:
        self._local = threading.local()

    def _zc(self, level: int):  # type: ignore[no-untyped-def]
        import zstandard

        cache = getattr(self._local, "c", None)
        if cache is None:
            cache = self._local.c = {}
        if level not in cache:
            cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
        return cache[level]

    def _zd(self):  # type: ignore[no-untyped-def]
        import zstandard

        d = getattr(self._local, "d", None)
        if d is None:
            d = self._local.d = zstandard.ZstdDecompressor()
        return d

    def encode(self, codec: int, data: Buffer, itemsize: int, level: int | None = None) -> Buffer:
        lvl = self.level if level is None else level
        if codec == 0:
            return data
        if codec == 1:
            return self._zc(lvl).compress(data)  # type: ignore[no-any-return]
        if codec == 2:
            return self._zc(lvl).compress(shuffle(data, itemsize))  # type: ignore[no-any-return]
        raise StoreError(f"unknown codec id {codec}")

    def decode(self, codec: int, data: Buffer, raw_len: int, itemsize: int) -> memoryview:
        if codec == 0:
            return memoryview(data).cast("B")
        try:
            plain = self._zd().decompress(data, max_output_size=raw_len)
        except Exception as exc:  # zstandard.ZstdError
            raise StoreError(f"corrupt compressed payload: {exc}") from None
        if len(plain) != raw_len:
            raise StoreError(f"decoded {len(plain)} bytes, index says {raw_len}")
        if codec == 1:
            return memoryview(plain)
        if codec == 2:
            return unshuffle(plain, itemsize)
        raise StoreError(f"unknown codec id {codec}")

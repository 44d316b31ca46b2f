"""The model fingerprint: a cheap digest of what identifies a checkpoint's weights.

A new checkpoint deployed under the same served model name (a fine-tune refresh, a
re-quantisation, a weights hotfix) must never meet the old checkpoint's chunks. The
fingerprint is part of every namespace, so it has to change whenever the weights do,
without reading gigabytes of weights at every engine start. It digests:

* the model's ``config.json`` (and ``params.json``, quantisation config files and the
  weight index files, when present), whole;
* every weight file's name and size (``*.safetensors``, ``*.bin``, ``*.pt``, ``*.pth``,
  ``*.gguf``);
* each safetensors file's header (the 8-byte length and the JSON that lists every
  tensor's dtype, shape and byte range), whole;
* a fixed sample of each weight file's bytes: windows at the start, the middle and the
  end of every tensor's data (safetensors, and PyTorch's zip format: every tensor storage
  is a zip entry), so that retraining any single tensor, however small, changes the
  digest, plus evenly spaced windows over the whole file (every file);
* for PyTorch zip files (``.bin``, ``.pt``, ``.pth`` since PyTorch 1.6), the central
  directory (every entry's name, sizes and the CRC-32 of its whole content, as written)
  and the pickled structure (``data.pkl``);
* the quantisation method and the KV cache dtype the engine runs with.

Only files at the top of the model folder count (what vLLM loads); tokenizer files,
READMEs and the like do not change the KV and are left out. The digest does not depend
on the folder's location, and is the same in every process. A model given as a Hugging
Face repo id is looked up in the local Hugging Face cache; if it is not there, the
fingerprint falls back to a digest of the id and revision (and says so).

Pure Python (hashlib, json, os): no torch, no vllm.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import threading
import time
import zipfile
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

log = logging.getLogger("lmctl.engine_hook")

DOMAIN = b"lmctl/model-fp/v1\0"
DIGEST_HEX = 32  # 128 bits

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
#: Files hashed whole: the architecture and the quantisation, and the weight maps.
CONFIG_FILES = frozenset({
    "config.json", "params.json", "quantize_config.json", "quant_config.json", "hf_quant_config.json",
    "quantization_config.json",
})
INDEX_SUFFIX = ".index.json"       # model.safetensors.index.json, pytorch_model.bin.index.json
MAX_CONFIG_BYTES = 64 << 20
MAX_HEADER_BYTES = 100 << 20       # the safetensors format's own limit

TENSOR_WINDOW = 64                 # bytes read at the start, middle and end of every tensor
FILE_WINDOW = 4096                 # bytes per evenly spaced window
FILE_SPACING = 32 << 20            # one evenly spaced window per this many bytes of a file ...
MIN_FILE_WINDOWS = 16              # ... but at least this many
MAX_FILE_WINDOWS = 1024            # ... and at most this many
HEAD_BYTES = 64 << 10              # non-safetensors files: their first bytes (format headers)
MERGE_GAP = 4096                   # windows closer than this are read as one range
THREADS = 8                        # files read in parallel (reads release the GIL)


class FingerprintError(Exception):
    """The model's files could not be found or listed."""


@dataclass(frozen=True)
class ModelFingerprint:
    """A model's fingerprint and how it was obtained.

    ``source`` is ``"files"`` (the checkpoint's files were digested) or ``"id"`` (they
    could not be: a digest of the model id and revision, with the reason in
    ``warnings``). ``bytes_read`` counts the bytes read from files to compute it (0 when
    ``cached``, i.e. computed earlier in this process from unchanged files)."""

    digest: str
    source: str
    path: str | None = None
    files: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    cached: bool = False
    warnings: tuple[str, ...] = field(default_factory=tuple)

    @property
    def short(self) -> str:
        return self.digest[:12]


def _frame(h: hashlib._Hash, tag: str, data: bytes) -> None:
    t = tag.encode()
    h.update(len(t).to_bytes(2, "little") + t + len(data).to_bytes(8, "little"))
    h.update(data)


def _params(h: hashlib._Hash, quantization: str | None, kv_cache_dtype: str | None) -> None:
    _frame(h, "quantization", (quantization or "").encode())
    _frame(h, "kv_cache_dtype", (kv_cache_dtype or "").encode())


# -- which files ---------------------------------------------------------------------
def _kind(name: str) -> str | None:
    if name.startswith("."):
        return None
    if name in CONFIG_FILES or name.endswith(INDEX_SUFFIX):
        return "config"
    if name.endswith(".safetensors"):
        return "safetensors"
    if name.endswith(WEIGHT_SUFFIXES):
        return "weights"
    return None


Listing = tuple[tuple[str, int, int, int, int], ...]


def _listing(folder: Path) -> Listing:
    """(name, size, mtime, ctime, inode) of the files that identify the checkpoint, by name.
    Name and size go into the digest; all of it into the per-process cache key."""
    out = []
    with os.scandir(folder) as it:
        for entry in it:
            if _kind(entry.name) is None:
                continue
            try:
                if not entry.is_file():  # follows symlinks (a Hugging Face cache snapshot)
                    continue
                st = entry.stat()
            except OSError:
                continue
            out.append((entry.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino))
    out.sort()
    return tuple(out)


# -- which bytes ---------------------------------------------------------------------
def _spaced(size: int) -> list[tuple[int, int]]:
    """Evenly spaced windows over a file of ``size`` bytes (the whole file if it is small)."""
    n = min(MAX_FILE_WINDOWS, max(MIN_FILE_WINDOWS, -(-size // FILE_SPACING)))
    if size <= n * FILE_WINDOW:
        return [(0, size)] if size else []
    last = size - FILE_WINDOW
    return [(i * last // (n - 1), FILE_WINDOW) for i in range(n)]


def _tensor_windows(begin: int, end: int) -> list[tuple[int, int]]:
    """Windows at the start, middle and end of one tensor's bytes [begin, end)."""
    n = end - begin
    if n <= 3 * TENSOR_WINDOW:
        return [(begin, n)] if n > 0 else []
    w = TENSOR_WINDOW
    return [(begin, w), (begin + (n - w) // 2, w), (end - w, w)]


def _merge(windows: Iterable[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """Sorted, clipped to the file, and merged where they overlap or nearly touch."""
    out: list[list[int]] = []
    for off, n in sorted(windows):
        end = min(off + n, size)
        if end <= off:
            continue
        if out and off <= out[-1][1] + MERGE_GAP:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([off, end])
    return [(a, b - a) for a, b in out]


def _safetensors_tensors(header: bytes, data_start: int, size: int) -> list[tuple[int, int]] | None:
    """Absolute byte ranges of every tensor listed in a safetensors header (None if the
    header is not what the format says)."""
    try:
        doc = json.loads(header)
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(doc, dict):
        return None
    ranges = []
    for name, meta in doc.items():
        if name == "__metadata__":
            continue
        try:
            b, e = (int(x) for x in meta["data_offsets"])
        except (TypeError, KeyError, ValueError):
            return None
        if not 0 <= b <= e or data_start + e > size:
            return None
        ranges.append((data_start + b, data_start + e))
    return ranges


def _read(fd: int, off: int, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        got = os.pread(fd, n - len(out), off + len(out))
        if not got:
            raise OSError(f"unexpected end of file at byte {off + len(out)}")
        out += got
    return bytes(out)


class _PreadFile(io.RawIOBase):
    """A read-only, seekable file over a descriptor that counts the bytes it reads."""

    def __init__(self, fd: int, size: int) -> None:
        super().__init__()
        self.fd, self.size, self.pos, self.read_bytes = fd, size, 0, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buf: Any) -> int:
        got = os.preadv(self.fd, [buf], self.pos)
        self.pos += got
        self.read_bytes += got
        return got


def _zip_entries(fd: int, size: int) -> tuple[bytes, list[tuple[int, int]], list[tuple[int, int]], int] | None:
    """A zip file (PyTorch's ``torch.save`` format since 1.6: one entry per tensor storage,
    the pickled structure in ``data.pkl``): the bytes that describe its central directory
    (each entry's name, sizes and the CRC-32 of its whole content, as the writer recorded
    it), the data range of every entry, the data range of every pickle, and the bytes read.
    None if it is not a readable zip file."""
    f = _PreadFile(fd, size)
    try:
        with zipfile.ZipFile(f) as z:  # reads the end record and the central directory only
            infos = sorted(z.infolist(), key=lambda i: i.header_offset)
    except (zipfile.BadZipFile, ValueError, EOFError, OSError):
        return None
    desc = bytearray()
    data: list[tuple[int, int]] = []
    pickles: list[tuple[int, int]] = []
    for info in infos:
        name = info.filename.encode()
        desc += len(name).to_bytes(4, "little") + name
        desc += b"".join(x.to_bytes(8, "little") for x in (info.CRC, info.compress_size, info.file_size))
        local = _read(fd, info.header_offset, 30)
        f.read_bytes += 30
        if local[:4] != b"PK\x03\x04":
            return None
        name_len, extra_len = int.from_bytes(local[26:28], "little"), int.from_bytes(local[28:30], "little")
        start = info.header_offset + 30 + name_len + extra_len
        end = start + info.compress_size
        if end > size:
            return None
        (pickles if info.filename.endswith(".pkl") else data).append((start, end))
    return bytes(desc), data, pickles, f.read_bytes


def _digest_file(path: Path, kind: str, size: int) -> tuple[bytes, int]:
    """One file's digest and the bytes read for it."""
    h = hashlib.sha256()
    read = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        if kind == "config":
            if size > MAX_CONFIG_BYTES:
                raise OSError(f"{path.name} is larger than {MAX_CONFIG_BYTES} bytes")
            data = _read(fd, 0, size)
            _frame(h, "bytes", data)
            return h.digest(), len(data)
        if hasattr(os, "posix_fadvise"):  # a sample, not a scan: no read-ahead wanted
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        windows = _spaced(size)
        if kind == "safetensors" and size >= 8:
            raw = _read(fd, 0, 8)
            read += 8
            hlen = int.from_bytes(raw, "little")
            ranges = None
            if hlen <= min(MAX_HEADER_BYTES, size - 8):
                header = _read(fd, 8, hlen)
                read += hlen
                _frame(h, "safetensors-header", raw + header)
                ranges = _safetensors_tensors(header, 8 + hlen, size)
            if ranges is None:  # not a valid safetensors file: sample it like any other
                _frame(h, "safetensors-invalid", raw)
                windows.append((0, HEAD_BYTES))
            else:
                for b, e in ranges:
                    windows.extend(_tensor_windows(b, e))
        else:
            windows.append((0, HEAD_BYTES))
            zipped = None
            if size >= 30:
                read += 4
                if _read(fd, 0, 4) == b"PK\x03\x04":
                    zipped = _zip_entries(fd, size)
            if zipped is not None:
                desc, ranges, pickles, n = zipped
                read += n
                _frame(h, "zip-directory", desc)
                for b, e in ranges:
                    windows.extend(_tensor_windows(b, e))
                for b, e in pickles:  # the structure: names, dtypes, shapes (small)
                    windows.append((b, min(e - b, MAX_HEADER_BYTES)))
        for off, n in _merge(windows, size):
            data = _read(fd, off, n)
            read += n
            h.update(off.to_bytes(8, "little") + n.to_bytes(8, "little"))
            h.update(data)
        return h.digest(), read
    finally:
        os.close(fd)


# -- the fingerprint -----------------------------------------------------------------
_cache: dict[tuple[str, Listing, str, str], ModelFingerprint] = {}
_cache_lock = threading.Lock()


def folder_fingerprint(folder: str | os.PathLike[str], quantization: str | None = None,
                       kv_cache_dtype: str | None = None) -> ModelFingerprint:
    """The fingerprint of the checkpoint in ``folder`` (or of one weight file).

    Computed once per process for the same files (same names, sizes, mtimes, ctimes and
    inodes); raises ``FingerprintError`` if the folder cannot be listed or holds no weight
    or config file.
    A file that cannot be read is digested as unreadable (its name, size and the error
    kind) and reported in ``warnings``: the fingerprint then differs from the one of
    readable files, so it can only cost misses, never wrong hits."""
    root = Path(folder).resolve()
    try:
        if root.is_file():
            st = root.stat()
            listing: Listing = ((root.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino),)
            base = root.parent
        else:
            listing = _listing(root)
            base = root
    except OSError as exc:
        raise FingerprintError(f"cannot list {str(root)!r}: {exc}") from exc
    if not listing:
        raise FingerprintError(f"{str(root)!r} holds no config or weight file")
    key = (str(root), listing, quantization or "", kv_cache_dtype or "")
    with _cache_lock:
        got = _cache.get(key)
    if got is not None:
        return replace(got, cached=True, bytes_read=0, seconds=0.0)

    t0 = time.perf_counter()
    jobs = [(name, _kind(name) or "weights", size) for name, size, *_ in listing]

    def one(job: tuple[str, str, int]) -> tuple[bytes, int, str | None]:
        name, kind, size = job
        try:
            d, n = _digest_file(base / name, kind, size)
            return d, n, None
        except OSError as exc:
            return f"unreadable:{type(exc).__name__}".encode(), 0, f"cannot read {name}: {exc}"

    if len(jobs) > 1:
        with ThreadPoolExecutor(min(THREADS, len(jobs)), thread_name_prefix="lmctl-fp") as pool:
            results = list(pool.map(one, jobs))
    else:
        results = [one(j) for j in jobs]
    h = hashlib.sha256(DOMAIN)
    _frame(h, "source", b"files")
    _params(h, quantization, kv_cache_dtype)
    warnings = []
    read = 0
    for (name, kind, size), (d, n, warn) in zip(jobs, results, strict=True):
        _frame(h, "file", name.encode())
        _frame(h, "kind", kind.encode())
        _frame(h, "size", size.to_bytes(8, "little"))
        _frame(h, "digest", d)
        read += n
        if warn:
            warnings.append(warn)
    fp = ModelFingerprint(h.hexdigest()[:DIGEST_HEX], "files", str(root), len(jobs), read,
                          time.perf_counter() - t0, False, tuple(warnings))
    if not warnings:
        with _cache_lock:
            _cache[key] = fp
    return fp


def id_fingerprint(model: str, revision: str | None = None, quantization: str | None = None,
                   kv_cache_dtype: str | None = None, reason: str = "") -> ModelFingerprint:
    """A digest of the model id and revision: what is left when the files cannot be read.
    It does NOT change when the weights behind the id change."""
    h = hashlib.sha256(DOMAIN)
    _frame(h, "source", b"id")
    _params(h, quantization, kv_cache_dtype)
    _frame(h, "model", model.encode())
    _frame(h, "revision", (revision or "").encode())
    return ModelFingerprint(h.hexdigest()[:DIGEST_HEX], "id", None, 0, 0, 0.0, False,
                            (reason,) if reason else ())


def resolve_model_folder(model: str, revision: str | None = None) -> Path:
    """The local folder of ``model``: the path itself, or its snapshot in the local
    Hugging Face cache (never downloads). Raises ``FingerprintError``."""
    p = Path(model).expanduser()
    if p.exists():
        return p
    try:
        from huggingface_hub import snapshot_download

        got = snapshot_download(repo_id=model, revision=revision, local_files_only=True)
    except Exception as exc:  # not a repo id, not cached, no huggingface_hub
        raise FingerprintError(f"{model!r} is neither a local path nor in the local Hugging Face cache "
                               f"({type(exc).__name__}: {exc})") from exc
    return Path(str(got))


def model_fingerprint(model: str, revision: str | None = None, quantization: str | None = None,
                      kv_cache_dtype: str | None = None) -> ModelFingerprint:
    """The fingerprint of ``model`` (a folder, a weight file or a Hugging Face repo id).

    Never fails: if the files cannot be found or listed, it falls back to a digest of
    the model id and revision and logs a warning saying so."""
    try:
        fp = folder_fingerprint(resolve_model_folder(model, revision), quantization, kv_cache_dtype)
    except FingerprintError as exc:
        fp = id_fingerprint(model, revision, quantization, kv_cache_dtype, str(exc))
        log.warning("lmctl: could not fingerprint the weights of %r (%s); using a digest of the model id and "
                    "revision instead, which does not change when the weights behind that id change. "
                    "Set model_fingerprint explicitly to be safe.", model, exc)
        return fp
    for w in fp.warnings:
        log.warning("lmctl: model fingerprint: %s (it then differs from the fingerprint of readable files)", w)
    return fp


def clear_cache() -> None:
    """Forget the fingerprints computed in this process (for tests and benchmarks)."""
    with _cache_lock:
        _cache.clear()

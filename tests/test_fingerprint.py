"""The model fingerprint (engine_hook/fingerprint.py) on small checkpoints written here,
and the pieces that carry it: the connector setting, the namespace book, the API client."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import ROOT, env_with_path
from safetensors.numpy import load_file, save_file

from engine_hook import fingerprint as fpmod
from engine_hook.config import ConnectorSettings
from engine_hook.fingerprint import folder_fingerprint, model_fingerprint
from engine_hook.namespaces import NamespaceBook
from store import KVFormat, Namespace, Store, StoreError

SHARDS: dict[str, dict[str, tuple[tuple[int, ...], Any]]] = {
    "model-00001-of-00002.safetensors": {
        "model.embed_tokens.weight": ((512, 64), np.float32),
        "model.layers.0.input_layernorm.weight": ((64,), np.float32),
        "model.layers.0.self_attn.q_proj.weight": ((64, 64), np.float16),
        "model.layers.0.self_attn.k_proj.bias": ((3,), np.float32),  # 12 bytes: smaller than one window
    },
    "model-00002-of-00002.safetensors": {
        "model.layers.1.mlp.up_proj.weight": ((128, 64), np.float32),
        "model.layers.1.post_attention_layernorm.weight": ((64,), np.float16),
        "model.norm.weight": ((64,), np.float32),
        "lm_head.weight": ((512, 64), np.float32),
    },
}
CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 512}


def _tensors(shard: str, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(dtype) for name, (shape, dtype) in SHARDS[shard].items()}


def write_checkpoint(folder: Path, seed: int = 0) -> Path:
    folder.mkdir(parents=True)
    index: dict[str, Any] = {"metadata": {}, "weight_map": {}}
    for i, shard in enumerate(SHARDS):
        save_file(_tensors(shard, seed * 10 + i), str(folder / shard), metadata={"format": "pt"})
        index["weight_map"].update({name: shard for name in SHARDS[shard]})
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    (folder / "config.json").write_text(json.dumps(CONFIG, indent=2))
    (folder / "tokenizer.json").write_text('{"model": {"vocab": {}}}')
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "README.md").write_text("a model\n")
    return folder


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "ckpt")


def fp(folder: Path, **kw: Any) -> str:
    got = folder_fingerprint(folder, **kw)
    assert got.source == "files" and not got.warnings
    return got.digest


def _header(path: Path) -> bytes:
    raw = path.read_bytes()
    return raw[: 8 + int.from_bytes(raw[:8], "little")]


def test_digest_shape_and_domain(ckpt: Path) -> None:
    d = fp(ckpt)
    assert len(d) == 32 and int(d, 16) >= 0
    got = folder_fingerprint(ckpt)
    assert got.files == 2 + 2  # two shards, config.json, the index; not the tokenizer or README


def test_retraining_any_single_tensor_changes_it(ckpt: Path, tmp_path: Path) -> None:
    """Every tensor of every shard, the tiniest included. The header stays byte for byte
    the same (same names, dtypes and shapes), so only the sampled data can tell."""
    seen = {fp(ckpt)}
    n = 0
    for shard_i, shard in enumerate(SHARDS):
        for name in SHARDS[shard]:
            variant = tmp_path / f"v{n}"
            shutil.copytree(ckpt, variant)
            tensors = load_file(str(ckpt / shard))
            fresh = _tensors(shard, 1000 + n)[name]
            assert not np.array_equal(fresh, tensors[name])
            tensors[name] = fresh
            save_file(tensors, str(variant / shard), metadata={"format": "pt"})
            assert _header(variant / shard) == _header(ckpt / shard)
            assert (variant / shard).stat().st_size == (ckpt / shard).stat().st_size
            d = fp(variant)
            assert d not in seen, f"retraining {name} (shard {shard_i}) did not change the fingerprint"
            seen.add(d)
            n += 1
    assert n == sum(len(t) for t in SHARDS.values())


def test_one_changed_value_between_the_windows_of_an_opaque_file_is_not_promised(tmp_path: Path) -> None:
    """Documents the limit: in a file it cannot parse (neither safetensors nor a zip), a
    sample finds a retrained file, not a single changed byte between its windows."""
    a = tmp_path / "a"
    a.mkdir()
    (a / "config.json").write_text("{}")
    blob = bytearray(np.random.default_rng(0).bytes(4 << 20))
    (a / "pytorch_model.bin").write_bytes(blob)
    b = tmp_path / "b"
    shutil.copytree(a, b)
    blob[(4 << 20) // 2 + 1000] ^= 0xFF  # between two evenly spaced windows
    (b / "pytorch_model.bin").write_bytes(blob)
    assert fp(a) == fp(b)
    blob[:] = np.random.default_rng(1).bytes(4 << 20)  # the whole file retrained
    (b / "pytorch_model.bin").write_bytes(blob)
    assert fp(a) != fp(b)


TORCH_TENSORS = {"embed.weight": (512, 256), "layers.0.norm.weight": (3,), "layers.0.proj.weight": (300, 256),
                 "layers.1.proj.bias": (5,), "head.weight": (700, 256)}


def _entries(path: Path) -> dict[str, tuple[int, int]]:
    """name -> (start, end) of each zip entry's data, from its local header."""
    import zipfile

    out = {}
    with zipfile.ZipFile(path) as z, open(path, "rb") as f:
        for i in z.infolist():
            f.seek(i.header_offset)
            local = f.read(30)
            start = i.header_offset + 30 + sum(int.from_bytes(local[k : k + 2], "little") for k in (26, 28))
            out[i.filename.partition("/")[2]] = (start, start + i.compress_size)  # without the archive's folder
    return out


def _covered(size: int, lo: int, hi: int, entries: dict[str, tuple[int, int]] | None = None) -> bool:
    """Whether the fingerprint's file-wide windows (and, given ``entries``, the windows of
    every entry) read any byte of [lo, hi), counting the gaps that merged windows read."""
    wins = fpmod._spaced(size) + [(0, fpmod.HEAD_BYTES)]
    for b, e in (entries or {}).values():
        wins += fpmod._tensor_windows(b, e)
    return any(off - fpmod.MERGE_GAP < hi and lo < off + n + fpmod.MERGE_GAP for off, n in wins)


def _torch_checkpoint(folder: Path) -> tuple[Path, dict[str, tuple[int, int]]]:
    """A pytorch_model.bin (torch.save's zip format: one entry per tensor storage)."""
    import torch

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    g = torch.Generator().manual_seed(0)
    torch.save({name: torch.randn(shape, generator=g) for name, shape in TORCH_TENSORS.items()},
               folder / "pytorch_model.bin")
    ents = {k: v for k, v in _entries(folder / "pytorch_model.bin").items() if k.startswith("data/")}
    assert len(ents) == len(TORCH_TENSORS)
    return folder / "pytorch_model.bin", ents


def test_pytorch_zip_files_are_sampled_per_tensor(tmp_path: Path) -> None:
    """Every tensor storage of a torch.save file is a zip entry, sampled at its start,
    middle and end: retraining any one changes the fingerprint, even a 3-value tensor that
    no file-wide window reaches. (The bytes are patched in place: the rest of the file,
    the entries' recorded CRC-32s included, stays the same.)"""
    path, ents = _torch_checkpoint(tmp_path / "base")
    size = path.stat().st_size
    assert not _covered(size, *ents["data/1"])  # the 3-value norm weight: no file-wide window reads it
    seen = {fp(path.parent)}
    rng = np.random.default_rng(5)
    for n, (name, (b, e)) in enumerate(ents.items()):
        variant = tmp_path / f"v{n}"
        shutil.copytree(path.parent, variant)
        with open(variant / path.name, "r+b") as f:
            f.seek(b)
            f.write(rng.standard_normal((e - b) // 4).astype(np.float32).tobytes())
        d = fp(variant)
        assert d not in seen, f"retraining {name} did not change the fingerprint"
        seen.add(d)
    fpmod.clear_cache()
    got = folder_fingerprint(path.parent)
    assert got.source == "files" and 0 < got.bytes_read < size // 4


def test_pytorch_zip_crc_catches_a_change_between_the_windows(tmp_path: Path) -> None:
    """One value changed in the middle of a large tensor, far from every data window: a
    zip records each entry's CRC-32 of its whole content (in the entry's local header and
    in the central directory), and the fingerprint reads both."""
    import zipfile

    src, ents = _torch_checkpoint(tmp_path / "src")

    def rezip(dst: Path, patch: dict[str, bytes]) -> Path:
        dst.mkdir()
        shutil.copy(src.parent / "config.json", dst)
        with zipfile.ZipFile(src) as zi, zipfile.ZipFile(dst / src.name, "w", zipfile.ZIP_STORED) as zo:
            for info in zi.infolist():
                zo.writestr(zipfile.ZipInfo(info.filename, date_time=(2020, 1, 1, 0, 0, 0)),
                            patch.get(info.filename, zi.read(info)))
        return dst

    a = rezip(tmp_path / "a", {})
    name = "data/2"  # layers.0.proj.weight, 300 x 256 float32
    with zipfile.ZipFile(src) as z:
        full = next(n for n in z.namelist() if n.endswith("/" + name))
        data = bytearray(z.read(full))
    pos = 4 * (170 * 256 + 100)
    data[pos : pos + 4] = np.float32(7.5).tobytes()
    b = rezip(tmp_path / "b", {full: bytes(data)})
    ents_b = _entries(b / src.name)
    start = ents_b[name][0]
    assert not _covered((b / src.name).stat().st_size, start + pos, start + pos + 4, ents_b)
    assert fp(a) != fp(b)


def test_config_change_changes_it(ckpt: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(ckpt, other)
    (other / "config.json").write_text(json.dumps({**CONFIG, "rope_theta": 500000.0}, indent=2))
    assert fp(ckpt) != fp(other)
    # a quantisation config file next to it counts too
    shutil.copytree(ckpt, tmp_path / "q")
    (tmp_path / "q" / "quantize_config.json").write_text('{"bits": 4}')
    assert fp(tmp_path / "q") != fp(ckpt)


def test_renamed_weight_file_changes_it(ckpt: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    shutil.copytree(ckpt, other)
    shard = list(SHARDS)[1]
    (other / shard).rename(other / shard.replace("of-00002", "of-00003"))  # same place in the order
    assert fp(ckpt) != fp(other)


def test_quantization_and_kv_dtype_change_it(ckpt: Path) -> None:
    digests = {fp(ckpt), fp(ckpt, quantization="fp8"), fp(ckpt, kv_cache_dtype="fp8_e4m3"),
               fp(ckpt, quantization="fp8", kv_cache_dtype="fp8_e4m3"), fp(ckpt, kv_cache_dtype="auto")}
    assert len(digests) == 5


def test_same_files_elsewhere_give_the_same_fingerprint(ckpt: Path, tmp_path: Path) -> None:
    copy = tmp_path / "deep" / "elsewhere"
    shutil.copytree(ckpt, copy)
    got = folder_fingerprint(copy)
    assert not got.cached and got.bytes_read > 0  # really computed again, not the cache
    assert got.digest == fp(ckpt)


def test_unrelated_files_do_not_change_it(ckpt: Path) -> None:
    before = fp(ckpt)
    (ckpt / "README.md").write_text("a better description\n")
    (ckpt / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    (ckpt / "tokenizer_config.json").write_text('{"chat_template": "x"}')
    (ckpt / "generation_config.json").write_text('{"temperature": 0.7}')
    (ckpt / ".complete").write_text("ok")
    (ckpt / "sub").mkdir()
    (ckpt / "sub" / "extra.safetensors").write_bytes(b"\0" * 100)
    fpmod.clear_cache()
    assert fp(ckpt) == before


def test_the_same_in_another_process(ckpt: Path) -> None:
    code = ("import sys; from engine_hook.fingerprint import folder_fingerprint; "
            "print(folder_fingerprint(sys.argv[1], 'awq', 'fp8').digest)")
    r = subprocess.run([sys.executable, "-c", code, str(ckpt)], capture_output=True, text=True,
                       env=env_with_path(), cwd=ROOT, timeout=120, check=True)
    assert r.stdout.strip() == fp(ckpt, quantization="awq", kv_cache_dtype="fp8")


def test_cached_per_process_until_a_file_changes(ckpt: Path) -> None:
    fpmod.clear_cache()
    first = folder_fingerprint(ckpt)
    again = folder_fingerprint(ckpt)
    assert not first.cached and first.bytes_read > 0
    assert again.cached and again.bytes_read == 0 and again.digest == first.digest
    assert not folder_fingerprint(ckpt, kv_cache_dtype="fp8").cached  # other inputs: computed
    shard = ckpt / next(iter(SHARDS))
    with open(shard, "ab") as f:  # a different size: the listing changed
        f.write(b"\0" * 8)
    third = folder_fingerprint(ckpt)
    assert not third.cached and third.digest != first.digest


def _sparse_safetensors(path: Path, size: int) -> None:
    """A safetensors file of ``size`` bytes, almost all of it one big tensor, written
    sparse (no data blocks), plus a few small tensors."""
    small = {"norm.weight": ((256,), "F32"), "bias": ((3,), "F16")}
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for name, (shape, dt) in small.items():
        n = int(np.prod(shape)) * (4 if dt == "F32" else 2)
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    big = (size - 8 - len(raw) - off) // 4 * 4
    header["big.weight"] = {"dtype": "F32", "shape": [big // 4], "data_offsets": [off, off + big]}
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        f.write(np.arange(256, dtype=np.float32).tobytes() + b"\1\0\2\0\3\0")
        f.truncate(8 + len(raw) + off + big)


def test_large_files_cost_a_small_bounded_read(tmp_path: Path) -> None:
    folder = tmp_path / "big"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    size = 200 << 20
    _sparse_safetensors(folder / "model.safetensors", size)
    with open(folder / "pytorch_model.bin", "wb") as f:
        f.truncate(size)
    got = folder_fingerprint(folder)
    assert got.source == "files" and got.files == 3 and not got.warnings
    # headers, 3 windows per tensor, 16 windows of 4 KiB per file, the .bin's first 64 KiB
    assert got.bytes_read < 256 << 10, got.bytes_read
    assert got.bytes_read < 2 * size / 1000
    # and the windows really land in the data: a change at the end of the big tensor counts
    with open(folder / "model.safetensors", "r+b") as f:
        f.seek((folder / "model.safetensors").stat().st_size - 32)
        f.write(b"\xff" * 8)
    fpmod.clear_cache()
    assert folder_fingerprint(folder).digest != got.digest


def test_a_broken_safetensors_header_is_sampled_not_fatal(tmp_path: Path) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes((10**12).to_bytes(8, "little") + b"x" * 1000)
    got = folder_fingerprint(folder)
    assert got.source == "files" and got.bytes_read > 0


def test_an_unreadable_file_gives_a_different_fingerprint_and_a_warning(
        ckpt: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    good = fp(ckpt)
    fpmod.clear_cache()
    real = fpmod._digest_file

    def failing(path: Path, kind: str, size: int) -> tuple[bytes, int]:
        if path.name.startswith("model-00002"):
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, kind, size)

    monkeypatch.setattr(fpmod, "_digest_file", failing)
    with caplog.at_level(logging.WARNING, logger="lmctl.engine_hook"):
        got = model_fingerprint(str(ckpt))
    assert got.source == "files" and got.digest != good and len(got.warnings) == 1
    assert "cannot read model-00002" in caplog.text
    assert not folder_fingerprint(ckpt).cached  # a failed read is not cached


def test_hugging_face_repo_ids(ckpt: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               caplog: pytest.LogCaptureFixture) -> None:
    import huggingface_hub.constants

    # a repo in the local Hugging Face cache: the snapshot's files are digested
    cache = tmp_path / "hf"
    repo = cache / "models--acme--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    shutil.copytree(ckpt, repo / "snapshots" / commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    got = model_fingerprint("acme/tiny")
    assert got.source == "files" and got.digest == fp(ckpt)
    assert model_fingerprint("acme/tiny", revision=commit).digest == got.digest
    # not cached here: a digest of the id and revision, and a warning that says so
    with caplog.at_level(logging.WARNING, logger="lmctl.engine_hook"):
        a = model_fingerprint("acme/absent", revision="r1")
    assert a.source == "id" and a.warnings and "model id" in caplog.text
    assert len(a.digest) == 32 and a.digest != got.digest
    assert model_fingerprint("acme/absent", revision="r1").digest == a.digest
    assert model_fingerprint("acme/absent", revision="r2").digest != a.digest
    assert model_fingerprint("acme/absent", revision="r1", kv_cache_dtype="fp8").digest != a.digest


def test_a_single_weight_file(tmp_path: Path) -> None:
    f = tmp_path / "model.Q4_1.gguf"
    f.write_bytes(b"GGUF" + np.random.default_rng(0).bytes(300_000))
    a = model_fingerprint(str(f))
    assert a.source == "files" and a.files == 1
    f.write_bytes(b"GGUF" + np.random.default_rng(1).bytes(300_000))
    assert model_fingerprint(str(f)).digest != a.digest


# -- the setting, the namespace book, the client ---------------------------------------
def test_connector_setting() -> None:
    parse = ConnectorSettings.parse
    assert parse({"store_path": "s"}).model_fingerprint == "auto"
    assert parse({"store_path": "s", "model_fingerprint": None}).model_fingerprint == "auto"
    assert parse({"store_path": "s", "model_fingerprint": "OFF"}).model_fingerprint == "off"
    assert parse({"store_path": "s", "model_fingerprint": "rev-42"}).model_fingerprint == "rev-42"
    assert parse({"store_path": "s", "model_fingerprint": "rev-42"}).fingerprint_mode() == "explicit"
    with pytest.raises(StoreError, match="model_fingerprint"):
        parse({"store_path": "s", "model_fingerprint": " "})


FMT = KVFormat("float32", num_layers=2, num_kv_heads=2, head_dim=8, chunk_size=16)


def test_namespace_book_records_again_after_five_minutes(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    calls: list[tuple[bytes, dict[str, Any]]] = []
    real = store.register_namespace

    def spy(ns: Namespace, info: dict[str, Any] | None = None) -> bytes:
        calls.append((ns.ns_id, dict(info or {})))
        return real(ns, info)

    monkeypatch.setattr(store, "register_namespace", spy)
    book = NamespaceBook(store, "m", {"engine": "test"}, "f" * 32, clock=lambda: now[0])
    ns = book.get(FMT, None, None)
    assert ns.model_fingerprint == "f" * 32
    assert len(calls) == 1 and calls[0][1]["model_fingerprint"] == "f" * 32
    book.get(FMT, None, None)
    now[0] += 299
    book.get(FMT, None, None)
    assert len(calls) == 1
    salted = book.get(FMT, None, "tenant")  # another namespace: recorded at its first use
    assert len(calls) == 2 and calls[1][0] == salted.ns_id
    now[0] += 2  # 301 s after the first record
    book.get(FMT, None, None)
    assert len(calls) == 3 and calls[2][0] == ns.ns_id
    book.get(FMT, None, "tenant")  # 2 s after its own record: not yet
    assert len(calls) == 3
    now[0] += 300
    book.get(FMT, None, "tenant")
    assert len(calls) == 4
    doc = store.namespaces()[ns.ns_id]
    assert doc["namespace"]["model_fingerprint"] == doc["info"]["model_fingerprint"] == "f" * 32


def test_namespace_book_survives_a_failed_refresh(store: Store, monkeypatch: pytest.MonkeyPatch) -> None:
    now = [0.0]
    book = NamespaceBook(store, "m", {}, None, clock=lambda: now[0])
    ns = book.get(FMT, None, None)
    assert ns.model_fingerprint is None and "model_fingerprint" not in store.namespaces()[ns.ns_id]["info"]
    fails = [0]

    def boom(ns: Namespace, info: dict[str, Any] | None = None) -> bytes:
        fails[0] += 1
        raise StoreError("disk full")

    monkeypatch.setattr(store, "register_namespace", boom)
    now[0] = 400.0
    assert book.get(FMT, None, None) == ns  # a refresh that fails costs nothing but a log line
    assert fails[0] == 1
    now[0] = 429.0
    assert book.get(FMT, None, None) == ns and fails[0] == 1  # not retried at every lookup
    now[0] = 431.0
    assert book.get(FMT, None, None) == ns and fails[0] == 2  # but 30 s later
    with pytest.raises(StoreError):  # a first record that fails is the caller's to handle
        book.get(FMT, None, "new-salt")


def test_client_computes_the_fingerprint_from_model_path(ckpt: Path, tmp_path: Path) -> None:
    from engine_hook.api import KVCacheClient

    c = KVCacheClient(tmp_path / "store", "m", FMT, model_path=ckpt)
    try:
        assert c.fingerprint is not None
        want = folder_fingerprint(ckpt, kv_cache_dtype="float32").digest
        assert c.namespace().model_fingerprint == want == c.fingerprint.digest
        info = c.store.namespaces()[c.namespace().ns_id]["info"]
        assert info["model_fingerprint"] == want and info["model_path"] == str(ckpt)
    finally:
        c.close()
    c = KVCacheClient(tmp_path / "store", "m", FMT, model_fingerprint="rev-1")
    try:
        assert c.namespace().model_fingerprint == "rev-1"
    finally:
        c.close()
    c = KVCacheClient(tmp_path / "store", "m", FMT, model_fingerprint="off", model_path=ckpt)
    try:
        assert c.namespace().model_fingerprint is None and c.fingerprint is None
    finally:
        c.close()
    with pytest.raises(StoreError, match="model_path"):
        KVCacheClient(tmp_path / "store", "m", FMT, model_fingerprint="auto")

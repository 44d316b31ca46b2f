"""Identity: keys are deterministic everywhere and never shared across namespaces."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import env_with_path
from hypothesis import given, settings
from hypothesis import strategies as st

from store import AdapterIdentity, KVFormat, Namespace, StoreError, adapter_digest, chunk_keys

FMT = KVFormat("bfloat16", 30, 3, 64, chunk_size=256)


def test_full_chunks_only_and_prefix_chained() -> None:
    ns = Namespace("m", FMT)
    toks = list(range(1000))
    keys = ns.chunk_keys(toks)
    assert len(keys) == 3  # 1000 // 256; the partial tail has no key
    assert ns.chunk_keys(toks[:768]) == keys
    assert ns.chunk_keys(toks[:767]) == keys[:2]
    # same chunk tokens after a different prefix -> different key (chained)
    other = [7] * 256 + toks[256:768]
    k2 = ns.chunk_keys(other)
    assert k2[0] != keys[0] and k2[1] != keys[1]
    # a change in the last chunk only changes the last key
    changed = toks[:767] + [99999]
    assert ns.chunk_keys(changed)[:2] == keys[:2]
    assert ns.chunk_keys(changed)[2] != keys[2]
    assert all(k[:16] == ns.ns_id for k in keys)
    assert len(keys[0]) == 48


def test_keys_identical_in_another_process() -> None:
    toks = list(range(40000, 41300))
    ns = Namespace("llama", FMT, AdapterIdentity("civil", "3f9a" * 8), cache_salt="tenant-1")
    mine = [k.hex() for k in ns.chunk_keys(toks)]
    code = (
        "import json,sys; from store import *; "
        "ns=Namespace('llama', KVFormat('bfloat16',30,3,64,chunk_size=256), "
        "AdapterIdentity('civil','3f9a'*8), cache_salt='tenant-1'); "
        "print(json.dumps([k.hex() for k in ns.chunk_keys(list(range(40000,41300)))]))"
    )
    for seed in ("0", "12345"):
        env = env_with_path()
        env["PYTHONHASHSEED"] = seed
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert json.loads(out.stdout) == mine


def test_token_ids_out_of_range_are_refused() -> None:
    ns = Namespace("m", KVFormat("float16", 1, 1, 8, chunk_size=4))
    with pytest.raises(StoreError):
        ns.chunk_keys([1, 2, -3, 4])
    with pytest.raises(StoreError):
        ns.chunk_keys([1, 2, 3, 2**32])


_fmt = st.builds(
    KVFormat,
    dtype=st.sampled_from(["float16", "bfloat16", "float32", "float8_e4m3fn"]),
    num_layers=st.integers(1, 80), num_kv_heads=st.integers(1, 16), head_dim=st.sampled_from([64, 128]),
    tp_size=st.just(1), tp_rank=st.just(0), chunk_size=st.sampled_from([16, 256]),
)
_adapter = st.none() | st.builds(AdapterIdentity, st.sampled_from(["civil", "legal", "x"]),
                                 st.sampled_from(["a" * 32, "b" * 32, "c" * 32]))
_ns = st.builds(Namespace, model=st.sampled_from(["m1", "m2"]), kv_format=_fmt, adapter=_adapter,
                cache_salt=st.none() | st.sampled_from(["s1", "s2"]),
                model_fingerprint=st.none() | st.sampled_from(["w1", "w2"]))


@settings(max_examples=200, deadline=None)
@given(a=_ns, b=_ns, toks=st.lists(st.integers(0, 2**32 - 1), min_size=16, max_size=64))
def test_different_namespaces_never_share_a_key(a: Namespace, b: Namespace, toks: list[int]) -> None:
    ka, kb = chunk_keys(a, toks), chunk_keys(b, toks)
    if a == b:
        assert ka == kb
    else:
        assert a.ns_id != b.ns_id
        assert not set(ka) & set(kb)
        assert not {k[16:] for k in ka} & {k[16:] for k in kb}


@settings(max_examples=50, deadline=None)
@given(toks=st.lists(st.integers(0, 50000), min_size=16, max_size=48), rank=st.integers(0, 3))
def test_tensor_parallel_ranks_and_salts_are_isolated(toks: list[int], rank: int) -> None:
    base = Namespace("m", KVFormat("bfloat16", 2, 2, 64, tp_size=4, tp_rank=rank, chunk_size=16))
    other = Namespace("m", KVFormat("bfloat16", 2, 2, 64, tp_size=4, tp_rank=(rank + 1) % 4, chunk_size=16))
    salted = Namespace("m", base.kv_format, cache_salt="tenant")
    assert not set(base.chunk_keys(toks)) & set(other.chunk_keys(toks))
    assert not set(base.chunk_keys(toks)) & set(salted.chunk_keys(toks))


def _adapter_folder(path: Path, weights: bytes) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text('{"r": 8, "target_modules": ["q_proj"]}')
    (path / "adapter_model.safetensors").write_bytes(weights)
    (path / "README.md").write_text("notes")
    return path


def test_adapter_digest_tracks_weights_not_location(tmp_path: Path) -> None:
    a = _adapter_folder(tmp_path / "a", b"\x01" * 1000)
    d1 = adapter_digest(a)
    copy = tmp_path / "copy"
    shutil.copytree(a, copy)
    assert adapter_digest(copy) == d1
    (copy / "README.md").write_text("edited notes")  # not a weight or config file
    assert adapter_digest(copy) == d1
    (copy / "adapter_model.safetensors").write_bytes(b"\x01" * 999 + b"\x02")
    d2 = adapter_digest(copy)
    assert d2 != d1 and len(d2) == 32
    ns1 = Namespace("m", FMT, AdapterIdentity.from_path("civil", a))
    ns2 = Namespace("m", FMT, AdapterIdentity.from_path("civil", copy))
    assert not set(ns1.chunk_keys(range(512))) & set(ns2.chunk_keys(range(512)))
    assert str(ns1.adapter) == f"civil@{d1}"
    assert AdapterIdentity.parse(str(ns1.adapter)) == ns1.adapter


def test_adapter_digest_errors(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="does not exist"):
        adapter_digest(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(StoreError, match="no weight"):
        adapter_digest(tmp_path / "empty")


def test_namespace_json_round_trip() -> None:
    ns = Namespace("m", FMT, AdapterIdentity("a", "d" * 32), "salt", "fp")
    back = Namespace.from_json(ns.to_json())
    assert back == ns and back.ns_id == ns.ns_id


def test_kv_format_validation() -> None:
    with pytest.raises(StoreError):
        KVFormat("float64", 1, 1, 1)
    with pytest.raises(StoreError):
        KVFormat("float16", 1, 1, 1, tp_size=2, tp_rank=2)
    assert FMT.chunk_bytes == 30 * 2 * 256 * 3 * 64 * 2

"""The connector's settings (``kv_connector_extra_config``), checked once at start-up: unknown
keys are refused, each key's bad values are refused with a message that names the problem,
good values are taken as given. No engine needed."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from engine_hook.config import LAYOUTS, MAX_CHUNK_SIZE, MAX_SAVE_QUEUE, ConnectorSettings
from store import GiB, MiB, Store, StoreError

BASE = {"store_path": "/var/lib/lmctl"}


def parse(**extra: Any) -> ConnectorSettings:
    return ConnectorSettings.parse({**BASE, **extra})


# -- unknown keys ------------------------------------------------------------------------
def test_an_unknown_key_is_refused_and_the_known_ones_are_listed() -> None:
    with pytest.raises(StoreError, match=r"unknown lmctl connector setting\(s\) chunksize; known: ") as err:
        parse(chunksize=512)  # a typo must not fall back to the default silently
    assert "chunk_size" in str(err.value) and "store_path" in str(err.value)


def test_every_unknown_key_is_named() -> None:
    with pytest.raises(StoreError, match=r"setting\(s\) Store_Path, codecs;"):
        ConnectorSettings.parse({"Store_Path": "/s", "codecs": "zstd"})


# -- bad values, key by key ----------------------------------------------------------------
@pytest.mark.parametrize("extra, why", [
    ({}, "needs 'store_path'"),
    ({"store_path": None}, "needs 'store_path'"),
    ({"store_path": ""}, "needs 'store_path'"),
    ({"store_path": 123}, "needs 'store_path'"),                 # became a relative folder named 123
    ({"store_path": ["/s"]}, "needs 'store_path'"),
])
def test_store_path_must_be_a_path(extra: dict[str, Any], why: str) -> None:
    with pytest.raises(StoreError, match=why):
        ConnectorSettings.parse(extra)


@pytest.mark.parametrize("key, value, why", [
    ("chunk_size", True, "chunk_size must be a whole number"),  # became 1
    ("chunk_size", 1.9, "chunk_size must be a whole number"),   # became 1
    ("chunk_size", "256", "chunk_size must be a whole number"),
    ("chunk_size", 0, f"chunk_size must be between 1 and {MAX_CHUNK_SIZE}"),
    ("chunk_size", MAX_CHUNK_SIZE + 1, f"chunk_size must be between 1 and {MAX_CHUNK_SIZE}"),
    ("codec", "lz4", "unknown codec 'lz4'"),
    ("codec", 1, "codec must be a string"),
    ("capacity", "10", "capacity '10' has no unit"),             # ten bytes would evict every chunk at start
    ("capacity", 10, "capacity 10 has no unit"),
    ("capacity", "1KiB", "capacity '1KiB' is too small"),
    ("capacity", ["1GiB"], "capacity must be a size like 500GiB"),
    ("capacity", "lots", "'lots' is not a size like"),
    ("save_queue", 0, f"save_queue must be between 1 and {MAX_SAVE_QUEUE}"),
    ("save_queue", 10**9, f"save_queue must be between 1 and {MAX_SAVE_QUEUE}"),  # buffers are allocated up front
    ("save_queue", "16", "save_queue must be a whole number"),
    ("save_queue", False, "save_queue must be a whole number"),
    ("model_id", 7, "model_id must be a string"),
    ("model_fingerprint", " ", "model_fingerprint must be 'auto'"),
    ("model_fingerprint", "", "model_fingerprint must be 'auto'"),
    ("on_load_error", "ignore", "on_load_error must be 'recompute' or 'fail'"),
    ("on_load_error", True, "on_load_error must be a string"),
    ("kv_layout", "NHD", "kv_layout must be one of BHNC"),
    ("kv_layout", 3, "kv_layout must be a string"),
    ("dram_path", "shm/lmctl", "dram_path 'shm/lmctl' must be an absolute folder path"),  # found from each cwd
    ("reannounce", "yes", "reannounce must be true or false"),
    ("reannounce", 1, "reannounce must be true or false"),
])
def test_a_bad_value_is_refused_with_a_clear_message(key: str, value: Any, why: str) -> None:
    with pytest.raises(StoreError, match=why):
        parse(**{key: value})


# -- good values -------------------------------------------------------------------------------
def test_defaults() -> None:
    s = parse()
    assert s == ConnectorSettings(store_path="/var/lib/lmctl")
    assert (s.chunk_size, s.save_queue, s.model_fingerprint, s.on_load_error) == (256, 16, "auto", "recompute")
    assert s.codec is s.capacity is s.model_id is s.kv_layout is None
    assert s.fingerprint_mode() == "auto"
    assert s.reannounce is True


def test_every_key_with_a_good_value() -> None:
    s = ConnectorSettings.parse({
        "store_path": "/srv/lmctl/", "chunk_size": 512, "codec": "zstd-shuffle", "capacity": "500GiB",
        "save_queue": 64, "model_id": "llama-prod", "model_fingerprint": "rev-42", "on_load_error": "fail",
        "kv_layout": "B2NHD",
    })
    assert s == ConnectorSettings(store_path="/srv/lmctl", chunk_size=512, codec="zstd-shuffle", capacity=500 * GiB,
                                  save_queue=64, model_id="llama-prod", model_fingerprint="rev-42",
                                  on_load_error="fail", kv_layout="B2NHD")
    assert s.fingerprint_mode() == "explicit"


@pytest.mark.parametrize("key, value, want", [
    ("chunk_size", 1, 1),
    ("chunk_size", MAX_CHUNK_SIZE, MAX_CHUNK_SIZE),
    ("save_queue", 1, 1),
    ("save_queue", MAX_SAVE_QUEUE, MAX_SAVE_QUEUE),
    ("capacity", "16MiB", 16 * MiB),
    ("capacity", "1.5 TB", 1_500_000_000_000),
    ("codec", "raw", "raw"),
    ("codec", None, None),
    ("model_id", "", None),                     # empty: vLLM's served model name
    ("model_fingerprint", None, "auto"),
    ("model_fingerprint", "OFF", "off"),
    ("model_fingerprint", " Auto ", "auto"),
    ("on_load_error", "recompute", "recompute"),
    ("reannounce", False, False),
    *[("kv_layout", layout, layout) for layout in LAYOUTS],
])
def test_a_good_value_is_taken(key: str, value: Any, want: Any) -> None:
    assert getattr(parse(**{key: value}), key) == want


def test_store_path_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert ConnectorSettings.parse({"store_path": "cache"}).store_path == str(tmp_path / "cache")
    assert ConnectorSettings.parse({"store_path": tmp_path / "s"}).store_path == os.fspath(tmp_path / "s")


# -- applying them to the store ------------------------------------------------------------------
def test_codec_and_capacity_are_recorded_in_the_store(store: Store) -> None:
    before = store.config.to_json()
    parse().apply(store)  # neither given: the store's own settings stay
    assert store.config.to_json() == before
    parse(codec="zstd", capacity="2GiB").apply(store)
    assert store.config.codec == "zstd"
    assert store.config.tiers[store.config.default_tier].capacity == 2 * GiB

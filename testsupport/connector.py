"""lmctl's connector on a vLLM engine: the one ``kv_transfer_config`` the tests, demos and
benchmarks give an engine (``--kv-transfer-config`` as JSON, or vLLM's ``KVTransferConfig``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def connector_config(store: str | Path, **settings: Any) -> dict[str, Any]:
    """The connector on store ``store`` with its other ``settings`` (``load_policy``,
    ``remote_url``...), saving and loading (``kv_both``)."""
    return {"kv_connector": "LMCtlConnector", "kv_connector_module_path": "engine_hook.vllm", "kv_role": "kv_both",
            "kv_connector_extra_config": {"store_path": str(store), **settings}}


def kv_transfer_config(store: str | Path, **settings: Any) -> Any:
    """``connector_config`` as vLLM's ``KVTransferConfig`` (imports vLLM)."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(**connector_config(store, **settings))

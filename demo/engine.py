"""Start and stop in-process vLLM engines (CPU, single process) with the lmctl connector.

Shared by the demo, the tests and the benchmarks. Set the environment before vLLM is
imported: ``import demo.engine`` first.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

for _k, _v in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # one process: starts in seconds, easy to inspect
    "VLLM_CPU_KVCACHE_SPACE": "2",          # GiB of paged KV on the CPU
    "VLLM_HOST_IP": "127.0.0.1",            # every socket on loopback
    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_k, _v)


class Engine:
    """One ``vllm.LLM``, with or without the lmctl connector on ``store``.

    ``connector``: more ``kv_connector_extra_config`` settings (e.g. ``model_fingerprint``);
    other keywords go to ``vllm.LLM`` (e.g. ``served_model_name``)."""

    def __init__(self, model: Path, store: Path | None, max_model_len: int = 2048, lora: bool = True,
                 prefix_caching: bool = False, connector: dict[str, Any] | None = None, **kw: Any) -> None:
        self.model = model
        self.connector_config = dict(connector or {})
        self.lora = lora
        self.prefix_caching = prefix_caching
        self.store_path = store
        self.max_model_len = max_model_len
        self.kw = kw
        self.llm: Any = None
        self.start()

    def start(self) -> None:
        from vllm import LLM

        from testsupport.connector import kv_transfer_config

        ktc = None
        if self.store_path is not None:
            ktc = kv_transfer_config(self.store_path, **self.connector_config)
        # vLLM's own in-memory prefix cache is off by default, so that every hit comes from the store
        self.llm = LLM(str(self.model), dtype="float32", max_model_len=self.max_model_len,
                       enable_lora=self.lora, max_lora_rank=8, enable_prefix_caching=self.prefix_caching,
                       kv_transfer_config=ktc, seed=0, **self.kw)

    def flush(self, timeout: float = 120) -> None:
        """Wait until the connector's queued saves are in the store."""
        from engine_hook.vllm import live_connectors

        for c in live_connectors():
            if not c.flush(timeout):
                raise TimeoutError("lmctl connector did not finish its saves")

    def generate(self, prompt: str | list[int], lora: Any = None, max_tokens: int = 1,
                 salt: str | None = None) -> Any:
        from vllm import SamplingParams

        p: Any = {"prompt_token_ids": prompt} if isinstance(prompt, list) else {"prompt": prompt}
        if salt is not None:
            p["cache_salt"] = salt
        out = self.llm.generate([p], SamplingParams(max_tokens=max_tokens, temperature=0), lora_request=lora,
                                use_tqdm=False)[0]
        self.flush()
        return out

    def restart(self) -> None:
        self.close()
        self.start()

    def close(self) -> None:
        from vllm.distributed import cleanup_dist_env_and_memory

        from engine_hook.vllm import live_connectors

        for c in live_connectors():
            c.shutdown()
        self.llm = None  # the engine must be gone before the process groups are torn down
        gc.collect()
        cleanup_dist_env_and_memory()

"""What both sides of the vLLM connector know about their engine, read once from vLLM's config:
the settings, the model id, the KV format and the model fingerprint (``ConnectorContext``).

Importing it imports neither torch nor vllm; reading vLLM's config does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from store import KVFormat, Store, StoreError

from .config import ConnectorSettings
from .fingerprint import ModelFingerprint, id_fingerprint, model_fingerprint
from .namespaces import NamespaceBook

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

log = logging.getLogger("lmctl.engine_hook")


def kv_format_from(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, chunk_size: int,
                   tp_rank: int) -> tuple[KVFormat, list[str], int]:
    """The KV format, the attention layer names and the block size of this engine.

    The block size is not part of the format (nor of the key): payloads use one canonical
    layout, so chunks move between engines with different block sizes."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise StoreError(f"lmctl supports models with one KV cache group (plain attention); this one has {len(groups)}")
    from vllm.v1.kv_cache_interface import AttentionSpec


    spec = groups[0].kv_cache_spec
    if not isinstance(spec, AttentionSpec):
        raise StoreError(f"lmctl supports attention KV caches only, not {type(spec).__name__}")
    layers = list(groups[0].layer_names)
    fmt = kv_format_of_spec(spec, len(layers), int(vllm_config.parallel_config.tensor_parallel_size),
                            tp_rank, chunk_size)
    block_size = int(spec.block_size)
    return fmt, layers, block_size


def kv_format_of_spec(spec: Any, num_layers: int, tp_size: int, tp_rank: int, chunk_size: int) -> KVFormat:
    """The store's KV format for one vLLM attention spec: K and V planes of ``head_size``
    each, or (MLA: ``head_size_v`` 0) one latent plane of ``head_size``. Anything whose
    bytes are not plain tensors of the spec's dtype (packed or quantized states, pages of
    several tokens per state) or whose K and V differ in width is refused."""
    from store.format.tensors import dtype_name

    if getattr(spec, "sliding_window", None):
        raise StoreError("lmctl does not support sliding-window attention yet")
    packed = (getattr(spec, "state_content_bytes", None) is not None
              or getattr(spec, "num_head_slots", None) is not None
              or getattr(spec, "tokens_per_state", 1) != 1
              or str(getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")) != "NONE")
    if packed:
        raise StoreError(f"lmctl does not support packed or quantized KV states ({type(spec).__name__})")
    head, head_v = int(spec.head_size), int(getattr(spec, "head_size_v", spec.head_size))
    if head_v == 0:
        planes = 1  # MLA: one latent per token, no V
    elif head_v == head:
        planes = 2
    else:
        raise StoreError(f"lmctl does not support a V head size ({head_v}) other than the K head size ({head})")
    return KVFormat(dtype=dtype_name(spec.dtype), num_layers=num_layers, num_kv_heads=int(spec.num_kv_heads),
                    head_dim=head, tp_size=tp_size, tp_rank=tp_rank, chunk_size=chunk_size, kv_planes=planes)


def _served_name(vllm_config: VllmConfig) -> str:
    name = vllm_config.model_config.served_model_name
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    return str(name or vllm_config.model_config.model)


def fingerprint_for(vllm_config: VllmConfig, setting: str) -> tuple[str | None, ModelFingerprint | None]:
    """The model fingerprint for the connector setting ``model_fingerprint``: None for
    ``off``, the string itself for an explicit one, else computed from the checkpoint
    (the same on the scheduler and on every worker: same files, same inputs)."""
    if setting == "off":
        return None, None
    if setting != "auto":
        return setting, None
    mc = vllm_config.model_config
    model = str(mc.model)
    revision = getattr(mc, "revision", None)
    quant = getattr(mc, "quantization", None)
    kv_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
    try:
        fp = model_fingerprint(model, revision, None if quant is None else str(quant), kv_dtype)
    except Exception as exc:  # never serve without a fingerprint because of a bug here
        log.warning("lmctl: computing the model fingerprint failed (%s); using a digest of the model id instead",
                    exc, exc_info=True)
        fp = id_fingerprint(model, revision, None if quant is None else str(quant), kv_dtype, str(exc))
    return fp.digest, fp


@dataclass(frozen=True)
class ConnectorContext:
    """One engine as the connector sees it. ``info`` is what each namespace record tells
    operators (tokenizer, model path, block size, where the fingerprint came from)."""

    settings: ConnectorSettings
    model_id: str
    kv_format: KVFormat
    layer_names: list[str]
    block_size: int
    model_fingerprint: str | None
    fingerprint: ModelFingerprint | None
    info: dict[str, Any]

    @classmethod
    def from_vllm(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, settings: ConnectorSettings,
                  tp_rank: int = 0) -> ConnectorContext:
        """Read the engine from vLLM's config (``tp_rank``: this worker's tensor-parallel
        rank; 0 on the scheduler). Refuses KV caches lmctl cannot store."""
        fmt, layers, block_size = kv_format_from(vllm_config, kv_cache_config, settings.chunk_size, tp_rank)
        if settings.chunk_size % block_size:
            raise StoreError(f"chunk_size {settings.chunk_size} must be a multiple of vLLM's block size {block_size}")
        mc = vllm_config.model_config
        info: dict[str, Any] = {
            "engine": "vllm",
            "tokenizer": str(mc.tokenizer),
            "tokenizer_mode": str(getattr(mc, "tokenizer_mode", "auto")),
            "tokenizer_revision": getattr(mc, "tokenizer_revision", None),
            "model_path": str(mc.model),
            "block_size": block_size,
        }
        digest, fp = fingerprint_for(vllm_config, settings.model_fingerprint)
        info["fingerprint_source"] = fp.source if fp else settings.fingerprint_mode()
        return cls(settings, settings.model_id or _served_name(vllm_config), fmt, layers, block_size,
                   digest, fp, info)

    def namespace_book(self, store: Store) -> NamespaceBook:
        """A namespace book on ``store`` in which this engine's base-model namespace is
        already recorded, so that operators can look up, pin and warm documents for the
        model before its first request (with tensor parallelism each worker records its
        own rank's KV format)."""
        book = NamespaceBook(store, self.model_id, self.info, self.model_fingerprint)
        try:
            book.get(self.kv_format, None, None)
        except Exception as exc:  # an unwritable store must not stop the engine here
            log.warning("lmctl: could not record the model's namespace: %s", exc)
        return book

    def fingerprint_note(self) -> str:
        """The model fingerprint and where it came from, for the start-up log line."""
        fp = self.fingerprint
        if self.model_fingerprint is None:
            return "off"
        if fp is None:
            return f"{self.model_fingerprint[:12]} (explicit)"
        if fp.source != "files":
            return f"{fp.short} (model id only: weights not readable)"
        how = "cached" if fp.cached else f"{fp.bytes_read / 2**10:.0f} KiB read in {fp.seconds * 1e3:.0f} ms"
        return f"{fp.short} ({fp.files} files, {how})"

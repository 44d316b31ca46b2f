"""What the scheduler side sends the worker side each step: which chunks to load, which to save.

Plain dataclasses (no torch, no vllm); ``engine_hook.vllm`` carries them in vLLM's
connector metadata.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoadOp:
    """Load chunks into a request's blocks. ``blocks[i]`` are chunk i's block ids in
    token order; ``None`` marks a block the engine already holds (not overwritten)."""

    req_id: str
    keys: list[bytes]
    blocks: list[list[int | None]]
    #: tokens each key's record holds (None: every one a full chunk); a request's tail record
    #: holds fewer, and ``blocks[i]`` then has one entry per block of it
    tokens: list[int] | None = None

    def record_tokens(self, i: int, chunk_size: int) -> int:
        return chunk_size if self.tokens is None else self.tokens[i]


@dataclass
class SaveOp:
    """Save one chunk whose KV sits in ``blocks`` (token order) after this step. ``prefix``:
    the id of the token prefix the chunk ends (``Store.prefix_ids``), stored with it."""

    req_id: str
    key: bytes
    blocks: list[int]
    prefix: bytes | None = None
    #: tokens the record holds: a full chunk's, or fewer for a request's tail (whole blocks)
    tokens: int | None = None
    #: the partial keys at the block boundaries inside it, with their token counts: the
    #: index finds the record's leading blocks by them (``keys.boundary_keys``)
    aliases: list[tuple[bytes, int]] | None = None

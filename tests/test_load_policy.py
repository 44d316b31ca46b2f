"""The load policy: load or recompute, from observed figures (engine_hook/policy.py)."""

from __future__ import annotations

import pytest

from engine_hook.config import ConnectorSettings
from engine_hook.policy import LoadPolicy
from store import StoreError

CS = 256
CHUNK = 10 << 20  # bytes per chunk


def policy(mode: str = "auto", gbps: dict[str, float] | None = None, ms_per_token: float | None = None) -> LoadPolicy:
    p = LoadPolicy(mode)
    for tier, g in (gbps or {}).items():
        p.observe_load(tier, int(g * 1e9), 1.0)
    if ms_per_token is not None:
        p.observe_prefill(4096, 4096 * ms_per_token / 1e3, 4096)
    return p


def test_without_figures_every_hit_is_loaded() -> None:
    d = policy().decide(0, 4096, CS, CHUNK, ["nvme"] * 16)
    assert d.load_tokens == 4096 and "no figures" in d.reason
    d = policy(gbps={"nvme": 1.0}).decide(0, 4096, CS, CHUNK, ["nvme"] * 16)  # no prefill speed yet
    assert d.load_tokens == 4096


def test_a_fast_tier_loads_and_a_slow_tier_recomputes() -> None:
    # 16 chunks of 10 MiB: 0.17 s at 1 GB/s, 17 s at 10 MB/s; recomputing 4096 tokens at 1 ms each: 4.1 s
    fast = policy(gbps={"nvme": 1.0}, ms_per_token=1.0).decide(0, 4096, CS, CHUNK, ["nvme"] * 16)
    assert fast.load_tokens == 4096
    assert fast.predicted_load_s is not None and fast.predicted_recompute_s is not None
    assert fast.predicted_load_s < fast.predicted_recompute_s
    slow_policy = policy(gbps={"nvme": 0.01}, ms_per_token=1.0)
    slow = slow_policy.decide(0, 4096, CS, CHUNK, ["nvme"] * 16)
    assert slow.load_tokens == 0 and slow.reason.startswith("recompute")
    assert slow_policy.stats()["decisions"] == {"load": 0, "partial": 0, "recompute": 1}


def test_only_the_part_worth_loading_is_loaded() -> None:
    # the first 8 chunks are in a fast tier, the rest in a slow one: load the fast part only
    p = policy(gbps={"dram": 10.0, "nvme": 0.01}, ms_per_token=1.0)
    d = p.decide(0, 4096, CS, CHUNK, ["dram"] * 8 + ["nvme"] * 8)
    assert d.load_tokens == 8 * CS and p.decisions["partial"] == 1
    # a load starts where vLLM's own prefix cache ends
    d = p.decide(1024, 4096, CS, CHUNK, ["dram"] * 8 + ["nvme"] * 8)
    assert d.load_tokens == 8 * CS - 1024


def test_policy_always_and_never_override_the_figures() -> None:
    assert policy("always", {"nvme": 0.001}, 1.0).decide(0, 4096, CS, CHUNK, ["nvme"] * 16).load_tokens == 4096
    assert policy("never", {"nvme": 100.0}, 1.0).decide(0, 4096, CS, CHUNK, ["nvme"] * 16).load_tokens == 0


def test_figures_follow_what_is_observed() -> None:
    p = policy(gbps={"nvme": 1.0}, ms_per_token=1.0)
    for _ in range(20):  # the disk slows down
        p.observe_load("nvme", 10_000_000, 1.0)
    assert p.decide(0, 4096, CS, CHUNK, ["nvme"] * 16).load_tokens == 0
    for _ in range(20):  # and recovers
        p.observe_load("nvme", 10_000_000_000, 1.0)
    assert p.decide(0, 4096, CS, CHUNK, ["nvme"] * 16).load_tokens == 4096
    p.observe_prefill(8, 100.0, 4096)  # a decode-sized step says nothing about prefill speed
    assert p.stats()["prefill_ms_per_token"] == {4096: 1.0}


def test_load_policy_setting() -> None:
    assert ConnectorSettings.parse({"store_path": "/x"}).load_policy == "auto"
    assert ConnectorSettings.parse({"store_path": "/x", "load_policy": "never"}).load_policy == "never"
    with pytest.raises(StoreError, match="load_policy must be one of auto, always, never"):
        ConnectorSettings.parse({"store_path": "/x", "load_policy": "sometimes"})


def test_a_tier_not_loaded_from_for_a_while_is_loaded_again_to_observe_it() -> None:
    """A slow tier makes the policy recompute, so nothing would tell it that the tier is fast
    again: once its figure is older than refresh_s, one request loads anyway."""
    now = [0.0]
    p = LoadPolicy("auto", refresh_s=60.0, clock=lambda: now[0])
    p.observe_load("nvme", 10_000_000, 1.0)  # 10 MB/s
    p.observe_prefill(4096, 4.096, 4096)
    assert p.decide(0, 4096, CS, CHUNK, ["nvme"] * 16).load_tokens == 0
    now[0] = 61.0
    probe = p.decide(0, 4096, CS, CHUNK, ["nvme"] * 16)
    assert probe.load_tokens == 4096 and "observe it again" in probe.reason
    assert p.decide(0, 4096, CS, CHUNK, ["nvme"] * 16).load_tokens == 0  # one probe per period
    for _ in range(20):
        p.observe_load("nvme", 10_000_000_000, 1.0)  # what the probe saw: fast again
    assert p.decide(0, 4096, CS, CHUNK, ["nvme"] * 16).load_tokens == 4096

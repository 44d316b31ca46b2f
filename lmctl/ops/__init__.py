"""The daemon's operations: each one a short adapter over a ``Store`` call, a module per job
(``reads``, ``pins``, ``placement``, ``drain``, ``config``), and ``OPS``, the table the daemon
dispatches requests by.

Arguments arrive as the JSON ``args`` of a request (``lmctl/selection.py`` resolves their
selectors to chunk keys); results leave as JSON-ready dicts (numbers as numbers).
``UsageError`` means the request itself is wrong (exit code 2); any other ``StoreError``
means the operation failed (exit code 1).
"""


from __future__ import annotations

from collections.abc import Callable
from typing import Any

from store import Store

from ..errors import Cancelled, UsageError
from ..selection import select
from .base import Job
from .config import check_pin_budgets, op_config
from .drain import op_drain
from .pins import op_export, op_pin, op_unpin
from .placement import op_compress, op_evict, op_move, op_warm
from .reads import op_events, op_inspect, op_lookup, op_ls, op_names, op_verify

__all__ = ["OPS", "Cancelled", "Job", "UsageError", "check_pin_budgets", "op_compress", "op_config", "op_drain",
           "op_events", "op_evict", "op_export", "op_inspect", "op_lookup", "op_ls", "op_move", "op_names", "op_pin",
           "op_unpin", "op_verify", "op_warm", "select"]

OPS: dict[str, Callable[[Store, dict[str, Any], Job], dict[str, Any]]] = {
    "lookup": op_lookup, "pin": op_pin, "unpin": op_unpin, "evict": op_evict, "move": op_move,
    "compress": op_compress, "warm": op_warm, "export": op_export, "drain": op_drain, "ls": op_ls,
    "inspect": op_inspect, "verify": op_verify, "names": op_names, "config": op_config, "events": op_events,
}

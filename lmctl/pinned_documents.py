"""What a label's pins were made from, so that ``pin --export-manifest`` can write it out
for another host or a later deploy (runs in the daemon).

The store keeps chunk keys and namespace records, never token ids or text: from a label's
keys alone nobody can tell which document they came from. So when the daemon pins a
document it keeps, per label, each document pinned under it: the document as given (text,
messages or tokens; the tokens when ``--tokenizer`` named a tokenizer of this machine), its
model and adapter identity (NAME@DIGEST), whether a cache salt was part of its namespace
(never the salt, nor a digest of it) and its chunk keys. Export writes a document only while
every one of those keys is still pinned under the label.

One JSON file per label in ``STORE/pinned-documents/`` (0600 files in a 0700 folder, as
every file of a store), replaced whole. Unpinning drops the records whose keys are no
longer all pinned, and the file with the label's last pin. A file that cannot be read is
logged and counts as no record: its label's pins are then exported as chunk keys.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Collection
from typing import Any

from store.format.private import make_private_dir

log = logging.getLogger("lmctl.daemon")

FOLDER = "pinned-documents"
_lock = threading.Lock()


def _path(store_path: str, label: str) -> str:
    name = hashlib.sha256(label.encode()).hexdigest()[:32]
    return os.path.join(store_path, FOLDER, name + ".json")


def _read(path: str, label: str) -> list[dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as f:
            body = json.load(f)
        if body.get("label") != label or not isinstance(body.get("documents"), list):
            raise ValueError("not this label's record")
        return list(body["documents"])
    except FileNotFoundError:
        return []
    except (OSError, ValueError, AttributeError) as exc:
        log.warning("cannot read the pinned documents of label %r (%s): %s; its pins export as chunk keys",
                    label, path, exc)
        return []


def _write(path: str, label: str, documents: list[dict[str, Any]]) -> None:
    if not documents:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return
    make_private_dir(os.path.dirname(path))
    tmp = f"{path}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump({"label": label, "documents": documents}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def documents(store_path: str, label: str) -> list[dict[str, Any]]:
    """The documents recorded for ``label``: ``{"model", "adapter", "salted", "document",
    "keys", "pinned"}`` each, oldest first."""
    with _lock:
        return _read(_path(store_path, label), label)


def remember(store_path: str, label: str, model: str, adapter: str | None, salted: bool,
             document: dict[str, Any], keys: list[bytes]) -> None:
    """Record that ``document`` was pinned under ``label`` (again: its record is replaced).
    A failure to write is logged: the pin stands, and exports its keys instead."""
    rec = {"model": model, "adapter": adapter, "salted": salted, "document": document,
           "keys": [k.hex() for k in keys], "pinned": time.time()}
    ident = (model, adapter, salted, json.dumps(document, sort_keys=True))
    path = _path(store_path, label)
    with _lock:
        docs = [d for d in _read(path, label)
                if (d.get("model"), d.get("adapter"), d.get("salted"), json.dumps(d.get("document"), sort_keys=True))
                != ident]
        try:
            _write(path, label, [*docs, rec])
        except OSError as exc:
            log.warning("cannot record the document pinned under %r (%s): %s; export will list its chunk keys",
                        label, path, exc)


def prune(store_path: str, label: str, pinned: Collection[bytes]) -> None:
    """After an unpin: keep the records of ``label`` whose keys are all still ``pinned``
    under it (none, once the label is gone)."""
    path = _path(store_path, label)
    held = {k.hex() for k in pinned}
    with _lock:
        docs = _read(path, label)
        kept = [d for d in docs if held and all(k in held for k in d.get("keys", []))]
        if len(kept) != len(docs):
            try:
                _write(path, label, kept)
            except OSError as exc:
                log.warning("cannot update the pinned documents of %r (%s): %s", label, path, exc)

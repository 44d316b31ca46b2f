"""What the index's meta sub-database says about the store itself: its id (agreeing with the
store folder's marker), the boot it was last opened in, its format version and its settings,
and the checks a change of settings must pass before anything changes."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping

from ..config import StoreConfig, human_size
from ..errors import StoreError, TierNotEmpty
from ..format.private import STORE_MARKER, UnsafePath, marked_id, new_store_id, read_marker, write_marker
from ..index import FORMAT_VERSION, FORMATS, Index, Txn
from ..index.schema import META_BOOT_ID, META_CONFIG, META_FORMAT, META_STORE_ID
from ..tiers.space import TierState

log = logging.getLogger("lmctl.store")


class StoreMeta:
    """The store's id, boot, format and settings as the index keeps them."""

    def __init__(self, index: Index, path: str, journal_add: Callable[..., None]) -> None:
        self.index = index
        self.path = path
        self.journal_add = journal_add

    def identify(self, fresh: bool) -> str | None:
        """This store's id: the index's and the store folder's marker's, which must agree (an
        index that names another store, or none while the folder names one, was moved in:
        refused before it could take this store's files for its own). A new store gets a
        random id; a lost index gets the folder's back."""
        marker = os.path.join(self.path, STORE_MARKER)
        folder_id = marked_id(read_marker(marker))
        with self.index.read() as t:
            raw = t.get("meta", META_STORE_ID)
        index_id = bytes(raw).decode() if raw is not None else None
        if folder_id is not None and index_id != folder_id and (index_id is not None or not fresh):
            index = os.path.join(self.path, "index")
            raise UnsafePath(f"the index {index} is not this store's (it names store {index_id or 'none'}, the "
                             f"folder is store {folder_id}): it was moved or copied in from elsewhere; put it back, "
                             f"or move {index} aside so that the next open rebuilds this store's own index")
        if self.index.readonly or index_id is not None and folder_id is not None:
            return index_id or folder_id

        def claim(t: Txn) -> str:  # in one transaction: engines of one new store start at once
            raw = t.get("meta", META_STORE_ID)
            if raw is not None:
                return bytes(raw).decode()
            made = folder_id or new_store_id()
            t.put("meta", META_STORE_ID, made.encode())
            return made

        sid = self.index.write(claim)
        if folder_id is None:  # written after the index has it: a reader of the marker finds it there
            write_marker(marker, f"lmctl store {sid}: this folder and its tier folders belong to it\n")
        return sid

    def note_boot(self) -> bool:
        """Record this boot's id in the index; whether another boot recorded the last one."""
        try:
            with open("/proc/sys/kernel/random/boot_id", "rb") as f:
                boot = f.read().strip()
        except OSError:
            return False
        def fn(t: Txn) -> bool:
            old = t.get("meta", META_BOOT_ID)
            if old != boot:
                t.put("meta", META_BOOT_ID, boot)
            return old is not None and bytes(old) != boot

        return self.index.write(fn)

    def load_config(self, config: StoreConfig | None) -> StoreConfig:
        """The stored settings; ``config`` (or the defaults, for a new index) are written
        and journaled instead when given."""
        if self.index.readonly:
            with self.index.read() as t:
                raw = t.get("meta", META_CONFIG)
                self.check_format(t.get("meta", META_FORMAT))
            return StoreConfig.from_json(bytes(raw)) if raw else StoreConfig()

        def load(t: Txn) -> tuple[StoreConfig, bool]:
            raw = t.get("meta", META_CONFIG)
            ver = t.get("meta", META_FORMAT)
            self.check_format(ver)
            if ver is None:
                # a new index is of this format; one with chunks but no mark is of the first
                fresh = t.entries("chunks") == 0
                t.put("meta", META_FORMAT, str(FORMAT_VERSION if fresh else 1).encode())
            if config is None and raw is not None:
                return StoreConfig.from_json(bytes(raw)), False
            cfg = config or StoreConfig()
            cfg.validate()
            t.put("meta", META_CONFIG, cfg.to_json().encode())
            return cfg, True

        cfg, written = self.index.write(load)
        if written:
            self.journal_add("config", config=cfg.to_json())
        return cfg

    def absolute_tier_paths(self, config: StoreConfig, tier_paths: Mapping[str, str]) -> StoreConfig:
        """Refuse (or, with ``tier_paths``, fix) tier folders recorded as relative paths."""
        relative = {n: t.path for n, t in config.tiers.items() if t.path and not os.path.isabs(t.path)}
        if not relative:
            return config
        given = {n: p for n, p in tier_paths.items() if n in relative and os.path.isabs(p)}
        missing = sorted(set(relative) - set(given))
        if missing or self.index.readonly:
            n = (missing or sorted(relative))[0]
            raise StoreError(f"store {self.path}: tier {n}'s folder is recorded as the relative path "
                             f"{relative[n]!r} (an older lmctl kept --tier-path as typed), which each process "
                             "would look for from its own working folder; record its absolute path once: "
                             f"lmctl serve --store {self.path} --tier-path {n}=/ABSOLUTE/FOLDER")
        cfg = StoreConfig.from_json(config.to_json())
        for n, p in given.items():
            cfg.tiers[n].path = p
        self.index.write(lambda t: t.put("meta", META_CONFIG, cfg.to_json().encode()), durable=True)
        self.journal_add("config", config=cfg.to_json())
        log.warning("store %s: tier folder(s) recorded as relative paths are now recorded absolute: %s", self.path,
                    ", ".join(f"{n} {relative[n]!r} -> {p}" for n, p in sorted(given.items())))
        return cfg

    def check_format(self, raw: bytes | memoryview | None) -> int | None:
        """The index's format version (None: not marked yet), if this lmctl opens it: a newer
        one is refused before anything is read the way this version would misread it."""
        if raw is None:
            return None
        try:
            ver = int(bytes(raw))
        except ValueError:
            raise StoreError(f"store {self.path}: its format version {bytes(raw)[:20]!r} is not a number; the "
                             "index is damaged or not an lmctl index (restore it, or move it aside to rebuild it "
                             "from the segment files)") from None
        if ver not in FORMATS:
            raise StoreError(f"store {self.path} is of format {ver}, which this lmctl (format {FORMAT_VERSION}) "
                             "does not open" + ("; use the lmctl that wrote it, or a newer one"
                                                if ver > FORMAT_VERSION else ""))
        return ver

    def check_change(self, config: StoreConfig, tiers: Mapping[str, TierState]) -> list[str]:
        """Refuse settings this store cannot take: invalid ones, a tier's folder changed, a
        tier removed that holds chunks. The tiers the settings remove."""
        config.validate()
        for name, st in tiers.items():
            if name not in config.tiers:
                continue
            new_dir = config.tiers[name].path or os.path.join(self.path, name)
            if os.path.abspath(new_dir) != os.path.abspath(st.io.dir):
                raise StoreError(f"tier {name}'s folder cannot change while the store uses it ({st.io.dir}); "
                                 "stop every process that uses the store and move the folder first")
        removed = [name for name in tiers if name not in config.tiers]
        with self.index.read() as t:  # an empty tier only: said before anything changes
            for name in removed:
                self.check_empty(t, name, config)
        return removed

    @staticmethod
    def check_empty(t: Txn, name: str, config: StoreConfig) -> None:
        """Refuse to remove the tier ``name`` while it holds chunks."""
        n = t.counter(f"count:{name}")
        if n:
            other = next(iter(config.tiers))
            raise TierNotEmpty(f"tier {name} holds {n} chunk(s), {human_size(t.counter(f'live:{name}'))}: move or "
                             f"evict them first (lmctl move --tier {name} --to {other}, or lmctl evict --tier "
                             f"{name}), then remove it")

    def format_version(self) -> int:
        """The format of the index (1: written before the counts were kept)."""
        with self.index.read() as t:
            ver = self.check_format(t.get("meta", META_FORMAT))
        return 1 if ver is None else ver

    def index_is_new(self) -> bool:
        with self.index.read() as t:
            return t.get("meta", META_CONFIG) is None

    def index_is_empty(self) -> bool:
        with self.index.read() as t:
            return t.entries("chunks") == 0 and t.entries("segs") == 0

"""The daemon's folders: one daemon per socket and per store (flock'ed lock files), a store folder
checked (or made, with ``--init``, and unmade if the store never opens) before anything is
created, and the store opened with the settings given."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import stat
from typing import Any

from store import Store, StoreError
from store.format.private import STORE_MARKER, check_folder, make_private_dir, open_file

from ..errors import UsageError
from ..ops import check_pin_budgets
from .access import AlreadyServing, inside

log = logging.getLogger("lmctl.daemon")


class NoStore(UsageError):
    """``serve`` was pointed at a folder that holds no store, without ``--init``."""


#: what a store's folder holds (a store whose index was lost still has some of it); a name
#: ending in .sock or .sock.lock is a daemon's socket there
STORE_NAMES = ("index", "meta.journal", STORE_MARKER, "daemon.lock", "nvme", "dram", "pinned-documents")


def _check_init_folder(d: str) -> None:
    """``serve --init`` on a folder that exists: it becomes the store's only if it holds nothing
    but a store's own files and is already private. lmctl never takes over a folder of other
    files, nor changes the mode of a folder it did not make."""
    check_folder(d, "store folder")  # one another user could change is refused first, as always
    foreign = sorted(n for n in os.listdir(d) if n not in STORE_NAMES and not n.endswith((".sock", ".sock.lock")))
    if foreign:
        listed = ", ".join(repr(n) for n in foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise UsageError(f"--init: {d} is not empty and not an lmctl store (it holds {listed}); give a folder "
                         "that does not exist yet, or an empty one")
    mode = stat.S_IMODE(os.stat(d).st_mode)
    if mode & 0o077:
        raise UsageError(f"--init: the folder {d} is mode {mode:04o}, and a store's folder is private (0700); "
                         f"lmctl does not change a folder it did not make: chmod 0700 {d}, or give a path that "
                         "does not exist yet")


class Folders:
    """The socket's folder and lock, and the store's folder, lock and opening, for one daemon."""

    def __init__(self, store_dir: str, socket_path: str, init: bool, settings: dict[str, Any]) -> None:
        self.store_dir = store_dir
        self.socket_path = socket_path
        self.init = init
        self.settings = settings
        self._lockfd: int | None = None
        self._store_lockfd: int | None = None
        #: what this start's --init made (the folder, or the names put into an empty one), undone
        #: if the store never opens (a hostile tier folder, say): a refused --init leaves nothing
        self._init_made: tuple[bool, frozenset[str]] | None = None
        self.store_opened = False

    def check_socket_folder(self) -> None:
        """A socket folder that does not exist is refused, before anything is created: a typo'd
        ``--socket`` must not make folders (as root, anywhere). The store folder itself is the
        exception: the default socket lives there, and ``--init`` creates it."""
        folder = os.path.dirname(self.socket_path)
        if os.path.isdir(folder) or os.path.realpath(folder) == os.path.realpath(self.store_dir):
            return
        if os.path.lexists(folder):
            raise UsageError(f"the socket's folder {folder} is not a folder; choose another --socket")
        raise UsageError(f"the socket's folder {folder} does not exist; create it first (owned by the daemon's user, "
                         "writable by no one else; with systemd, RuntimeDirectory=lmctl makes /run/lmctl) or choose "
                         "another --socket")

    def take_lock(self) -> None:
        """Only one daemon per socket: a flock'ed file beside it settles races between starts.
        The file is removed when the daemon stops (``release_lock``), under the lock: a start
        that opened it just before finds, once it holds the lock, that the path names another
        file or none, and takes the lock again on the file there now."""
        folder = os.path.dirname(self.socket_path)
        if inside(folder, self.store_dir):
            make_private_dir(self.store_dir, "store folder")  # as the store makes it: 0700 whatever the umask
        # a folder no one else can write in (checked at every start), and a lock file opened
        # without following a link: never another file chmod'ed or written through it
        make_private_dir(folder, "socket folder", "remove it or choose another --socket", 0o755)
        path = self.socket_path + ".lock"
        while True:
            fd = open_file(path, os.O_RDWR | os.O_CREAT, "lock file")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise AlreadyServing(f"another lmctl daemon is already serving on {self.socket_path}") from None
                raise
            if self._names(path, fd):
                break
            os.close(fd)  # a daemon that stopped meanwhile removed the file this one opened
        self._lockfd = fd

    @staticmethod
    def _names(path: str, fd: int) -> bool:
        """Whether ``path`` is (still) the file open as ``fd``."""
        try:
            st = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            return False
        me = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (me.st_dev, me.st_ino)

    def release_lock(self) -> None:
        """Remove the socket's lock file (while still holding it), then let it go."""
        fd, self._lockfd = self._lockfd, None
        if fd is None:
            return
        path = self.socket_path + ".lock"
        try:
            if self._names(path, fd):
                os.unlink(path)
        except OSError as exc:  # a read-only or vanished folder: the file stays, harmlessly
            log.debug("could not remove the lock file %s: %s", path, exc)
        finally:
            os.close(fd)

    def _take_store_lock(self) -> None:
        """One daemon per store, whatever its socket: a flock'ed file in the store folder that
        names the daemon holding it."""
        path = os.path.join(self.store_dir, "daemon.lock")
        check_folder(self.store_dir, "store folder")
        writable = True
        try:
            fd = open_file(path, os.O_RDWR | os.O_CREAT, "lock file")
        except OSError as exc:
            if exc.errno != errno.EROFS:
                raise
            if not os.path.exists(path):  # a read-only store: daemons that cannot write cannot clash
                log.warning("the store %s is on a read-only filesystem: serving it without its daemon lock",
                            self.store_dir)
                return
            # a read-only filesystem: flock it, name no holder
            fd, writable = open_file(path, os.O_RDONLY, "lock file", written=False), False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise AlreadyServing(f"another lmctl daemon already serves the store {self.store_dir}"
                                     + (f" ({holder})" if holder else "") + "; one daemon per store") from None
            raise
        if writable:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {self.socket_path}\n".encode(), 0)
        self._store_lockfd = fd

    def check_store(self) -> None:
        """Before anything is created: a typo'd --store must not become a new, empty store."""
        d = self.store_dir
        if os.path.exists(d) and not os.path.isdir(d):
            raise UsageError(f"--store {d} is a file, not a store folder")
        if not os.path.isdir(os.path.join(d, "index")):
            if not self.init:
                raise NoStore(f"no lmctl store at {d}; check the path, or pass --init to create a new store there")
            if os.path.isdir(d):
                _check_init_folder(d)
                self._init_made = (False, frozenset(os.listdir(d)))
                return
            try:
                make_private_dir(d, "store folder")
            except OSError as exc:
                raise StoreError(f"cannot create the store folder {d}: {exc.strerror}") from None
            self._init_made = (True, frozenset())

    def undo_init(self) -> None:
        """A start with --init that never opened its store: remove what it made (the folder it
        created, or the store's own names it put into an empty folder), so that a refused
        --init leaves nothing behind. Only names a store makes are removed."""
        if self._init_made is None or self.store_opened:
            return
        d = self.store_dir
        made_dir, before = self._init_made
        try:
            if made_dir:
                shutil.rmtree(d)
                return
            for name in os.listdir(d):
                if name in before or not (name in STORE_NAMES or name.endswith((".sock", ".sock.lock"))):
                    continue
                path = os.path.join(d, name)
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
        except OSError as exc:
            log.warning("could not remove what the refused --init made in %s: %s", d, exc)

    def open_store(self) -> Store:
        d = self.store_dir
        self._take_store_lock()
        try:
            # a read-only disk: serve it read-only, do not exit; --tier-path records a tier folder
            # an older lmctl kept as a relative path
            paths = {k.split(".")[1]: v for k, v in self.settings.items()
                     if k.startswith("tiers.") and k.endswith(".path") and isinstance(v, str)}
            store = Store(d, fallback_readonly=True, tier_paths=paths)
        except OSError as exc:
            raise StoreError(f"cannot open the store at {d}: {exc.strerror or exc}") from None
        if self.settings and store.readonly:
            log.warning("store %s is read-only (%s): the settings given (%s) are not applied", d,
                        store.readonly_reason, ", ".join(sorted(self.settings)))
        elif self.settings:
            from ..settings import apply_settings

            default = store.config.default_tier  # "--capacity SIZE" means the default tier's
            changes = {k.replace("tiers.@default.", f"tiers.{default}."): v for k, v in self.settings.items()}
            try:
                cfg = apply_settings(store.config, changes)
                check_pin_budgets(store, cfg)
                if cfg.to_json() != store.config.to_json():
                    store.configure(cfg)
                    log.info("store settings changed: %s", ", ".join(sorted(changes)))
            except (StoreError, UsageError) as exc:
                store.close()
                raise UsageError(f"bad store setting: {exc}") from None
        return store

    def release_store_lock(self) -> None:
        if self._store_lockfd is not None:
            os.close(self._store_lockfd)
            self._store_lockfd = None

"""``lmctl serve``: the cache-manager daemon on a local Unix socket.

One thread per client connection over one shared ``Store`` (thread-safe); a maintenance
thread that keeps tiers under their high watermark and compacts dead space; clean exit on
SIGTERM/SIGINT. The socket is mode 0600 and peers of another uid are refused (peer
credentials, read as the connection is accepted: a refused peer gets one reply and is hung
up on, never taking a client slot, a thread or a wait), unless allowed with
``--allow-uid``; such a uid must also be able to reach
the socket (``--socket`` outside the private store folder, ``--socket-mode``,
``--socket-group``), which ``serve`` checks before it starts.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import os
import pwd
import select
import shutil
import signal
import socket
import stat
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from store import Store, StoreError
from store.private import STORE_MARKER, check_folder, make_private_dir, open_file

from . import __version__, protocol
from .errors import Cancelled, Denied, UsageError
from .health import HIGH_WATERMARK, FailedJobs, Maintenance, describe_pass, error_line, utc
from .health import reasons as health_reasons
from .ops import OPS, check_pin_budgets
from .ops import Job as OpJob
from .selection import set_caller
from .settings import check_id, maintenance_interval

log = logging.getLogger("lmctl.daemon")


#: how long a stopping daemon waits for running jobs to notice they are cancelled
SHUTDOWN_GRACE_S = 30.0
#: clients served at once; one more is told the daemon is busy and hung up on
MAX_CLIENTS = 64
#: a connection with no request for this long is closed (clients reconnect on their own)
IDLE_TIMEOUT_S = 300.0
#: a refused peer's uid is logged at most this often (a flood of them is counted, not logged)
DENIED_LOG_EVERY_S = 60.0
#: a reply or progress frame the client does not take in within this long ends the connection
WRITE_TIMEOUT_S = 30.0
#: after a request, the index's mapped pages are dropped from the daemon's memory once more
#: than this is resident (a lookup maps a few pages; a pass over a large index, all of them)
RELEASE_ABOVE = 64 << 20
#: fault injection for tests: seconds each progress step of a job takes
_FAULT_STEP_DELAY = float(os.environ.get("LMCTL_FAULT_JOB_STEP_DELAY", "0") or 0)


@dataclass
class Job(OpJob):
    """One running request. ``progress`` streams progress frames and is where a job learns
    that it is cancelled: its client hung up (Ctrl-C) or the daemon is stopping."""

    id: int
    cmd: str
    started: float
    conn: socket.socket | None = None
    rid: Any = None
    stopping: threading.Event | None = None
    done: int = 0
    total: int = 0
    what: str = ""
    _last_sent: float = 0.0
    _last_poll: float = 0.0

    def _client_gone(self) -> bool:
        if self.conn is None:
            return False
        try:
            readable, _, _ = select.select([self.conn], [], [], 0)
            return bool(readable) and self.conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def _check(self) -> None:
        now = time.monotonic()
        if self.stopping is not None and self.stopping.is_set():
            raise Cancelled(f"{self.cmd} was cancelled: the daemon is stopping "
                            f"(done {self.done} of {self.total or '?'}; run it again when the daemon is back)")
        if now - self._last_poll >= 0.05:
            self._last_poll = now
            if self._client_gone():
                raise Cancelled(f"{self.cmd} was cancelled: its client went away (done {self.done} of {self.total})")

    def progress(self, done: int, total: int, what: str) -> None:
        if _FAULT_STEP_DELAY:
            time.sleep(_FAULT_STEP_DELAY)
        self.done, self.total, self.what = done, total, what
        self._check()
        now = time.monotonic()
        if self.conn is not None and (now - self._last_sent >= 0.1 or done >= total):
            self._last_sent = now
            try:
                protocol.send(self.conn, {"id": self.rid, "progress": {"done": done, "total": total, "what": what}})
            except OSError:
                raise Cancelled(f"{self.cmd} was cancelled: its client went away") from None

    def emit(self, rows: list[dict[str, Any]], into: str = "chunks") -> None:
        self._check()
        if self.conn is None:
            return
        try:
            protocol.send(self.conn, {"id": self.rid, "rows": rows, **({} if into == "chunks" else {"into": into})})
        except OSError:
            raise Cancelled(f"{self.cmd} was cancelled: its client went away") from None


@dataclass
class DaemonState:
    store: Store
    socket_path: str
    started: float = field(default_factory=time.time)
    jobs: dict[int, Job] = field(default_factory=dict)
    requests: int = 0
    errors: int = 0
    maintenance: Maintenance = field(default_factory=lambda: Maintenance(30.0))
    failed_jobs: FailedJobs = field(default_factory=FailedJobs)
    lock: threading.Lock = field(default_factory=threading.Lock)


class AlreadyServing(StoreError):
    pass


class NoStore(UsageError):
    """``serve`` was pointed at a folder that holds no store, without ``--init``."""


def _refuse(conn: socket.socket, code: str, message: str) -> None:
    """Answer a connection that will not be served with one error reply and close it, without
    waiting: the reply is far smaller than a socket's buffer, so a non-blocking send puts it
    there whole (or, if the peer is already gone, fails at once). The client reads it even
    after the hang-up (``Client`` reads what arrived when its own send finds the socket shut)."""
    try:
        conn.setblocking(False)
        conn.send(protocol.encode({"id": None, "ok": False, "error": {"code": code, "message": message}}))
    except OSError:
        pass
    finally:
        conn.close()


def bind_socket(path: str, mode: int = 0o600, gid: int | None = None) -> socket.socket:
    """Bind the daemon's socket. A stale socket (no one listening) is replaced; a live one
    (another daemon) is never taken over; anything that is not a socket is left alone.

    The socket ends up with ``mode`` and group ``gid``, and is never more open than that:
    it is born with the owner's bits only, given its group, and only then opened to it. Its
    folder must be private (``store.private.check_folder``): no one else can put a link there
    for the chmod to follow."""
    folder = os.path.dirname(os.path.abspath(path))
    # no one else's (a new one 0755: the socket's own mode keeps clients out, --allow-uid ones pass)
    make_private_dir(folder, "socket folder", "remove it or choose another --socket", 0o755)
    if os.path.lexists(path):
        st = os.lstat(path)
        if not stat.S_ISSOCK(st.st_mode):
            raise StoreError(f"{path} exists and is not a socket; remove it or choose another --socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            log.warning("replacing stale socket %s (no daemon is listening on it)", path)
            os.unlink(path)
        except OSError as exc:
            raise StoreError(f"cannot check the existing socket {path}: {exc}") from None
        else:
            raise AlreadyServing(f"another lmctl daemon is already serving on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o777 & ~(mode & 0o700))  # born with the owner's bits only: no one else connects
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    try:
        if gid is not None:
            os.chown(path, -1, gid, follow_symlinks=False)
        os.chmod(path, mode)
    except OSError as exc:
        sock.close()
        os.unlink(path)
        raise StoreError(f"cannot give the socket {path} group {gid} and mode {mode:04o}: {exc.strerror} "
                         "(the daemon's user must be a member of --socket-group)") from None
    sock.listen(64)
    return sock


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _groups_of(uid: int) -> set[int] | None:
    """The gids of a user (primary and supplementary), or None for a uid with no passwd entry."""
    try:
        pw = pwd.getpwuid(uid)
    except KeyError:
        return None
    return {pw.pw_gid, *os.getgrouplist(pw.pw_name, pw.pw_gid)}


def _grants(st_uid: int, st_gid: int, mode: int, uid: int, groups: set[int] | None, bit: int) -> bool:
    """Whether permission ``bit`` (4 r, 2 w, 1 x) reaches ``uid`` through ``mode``. For a uid
    with unknown groups, any group or other bit counts (it may be in the group)."""
    if uid == 0:
        return True
    if uid == st_uid:
        return bool(mode & (bit << 6))
    if groups is None:
        return bool(mode & ((bit << 3) | bit))
    if st_gid in groups:
        return bool(mode & (bit << 3))
    return bool(mode & bit)


def socket_access_problem(socket_path: str, store_dir: str, mode: int, gid: int | None,
                          uids: Iterable[int]) -> str | None:
    """Why an allowed uid could not connect to the socket (file modes), or None if all can.

    Connecting needs write permission on the socket and search permission on every folder
    above it. The store folder is always private (0700), so a socket inside it reaches no
    one else. Folders that do not exist yet are not judged."""
    others = sorted({u for u in uids if u != os.geteuid()})
    if not others:
        return None
    if _inside(os.path.dirname(os.path.abspath(socket_path)), store_dir):
        return (f"uid {others[0]} cannot reach the socket {socket_path}: it is inside the store folder, "
                "which is private (0700)")
    if not mode & 0o022:
        return (f"uid {others[0]} cannot connect to the socket {socket_path}: mode {mode:04o} lets no other "
                "user connect (connecting needs write permission)")
    sock_gid = gid if gid is not None else os.getegid()
    folder = os.path.dirname(os.path.abspath(socket_path))
    if os.path.isdir(folder) and os.stat(folder).st_mode & stat.S_ISGID and gid is None:
        sock_gid = os.stat(folder).st_gid  # a setgid folder hands its group to the socket
    for uid in others:
        groups = _groups_of(uid)
        if not _grants(os.geteuid(), sock_gid, mode, uid, groups, 2):
            return (f"uid {uid} cannot connect to the socket {socket_path}: mode {mode:04o} with group "
                    f"{sock_gid} gives it no write permission")
        d = folder
        while True:
            try:
                st = os.stat(d)
            except FileNotFoundError:
                st = None
            if st is not None and not _grants(st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode), uid, groups, 1):
                return (f"uid {uid} cannot reach the socket {socket_path}: the folder {d} (mode "
                        f"{stat.S_IMODE(st.st_mode):04o}, owner {st.st_uid}, group {st.st_gid}) keeps it out")
            parent = os.path.dirname(d)
            if parent == d:
                break
            d = parent
    return None


def socket_access(socket_mode: str | int, socket_group: str | int | None) -> tuple[int, int | None]:
    """``--socket-mode`` and ``--socket-group`` checked: (mode, gid or None)."""
    text = str(socket_mode)
    try:
        mode = int(text.removeprefix("0o"), 8)
    except ValueError:
        raise UsageError(f"--socket-mode {text!r} is not an octal mode such as 0600 or 0660") from None
    if mode & ~0o666 or mode & 0o600 != 0o600:
        raise UsageError(f"--socket-mode {text} must give the owner read and write and nobody execute "
                         "(0600, 0620, 0660, 0666)")
    gid = None
    if socket_group is not None:
        import grp

        group = str(socket_group)
        try:
            numeric = group.isascii() and group.isdigit()  # "²" is a digit to isdigit, not to int
            gid = check_id(int(group), "--socket-group") if numeric else grp.getgrnam(group).gr_gid
        except KeyError:
            raise UsageError(f"--socket-group: no group named {group!r}") from None
    return mode, gid


#: the most bytes a Unix socket's path may have (``sun_path`` holds 108, its NUL included)
SUN_PATH_MAX = 107


def check_socket_path(path: str, given: bool = True) -> None:
    """A socket path the kernel cannot bind is a usage error that names the limit, before
    anything is created (``bind`` would say only "AF_UNIX path too long")."""
    n = len(os.fsencode(path))
    if n > SUN_PATH_MAX:
        where = "--socket" if given else "the socket in the store folder"
        raise UsageError(f"{where} {path} is {n} bytes long; a Unix socket's path can be at most {SUN_PATH_MAX} "
                         f"bytes: give a shorter --socket (e.g. /run/lmctl/lmctl.sock)")


def sd_notify(state: str) -> bool:
    """Tell the service manager how the daemon is (systemd's ``Type=notify``: ``READY=1``,
    ``STOPPING=1``): one datagram to ``$NOTIFY_SOCKET`` (a path, or ``@name`` for an abstract
    socket). Without it, does nothing; a send that fails is logged, never fatal. Whether it
    was sent."""
    addr = os.environ.get("NOTIFY_SOCKET", "")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    elif not addr.startswith("/"):
        log.warning("NOTIFY_SOCKET=%s is neither a path nor @name: readiness not reported", addr)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.settimeout(5.0)
            s.connect(addr)
            s.sendall(state.encode())
        return True
    except OSError as exc:
        log.warning("could not notify the service manager (%s) on NOTIFY_SOCKET: %s", state.split("\n")[0], exc)
        return False


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


class SocketUnreachable(StoreError):
    """``--allow-uid`` names a user whom the socket's place or mode keeps out."""


#: what a read-only peer (``--allow-uid-ro``) may ask: requests that change nothing
READ_ONLY_CMDS = frozenset({"status", "metrics", "lookup", "inspect", "ls", "events", "names", "export"})
#: requests a read-only peer may make as dry runs (they change nothing either)
DRY_RUN_CMDS = frozenset({"evict", "pin", "unpin", "move", "compress", "config", "drain"})


def changes_the_store(cmd: str, args: dict[str, Any]) -> str | None:
    """What a request would change, as a command line names it (None: it changes nothing):
    ``verify`` with ``fix``, ``config`` with ``set``, any other command but a read, unless it
    is a dry run."""
    if cmd in READ_ONLY_CMDS:
        return None
    if cmd == "verify":
        return "verify --fix" if args.get("fix") else None
    if cmd == "config" and not args.get("set"):
        return None
    if cmd in DRY_RUN_CMDS and args.get("dry_run") is True:
        return None
    return "config set" if cmd == "config" else cmd


class Daemon:
    def __init__(self, store_dir: str, socket_path: str | None = None, allow_uids: Iterable[int] = (),
                 maintenance_s: float = 30.0, socket_mode: int = 0o600, socket_group: int | None = None, *,
                 init: bool = True, settings: dict[str, Any] | None = None, metrics: str | None = None,
                 allow_ro_uids: Iterable[int] = ()) -> None:
        self.store_dir = os.path.abspath(store_dir)
        self.socket_path = os.path.abspath(socket_path or os.path.join(self.store_dir, "lmctl.sock"))
        check_socket_path(self.socket_path, given=socket_path is not None)
        self.allow = {os.getuid(), *allow_uids}
        #: uids that may read (status, ls, lookup, ...) and change nothing; full access wins
        self.allow_ro = set(allow_ro_uids) - self.allow
        self.socket_mode = socket_mode
        self.socket_group = socket_group
        self.maintenance_s = maintenance_interval(maintenance_s)
        self.init = init
        self.settings = dict(settings or {})
        self.metrics = metrics
        if metrics is not None:
            from .metrics import parse_listen

            parse_listen(metrics)  # a bad address is a usage error before anything starts
        self._stop = threading.Event()
        self._release = threading.Event()
        self._ids = itertools.count(1)
        self._lockfd: int | None = None
        self._store_lockfd: int | None = None
        #: what this start's --init made (the folder, or the names put into an empty one), undone
        #: if the store never opens (a hostile tier folder, say): a refused --init leaves nothing
        self._init_made: tuple[bool, frozenset[str]] | None = None
        self._store_opened = False
        self._conns: dict[socket.socket, Job | None] = {}
        self._conns_lock = threading.Lock()
        self._denied: dict[int, tuple[float, int]] = {}  # uid: (last logged, refused since)

    def _check_socket_folder(self) -> None:
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

    def _take_lock(self) -> None:
        """Only one daemon per socket: a flock'ed file beside it settles races between starts.
        The file is removed when the daemon stops (``_release_lock``), under the lock: a start
        that opened it just before finds, once it holds the lock, that the path names another
        file or none, and takes the lock again on the file there now."""
        folder = os.path.dirname(self.socket_path)
        if _inside(folder, self.store_dir):
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

    def _release_lock(self) -> None:
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

    def _check_store(self) -> None:
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

    def _undo_init(self) -> None:
        """A start with --init that never opened its store: remove what it made (the folder it
        created, or the store's own names it put into an empty folder), so that a refused
        --init leaves nothing behind. Only names a store makes are removed."""
        if self._init_made is None or self._store_opened:
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

    def _open_store(self) -> Store:
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
            from .settings import apply_settings

            default = store.config.default_tier  # "--capacity SIZE" means the default tier's
            changes = {k.replace("tiers.@default.", f"tiers.{default}."): v for k, v in self.settings.items()}
            try:
                cfg = apply_settings(store.config, changes)
                check_pin_budgets(store, cfg)
                if cfg.to_json() != store.config.to_json():
                    store.configure(cfg)
                    log.info("store settings changed: %s", ", ".join(sorted(changes)))
            except StoreError as exc:
                store.close()
                raise UsageError(f"bad store setting: {exc}") from None
        return store

    def stop(self, *_: Any) -> None:
        self._stop.set()

    def _check_access(self) -> None:
        problem = socket_access_problem(self.socket_path, self.store_dir, self.socket_mode, self.socket_group,
                                        self.allow | self.allow_ro)
        if problem is not None:
            raise SocketUnreachable(
                f"{'--allow-uid/--allow-uid-ro' if self.allow_ro else '--allow-uid'}: {problem}; pass e.g. "
                "--socket /run/lmctl/lmctl.sock --socket-mode 0660 "
                "--socket-group lmctl (a folder that user can pass through, a group it is in)")

    def serve(self) -> bool:
        """Serve until SIGTERM/SIGINT; True when every client thread finished and the store was
        closed, False when some request did not stop in time (the store is crash-safe). The
        socket's lock file is removed when the daemon stops, and when a start that took it is
        refused after all."""
        self._check_access()  # before anything is created
        self._check_socket_folder()
        self._check_store()
        try:
            self._take_lock()
        except OSError as exc:
            if exc.errno == errno.EROFS:
                raise StoreError(f"the socket's folder {os.path.dirname(self.socket_path)} is on a read-only "
                                 "filesystem; to serve the store read-only, give --socket a path on a writable one "
                                 "(e.g. /run/lmctl/lmctl.sock)") from None
            raise StoreError(f"cannot use the socket folder for {self.socket_path}: {exc.strerror}") from None
        try:
            return self._serve_locked()
        finally:
            self._release_lock()
            if self._store_lockfd is not None:
                os.close(self._store_lockfd)
                self._store_lockfd = None
            self._undo_init()

    def _serve_locked(self) -> bool:
        self._check_access()  # now that the socket's folder exists
        exporter = None
        if self.metrics is not None:  # before the store is opened (or created): a port in use changes nothing
            from .metrics import Exporter

            exporter = Exporter(self.metrics, lambda: self.state.store, self._exporter_extra)
            self.metrics_port = exporter.port
        try:
            store = self._open_store()
        except BaseException:
            if exporter is not None:
                exporter.close()
            raise
        self._store_opened = True
        self.state = DaemonState(store, self.socket_path, maintenance=Maintenance(self.maintenance_s))
        try:
            listener = bind_socket(self.socket_path, self.socket_mode, self.socket_group)
        except BaseException:
            if exporter is not None:
                exporter.close()
            store.close()
            raise
        listener.settimeout(0.25)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.stop)
        maint = threading.Thread(target=self._maintain, name="lmctl-maintenance", daemon=True)
        maint.start()
        releaser = threading.Thread(target=self._releaser, name="lmctl-release", daemon=True)
        releaser.start()
        log.info("lmctl %s serving store %s on %s (pid %d)", __version__, self.store_dir, self.socket_path,
                 os.getpid())
        for note in store.notes():
            log.warning("%s", note)
        threads: list[threading.Thread] = []
        # the socket is listening and the store open: a Type=notify unit is started now
        sd_notify(f"READY=1\nMAINPID={os.getpid()}\nSTATUS=serving {self.store_dir} on {self.socket_path}")
        try:
            while not self._stop.is_set():
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                except OSError as exc:
                    if self._stop.is_set():
                        break
                    log.warning("accept failed: %s", exc)
                    continue
                # who is calling, before the connection counts against the limit or costs a thread
                try:
                    uid = protocol.peer_uid(conn)
                except OSError:
                    uid = -1
                if uid not in self.allow and uid not in self.allow_ro:
                    self._deny(conn, uid)
                    continue
                threads = [x for x in threads if x.is_alive()]
                if len(threads) >= MAX_CLIENTS:
                    self._busy_reply(conn, len(threads))
                    continue
                conn.settimeout(WRITE_TIMEOUT_S)  # sends; reads set their own deadlines
                t = threading.Thread(target=self._client, args=(conn, uid, uid in self.allow_ro), name="lmctl-client",
                                     daemon=True)
                t.start()
                threads.append(t)
        finally:
            log.info("shutting down")
            sd_notify("STOPPING=1")
            self._stop.set()
            listener.close()
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass
            if exporter is not None:
                exporter.close()
            self._release.set()
            clean = self._drain([*threads, maint, releaser])
            if clean:
                store.close()
        return clean

    def _drain(self, threads: list[threading.Thread]) -> bool:
        """Wake idle clients (they are hung up on) and let running jobs stop: each one is
        cancelled at its next progress step and answers its client with why. True when every
        client thread finished, so the store can be closed under no one."""
        with self._conns_lock:
            idle = [c for c, job in self._conns.items() if job is None]
        for conn in idle:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        end = time.monotonic() + SHUTDOWN_GRACE_S
        for t in threads:
            t.join(timeout=max(0.0, end - time.monotonic()))
        left = [t for t in threads if t.is_alive()]
        if left:
            with self._conns_lock:
                jobs = [j.cmd for j in self._conns.values() if j is not None]
            log.error("%d request(s) (%s) did not stop within %.0f s; exiting without closing the store "
                      "(it is crash-safe)", len(left), ", ".join(jobs) or "reading", SHUTDOWN_GRACE_S)
            return False
        return True

    def _releaser(self) -> None:
        """After requests: drop the index's mapped pages from memory when more than
        ``RELEASE_ABOVE`` bytes of it are resident. Off the requests' path, so a lookup never
        waits for the pages a long listing left behind to be unmapped."""
        while not self._stop.is_set():
            self._release.wait()
            self._release.clear()
            if self._stop.is_set():
                return
            try:
                self.state.store.release_memory(above=RELEASE_ABOVE)
            except Exception as exc:  # a closed or failing store: the next request tries again
                log.debug("releasing the index's pages failed: %s", exc)

    def _maintain(self) -> None:
        while not self._stop.wait(self.maintenance_s):
            self._maintain_once()

    def _maintain_once(self) -> None:
        """One maintenance pass, its outcome recorded for ``status``, the health check and the
        metrics. A failure is logged as one line (with the traceback once, at the first failure
        of a run of them, for whoever debugs it); the next pass tries again."""
        st = self.state
        m = st.maintenance
        with st.lock:
            m.running_since = time.time()
        try:
            did = st.store.maintain(HIGH_WATERMARK).to_dict()
        except Exception as exc:
            line = error_line(exc)
            with st.lock:
                m.running_since = None
                m.failed(line, time.time())
                n, since, total = m.consecutive_failures, m.failing_since, m.failures_total
            if n == 1:
                log.warning("maintenance failed: %s", line, exc_info=True)
            else:
                log.warning("maintenance failed again (%d passes in a row since %s, %d in all): %s", n,
                            utc(since or 0), total, line)
        else:
            with st.lock:
                m.running_since = None
                was = m.consecutive_failures
                m.succeeded(did, time.time())
            if was:
                log.info("maintenance works again after %d failed pass(es): %s", was, describe_pass(did))
            elif any(did.values()):
                log.info("maintenance: %s", describe_pass(did))
        try:
            above = {name: t.disk_bytes / t.capacity for name, t in st.store.stats().tiers.items()
                     if t.capacity and t.disk_bytes > HIGH_WATERMARK * t.capacity}
        except Exception as exc:  # a closed or failing store: the status request that asks says so
            log.debug("reading the tiers' usage after maintenance failed: %s", exc)
            above = {}
        with st.lock:
            m.above_watermark = above

    # -- one client ----------------------------------------------------------------
    def _client(self, conn: socket.socket, uid: int, readonly: bool = False) -> None:
        """Serve an allowed peer (``uid``, checked at accept; ``readonly``: one of
        ``--allow-uid-ro``) until it hangs up."""
        st = self.state
        set_caller(uid)  # every request of this connection is this uid's
        with conn:
            with self._conns_lock:
                self._conns[conn] = None
            try:
                while not self._stop.is_set():
                    try:
                        msg = protocol.read_frame(conn, IDLE_TIMEOUT_S)
                    except protocol.ProtocolError as exc:
                        # the stream cannot be trusted after a bad frame: answer, then hang up
                        st.errors += 1
                        self._send(conn, {"id": None, "ok": False, "error": {"code": "protocol", "message": str(exc)}})
                        return
                    except OSError:
                        return
                    if msg is None or self._stop.is_set():
                        return
                    self._handle(conn, msg, uid if readonly else None)
            finally:
                with self._conns_lock:
                    self._conns.pop(conn, None)

    def _clients(self) -> int:
        """Clients connected now (each one's running job, or None, is kept in ``_conns``)."""
        with self._conns_lock:
            return len(self._conns)

    def _busy_reply(self, conn: socket.socket, n: int) -> None:
        """Over the connection cap: one error reply, then hang up (never a thread)."""
        log.warning("refused a client: %d clients connected (the limit)", n)
        _refuse(conn, "failed", f"the daemon is busy: {n} clients connected, the most it serves at once; "
                                "try again shortly")

    def _deny(self, conn: socket.socket, uid: int) -> None:
        """A peer whose uid is not allowed: one reply without waiting, then hang up. It costs
        the accept loop a few system calls, never a slot, a thread or a wait; the log says so
        once a minute per uid, however fast the connections come."""
        now = time.monotonic()
        seen = self._denied.get(uid)
        if seen is None or now - seen[0] >= DENIED_LOG_EVERY_S:
            more = f" ({seen[1]} more refused since the last report)" if seen is not None and seen[1] else ""
            log.warning("refused a client of uid %d (allowed: %s%s)%s", uid, sorted(self.allow),
                        f"; read-only: {sorted(self.allow_ro)}" if self.allow_ro else "", more)
            self._denied[uid] = (now, 0)
            if len(self._denied) > 1024:  # uids come from the kernel, but stay bounded anyway
                self._denied = {uid: self._denied[uid]}
        else:
            self._denied[uid] = (seen[0], seen[1] + 1)
        _refuse(conn, "denied", f"uid {uid} may not use this daemon (peer credentials); the daemon's owner "
                                f"(uid {os.geteuid()}) can admit it: lmctl serve --allow-uid {uid}")

    def _send(self, conn: socket.socket, msg: dict[str, Any]) -> bool:
        try:
            protocol.send(conn, msg)
            return True
        except (OSError, protocol.ProtocolError):
            return False

    def _handle(self, conn: socket.socket, msg: dict[str, Any], readonly_uid: int | None = None) -> None:
        """Answer one request; ``readonly_uid``: the uid of a read-only peer (``--allow-uid-ro``),
        whose requests that would change the store are ``denied``."""
        st = self.state
        rid = msg.get("id")
        cmd = msg.get("cmd")
        args = msg.get("args", {})
        st.requests += 1

        def fail(code: str, message: str) -> None:
            st.errors += 1
            self._send(conn, {"id": rid, "ok": False, "error": {"code": code, "message": message}})

        if not isinstance(cmd, str) or not isinstance(args, dict):
            return fail("usage", "a request needs 'cmd' (a string) and 'args' (an object)")
        if readonly_uid is not None and cmd in OPS:  # an unknown command is a usage error, below
            change = changes_the_store(cmd, args)
            if change is not None:
                log.info("denied %s to read-only uid %d", change, readonly_uid)
                return fail("denied", f"uid {readonly_uid} may only read this store (serve --allow-uid-ro): "
                                      f"{change} changes it; --dry-run shows what it would do, or ask the store's "
                                      f"owner (uid {os.geteuid()})")
        if cmd == "status":
            return self._reply(conn, rid, self._status())
        if cmd == "metrics":
            return self._reply(conn, rid, self._metrics())
        op = OPS.get(cmd)
        if op is None:
            return fail("usage", f"unknown command {cmd!r}; known: {', '.join(sorted([*OPS, 'metrics', 'status']))}")
        job = Job(next(self._ids), cmd, time.time(), conn, rid, self._stop)
        with st.lock:
            st.jobs[job.id] = job
        with self._conns_lock:
            self._conns[conn] = job
        try:
            result = op(st.store, args, job)
        except UsageError as exc:
            return fail("usage", str(exc))
        except Denied as exc:
            return fail("denied", str(exc))
        except Cancelled as exc:
            log.info("job %d (%s) cancelled: %s", job.id, cmd, exc)
            return fail("cancelled", str(exc))
        except StoreError as exc:
            self._job_failed(job, str(exc))
            return fail("failed", str(exc))
        except RecursionError:
            return fail("usage", f"{cmd}: the request is nested too deeply")
        except Exception as exc:  # a bug must not take the daemon down
            log.exception("%s failed", cmd)
            message = f"{cmd} failed: {error_line(exc)}"
            self._job_failed(job, message)
            return fail("failed", message)
        finally:
            self._release.set()  # the releaser drops the index's pages if too many are mapped
            with st.lock:
                st.jobs.pop(job.id, None)
            with self._conns_lock:
                if conn in self._conns:
                    self._conns[conn] = None
        self._reply(conn, rid, result)

    def _job_failed(self, job: Job, message: str) -> None:
        with self.state.lock:
            self.state.failed_jobs.add(job.id, job.cmd, time.time(), message)

    def _reply(self, conn: socket.socket, rid: Any, result: dict[str, Any]) -> None:
        try:
            protocol.send(conn, {"id": rid, "ok": True, "result": result})
        except protocol.FrameTooLarge as exc:
            self._send(conn, {"id": rid, "ok": False, "error": {
                "code": "failed", "message": f"{exc}; narrow the selection (e.g. ls --limit)"}})
        except OSError:
            pass

    def _metrics(self) -> dict[str, Any]:
        """``status`` and the store's metric cells (every process's counts; see lmctl top)."""
        cells = [{"name": c.name, "labels": c.labels, "value": c.value, "count": c.count, "sum": c.sum}
                 for c in self.state.store.metric_cells()]
        gauges = [{"name": g.name, "labels": g.labels, "value": g.value, "time": g.time}
                  for g in self.state.store.metric_gauges()]
        return {"time": time.time(), "status": self._status(), "cells": cells, "gauges": gauges}

    def _exporter_extra(self) -> dict[str, Any]:
        st = self.state
        with st.lock:
            jobs: dict[str, int] = {}
            for j in st.jobs.values():
                jobs[j.cmd] = jobs.get(j.cmd, 0) + 1
            failures = st.maintenance.failures_total
        return {"jobs": jobs, "requests": st.requests, "errors": st.errors, "maintenance_failures": failures}

    def _status(self) -> dict[str, Any]:
        st = self.state
        stats = st.store.stats()
        with st.lock:
            jobs = [{"id": j.id, "cmd": j.cmd, "done": j.done, "total": j.total, "what": j.what,
                     "running_s": round(time.time() - j.started, 3)} for j in st.jobs.values()]
            maintenance = st.maintenance.to_dict()
            above = dict(st.maintenance.above_watermark)
            failed = st.failed_jobs.to_list()
        out = {
            "daemon": {"version": __version__, "protocol": protocol.VERSION, "pid": os.getpid(),
                       "uptime_s": round(time.time() - st.started, 3), "socket": st.socket_path,
                       "clients": self._clients(), "requests": st.requests, "errors": st.errors,
                       "maintenance": maintenance},
            "store": {"path": st.store.path, "readonly": st.store.readonly, "readonly_reason": st.store.readonly_reason,
                      "refused_saves": st.store.refused_saves, "tiers": stats.to_dict()["tiers"],
                      "counters": stats.counters,
                      "write_amplification": round(stats.write_amplification, 6),
                      "codec": st.store.config.codec, "remote": stats.remote,
                      "remote_refused": stats.remote_refused, "notes": st.store.notes()},
            "jobs": jobs,
            "failed_jobs": failed,
        }
        why = health_reasons(out, st.store.unavailable_tiers(), above, st.store.config.default_tier)
        out["health"] = {"healthy": not why, "reasons": why}
        return out

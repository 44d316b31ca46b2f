"""Who may use the daemon and what they may ask: the socket (bound private, its place and mode
checked against the uids allowed), a refused connection's one reply, and the requests a
read-only peer may make."""

from __future__ import annotations

import logging
import os
import pwd
import socket
import stat
from collections.abc import Iterable
from typing import Any

from store import StoreError
from store.format.private import make_private_dir

from .. import protocol
from ..errors import LmctlError, UsageError
from ..settings import check_id

log = logging.getLogger("lmctl.daemon")


class AlreadyServing(LmctlError):
    """Another daemon serves this socket or this store already."""


def refuse(conn: socket.socket, code: str, message: str) -> None:
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
    folder must be private (``store.format.private.check_folder``): no one else can put a link there
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


def inside(path: str, folder: str) -> bool:
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
    if inside(os.path.dirname(os.path.abspath(socket_path)), store_dir):
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


class SocketUnreachable(LmctlError):
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



"""Keeping a store private: folders only its owner can change, files opened without following
links, a store id that tells its folders apart, and salts kept only as keyed digests.

Every folder a store uses (the store's, the index's, each tier's, the daemon's socket's) is
checked at every open the way ssh checks ``authorized_keys``: each component of the path,
from the root down, symbolic links followed one by one, must belong to this process's
effective uid or to root and must not be writable by group or others. A shared folder
with the sticky bit (``/tmp``, ``/dev/shm``) is fine as a parent, never as the folder
itself. A folder that fails is refused with one line (``UnsafePath``) that says what is
wrong and what to do; nothing in it is read, changed or removed.

Files are opened with ``O_NOFOLLOW | O_CLOEXEC`` (a planted symbolic link is never
followed) and, where they may already exist, ``O_NONBLOCK`` (a planted FIFO never makes an
open hang), then checked with ``fstat``: a regular file with one link, of this uid or root,
not writable by others. The store's own files are made 0600 and its folders 0700 through
the descriptor that was checked, never by path, and only the files the store makes.

Cache salts (vLLM's per-request ``cache_salt``, which isolates tenants) are secrets: the
index keeps only an HMAC of each salt under a random key that lives in the index itself.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import logging
import os
import re
import secrets
import stat
from collections.abc import Iterable

from ..errors import StoreError

log = logging.getLogger("lmctl.store")

DIR_MODE = 0o700
FILE_MODE = 0o600
SALT_KEY_BYTES = 32
SALT_DIGEST_BYTES = 16
#: the marker file in a store's folder that names the store's id (see ``store_marker``)
STORE_MARKER = ".lmctl-store"
#: the marker file in each tier folder: which tier of which store it is
TIER_MARKER = ".lmctl-tier"
#: what the id looks like in a marker: ``... store <32 hex digits> ...``
_MARKED_ID = re.compile(rb"\bstore ([0-9a-f]{32})\b")
#: the most symbolic links a path may pass through (the kernel's limit)
MAX_LINKS = 40
#: files opened where they may already exist: a FIFO opens at once, a link is refused
SAFE_OPEN = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class UnsafePath(StoreError):
    """A folder or file of the store is not private to its owner (another user made it, may
    write in it, or planted a link there): refused, untouched."""


def salt_digest(key: bytes, salt: str) -> str:
    """Keyed digest (HMAC-SHA256, 128 bits, hex) of a cache salt under a store's salt key."""
    mac = hmac.new(key, b"lmctl/salt/v1\0" + salt.encode(), hashlib.sha256)
    return mac.digest()[:SALT_DIGEST_BYTES].hex()


def new_store_id() -> str:
    """A random store id (128 bits, hex)."""
    return secrets.token_hex(16)


def trusted(uid: int) -> bool:
    """Whether files of ``uid`` may be trusted: this process's own, or root's."""
    return uid in (os.geteuid(), 0)


def _owner_mode(st: os.stat_result) -> str:
    return f"owned by uid {st.st_uid} and mode {stat.S_IMODE(st.st_mode):04o}"


# -- folders ------------------------------------------------------------------------------
def folder_problem(path: str) -> tuple[str | None, bool]:
    """What is wrong with the folder ``path`` and every folder and link on the way to it
    (None: nothing), and whether it exists. Components that do not exist yet are not
    judged: whoever creates them is (``make_private_dir``)."""
    cur = "/"
    st = os.lstat(cur)
    if not trusted(st.st_uid) or (st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX):
        return f"is inside /, which is {_owner_mode(st)}", True
    todo = list(reversed([p for p in os.path.join(os.getcwd(), path).split(os.sep) if p]))
    links = 0
    while todo:
        name = todo.pop()
        if name == ".":
            continue
        if name == "..":
            cur = os.path.dirname(cur)
            continue
        nxt = os.path.join(cur, name)
        try:
            st = os.lstat(nxt)
        except FileNotFoundError:
            return None, False
        if stat.S_ISLNK(st.st_mode):
            # a link is as safe as its owner: the folder it sits in was checked already
            if not trusted(st.st_uid):
                return f"passes through {nxt}, a symbolic link owned by uid {st.st_uid}", True
            links += 1
            if links > MAX_LINKS:
                return f"passes through more than {MAX_LINKS} symbolic links", True
            target = os.readlink(nxt)
            if target.startswith(os.sep):
                cur = "/"
            todo.extend(reversed([p for p in target.split(os.sep) if p]))
            continue
        if not stat.S_ISDIR(st.st_mode):
            return f"passes through {nxt}, which is not a folder", True
        # a parent may be a shared folder with the sticky bit (/tmp): what is below it is
        # then judged on its own; the folder itself is judged after the walk
        if not trusted(st.st_uid) or (st.st_mode & 0o022 and not (st.st_mode & stat.S_ISVTX and todo)):
            return (f"is {_owner_mode(st)}" if not todo else f"is inside {nxt}, which is {_owner_mode(st)}"), True
        cur = nxt
    st = os.lstat(cur)
    if not trusted(st.st_uid) or st.st_mode & 0o022:  # the folder itself (reached by "..")
        return f"is {_owner_mode(st)}", True
    return None, True


def check_folder(path: str, what: str, advice: str = "remove it or choose another path") -> bool:
    """Refuse (``UnsafePath``) the folder ``path`` unless it and the way to it are private
    (see ``folder_problem``); whether it exists. ``what`` names it in the message
    ("dram folder"), ``advice`` says what to do."""
    problem, exists = folder_problem(path)
    if problem is not None:
        try:
            st = os.stat(path)
            mine = st.st_uid == os.geteuid() and problem == f"is {_owner_mode(st)}"
        except OSError:
            mine = False
        if mine:  # the user's own folder, only too open: it may be made private again
            advice = f"if no one else wrote in it, make it private (chmod 0700 {path}); else {advice}"
        raise UnsafePath(f"{what} {path} {problem}; {advice}")
    return exists


def make_private_dir(path: str, what: str = "folder", advice: str = "remove it or choose another path",
                     mode: int = DIR_MODE) -> bool:
    """Check ``path`` (``check_folder``), create what is missing of it, check it again;
    True if the folder itself was created.

    The folder is born ``mode`` (0700; ``mkdir`` masks the mode with the umask, which can
    only remove bits) and then set to exactly that. Missing parents are born 0755, never writable by
    others whatever the umask, and 0700 right under a shared folder (``/dev/shm/lmctl-UID``
    is private to its user). An existing folder's mode is left as it is."""
    if check_folder(path, what, advice):
        return False
    full = os.path.abspath(path)
    missing = []
    p = full
    while not os.path.lexists(p):
        missing.append(p)
        p = os.path.dirname(p)
    created = False
    for d in reversed(missing):
        parent = os.lstat(os.path.dirname(d))
        shared = bool(parent.st_mode & stat.S_ISVTX and parent.st_mode & 0o002)
        last = d == full
        try:
            os.mkdir(d, mode if last else DIR_MODE if shared else 0o755)
        except FileExistsError:
            continue  # made meanwhile (by whom: the check below tells)
        if last:
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.fchmod(fd, mode)
            finally:
                os.close(fd)
            created = True
    if not check_folder(path, what, advice):
        raise UnsafePath(f"{what} {path} cannot be made: a symbolic link on the way to it points nowhere; {advice}")
    return created


# -- files ----------------------------------------------------------------------------------
def file_problem(st: os.stat_result, written: bool = True) -> str | None:
    """What makes the file ``st`` describes untrustworthy (None: nothing). A file the store
    writes or cuts (``written``) must also have no other name: a hard link to another file
    would pass the change on to it."""
    if not stat.S_ISREG(st.st_mode):
        kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a folder" if stat.S_ISDIR(st.st_mode)
                else "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file")
        return f"is {kind}"
    if not trusted(st.st_uid) or st.st_mode & 0o022:
        return f"is {_owner_mode(st)}"
    if written and st.st_nlink != 1:
        return f"has {st.st_nlink} links (another name for another file?)"
    return None


def check_file(path: str, what: str, advice: str = "remove it", *, written: bool = True) -> bool:
    """Refuse (``UnsafePath``) the file ``path`` unless it is a regular file of this uid or
    root that others cannot write (a missing one is fine); whether it exists."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    problem = file_problem(st, written)
    if problem is not None:
        raise UnsafePath(f"{what} {path} {problem}; {advice}")
    return True


def open_file(path: str, flags: int, what: str, mode: int = FILE_MODE, advice: str = "remove it", *,
              written: bool = True) -> int:
    """``os.open`` without following a link and without blocking on a FIFO, then checked
    (``file_problem``): the descriptor of a file the store may trust, else ``UnsafePath``
    (``FileNotFoundError`` as ``os.open`` raises it). A file this call creates is made
    exactly ``mode``; an existing one of this uid is tightened to it through the descriptor."""
    try:
        fd = os.open(path, flags | SAFE_OPEN, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # the name is a symbolic link
            raise UnsafePath(f"{what} {path} is a symbolic link; {advice}") from None
        if exc.errno == errno.ENXIO and flags & os.O_ACCMODE == os.O_WRONLY:  # a FIFO with no reader
            raise UnsafePath(f"{what} {path} is a FIFO; {advice}") from None
        raise
    try:
        st = os.fstat(fd)
        problem = file_problem(st, written)
        if problem is not None:
            raise UnsafePath(f"{what} {path} {problem}; {advice}")
        if written and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != mode:
            os.fchmod(fd, mode)
        os.set_blocking(fd, True)  # reads and writes of the file itself behave as usual
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_marker(path: str) -> bytes | None:
    """The first 4 KiB of a marker file (None: there is none), refused if it is not a file
    the store may trust."""
    try:
        fd = open_file(path, os.O_RDONLY, "marker file", written=False)
    except FileNotFoundError:
        return None
    try:
        return os.read(fd, 4096)
    finally:
        os.close(fd)


def marked_id(text: bytes | None) -> str | None:
    """The store id a marker names (None: none, as in markers of earlier versions)."""
    m = _MARKED_ID.search(text or b"")
    return m.group(1).decode() if m else None


def write_marker(path: str, text: str) -> None:
    """Write a marker file anew (beside it, then renamed over it: never through a link)."""
    tmp = f"{path}.{secrets.token_hex(4)}.new"
    fd = open_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, "marker file")
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    os.rename(tmp, path)


# -- making a store private ----------------------------------------------------------------
def _tighten_one(path: str, folder: bool, fixed: list[tuple[str, int]]) -> None:
    """Make one of the store's own files 0600 (a folder 0700), through a descriptor opened
    without following links; anything else (another user's, a link, a FIFO) is left alone."""
    want = DIR_MODE if folder else FILE_MODE
    flags = os.O_RDONLY | (os.O_DIRECTORY if folder else 0)
    try:
        fd = os.open(path, flags | SAFE_OPEN)
    except OSError:
        return  # gone meanwhile, a link, or unreadable: not for this to change
    try:
        st = os.fstat(fd)
        ok = stat.S_ISDIR(st.st_mode) if folder else (stat.S_ISREG(st.st_mode) and st.st_nlink == 1)
        if not ok or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) == want:
            return
        os.fchmod(fd, want)
        fixed.append((path, stat.S_IMODE(st.st_mode)))
    except OSError as exc:
        log.warning("cannot make %s private: %s", path, exc)
    finally:
        os.close(fd)


#: the store's own files and folders in its folder (tier folders and segments come apart)
STORE_FILES = ("index/data.mdb", "index/lock.mdb", "meta.journal", "daemon.lock", "lmctl.sock.lock", STORE_MARKER)


def tighten(root: str, tier_dirs: Iterable[str] = ()) -> list[tuple[str, int]]:
    """Make the store at ``root`` private: its folders 0700, its files 0600.

    Only what the store makes is changed: its folder, the index and its files, the journal,
    the daemon's lock files and markers, each tier folder with its marker and segment files;
    and only what this process's user owns (root opening another user's store changes
    nothing). Returns the paths changed, with their old modes; the caller logs them once."""
    fixed: list[tuple[str, int]] = []
    _tighten_one(root, True, fixed)
    _tighten_one(os.path.join(root, "index"), True, fixed)
    for name in STORE_FILES:
        _tighten_one(os.path.join(root, name), False, fixed)
    for d in tier_dirs:
        _tighten_one(d, True, fixed)
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            if name == TIER_MARKER or (name.startswith("seg-") and name.endswith(".lseg")):
                _tighten_one(os.path.join(d, name), False, fixed)
    return fixed


#: filesystems that keep their files in memory: where a tier called dram belongs
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")


def filesystem_type(path: str) -> str | None:
    """The type of the filesystem ``path`` (or its nearest existing parent) is on, from
    /proc/self/mountinfo (``tmpfs``, ``ext4``, ...); None where that cannot be read."""
    p = os.path.realpath(path)
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    best, kind = "", None
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        mnt = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
        inside = p == mnt or p.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best):
            best, kind = mnt, right.split()[0]
    return kind

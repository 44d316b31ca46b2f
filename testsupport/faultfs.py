"""A FUSE passthrough file system for fault injection: EIO on chosen reads, and power cuts.

    with FaultFS(backing, mountpoint) as fs:      # mounts in a subprocess of its own
        ...                                       # use files under mountpoint
        fs.fail_reads("nvme/seg-1.lseg", 0, 4096) # reads overlapping that range fail with EIO
        fs.fail_reads()                           # every read fails
        fs.clear_faults()
        fs.power_cut()                            # drop what was never synced, and unmount
    # backing now holds what a disk would hold after that power loss

Everything below the mount point is passed through to ``backing``, except:

* **Reads** that match a rule of ``fail_reads`` (a path relative to the mount point, or every
  file; a byte range; optionally only the first ``times`` matching reads) fail with EIO.
  Files are opened ``direct_io`` (no page cache, so every read reaches the file system and a
  rule always applies) except those named by ``cached`` (default ``*.mdb``: LMDB maps its
  files, and a mapping needs the page cache). A read of a cached file that the page cache
  answers never sees a rule, and a page fault on a mapped file that fails is a SIGBUS in the
  process that mapped it, as on a real disk.
* **Power cuts.** Writes (and truncations) to a file are kept in memory, in order, and reach
  the backing file only when that file is fsync'ed or fdatasync'ed; reads see them meanwhile.
  Namespace changes (create, mkdir, unlink, rmdir, rename, symlink, mknod, chmod, chown) reach
  the backing folder at once but are logged, and the log is committed by the next fsync,
  fdatasync or fsyncdir of anything on the file system: the model of a journalling file system
  such as ext4 (``data=ordered``) or XFS, whose journal commits every earlier metadata change
  in order at any fsync. (A fsync of a new file therefore makes its name durable too; a store
  that also needs POSIX's stricter rule, a fsync of the parent folder, is not tested by this.)
  ``power_cut()`` makes every later call on the mount fail with EIO, undoes the uncommitted
  namespace changes (newest first: an unlinked file comes back, a created one goes), drops the
  unsynced writes, and unmounts. ``power_cut(keep=p, seed=s)`` instead lets each unsynced
  write reach the disk with probability ``p`` (still in order per file, but not across files)
  and keeps a random prefix of the uncommitted namespace changes: a disk that wrote some of
  its cache before the power went. Writes are never torn within one ``write`` call, and
  file times are not modelled.

A process that still uses the mount at a cut sees EIO (and SIGBUS on mapped pages it had not
touched); stop such processes (``kill -9``, as the power cut would) before ``power_cut()``, or
just after it. Hard links are refused (EPERM); extended attributes are not supported.

``FaultFS`` unmounts at ``__exit__`` whatever happened (with ``umount -l``, or ``fusermount
-uz`` where not root); leaving the block without a cut syncs everything first, as a clean
unmount does. ``skip_reason()`` says why FUSE cannot be used here (no ``/dev/fuse``, no
libfuse2 or fusepy, not root and no ``fusermount``); None when it can.

Run as a script (``python faultfs.py serve BACKING MOUNTPOINT CONTROL_SOCKET``) it is the file
system itself; ``FaultFS`` starts it that way and talks to it over the Unix socket.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: a hidden folder of the backing folder that holds unlinked files until their unlink is committed
TRASH = ".faultfs-trash"


def skip_reason() -> str | None:
    """Why FUSE cannot be used on this machine (None: it can)."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse (FUSE is not available here)"
    try:
        import fuse  # noqa: F401  (fusepy)
    except (ImportError, OSError) as exc:  # fusepy raises OSError without libfuse2
        return f"FUSE needs libfuse2 and fusepy (apt-get install libfuse2; pip install fusepy): {exc}"
    if os.geteuid() != 0 and shutil.which("fusermount") is None:
        return "mounting FUSE needs root or fusermount"
    return None


# -- the file system (runs in its own process) ------------------------------------------------
class _Node:
    """A regular file that is open or has unsynced writes: the backing fd and its pending ops."""

    def __init__(self, rel: str, fd: int, size: int) -> None:
        self.rel = rel
        self.fd = fd  # O_RDWR on the backing file (the daemon runs as root)
        self.size = size  # the size readers see (the pending ops applied)
        self.ops: list[tuple[str, int, bytes]] = []  # ("w", offset, data) | ("t", length, b"")
        self.handles = 0
        self.linked = True

    def view(self, offset: int, size: int) -> bytes:
        end = min(offset + size, self.size)
        if end <= offset:
            return b""
        buf = bytearray(os.pread(self.fd, end - offset, offset).ljust(end - offset, b"\0"))
        for kind, at, data in self.ops:
            if kind == "t":
                if at < end:
                    cut = max(at, offset) - offset
                    buf[cut:] = bytes(len(buf) - cut)
            else:
                lo, hi = max(at, offset), min(at + len(data), end)
                if lo < hi:
                    buf[lo - offset : hi - offset] = data[lo - at : hi - at]
        return bytes(buf)

    def apply(self, ops: list[tuple[str, int, bytes]] | None = None) -> None:
        for kind, at, data in self.ops if ops is None else ops:
            if kind == "t":
                os.ftruncate(self.fd, at)
            else:
                os.pwrite(self.fd, data, at)
        self.ops = []


def _serve(backing: str, mountpoint: str, control: str) -> None:
    from fuse import FUSE, FuseOSError, Operations, fuse_get_context

    os.umask(0)  # the modes the kernel hands over already carry the caller's umask
    root = os.path.realpath(backing)
    trash = os.path.join(root, TRASH)
    lock = threading.RLock()
    nodes: dict[str, _Node] = {}  # by path relative to the mount (leading "/")
    handles: dict[int, _Node] = {}
    undo: list[Callable[[], None]] = []  # uncommitted namespace changes, oldest first
    rules: list[dict[str, Any]] = []
    state: dict[str, Any] = {"frozen": False, "read_errors": 0, "syncs": 0, "mounted": False, "next": 0,
                             "trash": 0}

    def real(path: str) -> str:
        return root + path

    def fail(code: int = errno.EIO) -> FuseOSError:
        return FuseOSError(code)

    def live() -> None:
        if state["frozen"]:
            raise fail()

    def to_trash(path: str) -> str:
        os.makedirs(trash, exist_ok=True)
        state["trash"] += 1
        dst = os.path.join(trash, str(state["trash"]))
        os.rename(path, dst)
        return dst

    def commit() -> None:
        """A journal commit: every earlier namespace change is durable."""
        undo.clear()
        shutil.rmtree(trash, ignore_errors=True)

    def owned(path: str) -> None:
        uid, gid, _pid = fuse_get_context()
        os.lchown(path, uid, gid)

    def make(path: str, create: Callable[[str], None], remove: Callable[[str], None]) -> None:
        """A new name, owned by the caller, whose creation a cut undoes unless committed."""
        with lock:
            live()
            p = real(path)
            create(p)
            owned(p)
            undo.append(lambda: remove(p))

    def node_of(path: str, fi: Any = None) -> _Node | None:
        if fi is not None and fi.fh in handles:
            return handles[fi.fh]
        return nodes.get(path)

    def open_node(path: str) -> _Node:
        n = nodes.get(path)
        if n is None:
            fd = os.open(real(path), os.O_RDWR | os.O_NOFOLLOW)
            n = _Node(path, fd, os.fstat(fd).st_size)
            nodes[path] = n
        return n

    def release_node(n: _Node) -> None:
        if n.handles == 0 and (not n.ops or not n.linked):
            if nodes.get(n.rel) is n:
                del nodes[n.rel]
            os.close(n.fd)

    def handle(n: _Node, fi: Any) -> int:
        state["next"] += 1
        handles[state["next"]] = n
        n.handles += 1
        fi.fh = state["next"]
        name = os.path.basename(n.rel)
        fi.direct_io = 0 if any(fnmatch.fnmatch(name, g) for g in cached) else 1
        return 0

    cached: list[str] = json.loads(os.environ.get("FAULTFS_CACHED", '["*.mdb"]'))

    class Ops(Operations):  # type: ignore[misc]
        use_ns = True

        def init(self, path: str) -> None:
            state["mounted"] = True

        def getattr(self, path: str, fi: Any = None) -> dict[str, Any]:
            with lock:
                if path == "/" + TRASH:
                    raise fail(errno.ENOENT)
                try:
                    st = os.lstat(real(path))
                except OSError as exc:
                    raise fail(exc.errno or errno.EIO) from None
                out = {k: getattr(st, k) for k in ("st_mode", "st_ino", "st_nlink", "st_uid", "st_gid", "st_size",
                                                    "st_atime_ns", "st_mtime_ns", "st_ctime_ns", "st_blocks")}
                out["st_atime"], out["st_mtime"], out["st_ctime"] = out.pop("st_atime_ns"), out.pop(
                    "st_mtime_ns"), out.pop("st_ctime_ns")
                n = node_of(path, fi)
                if n is not None and stat.S_ISREG(st.st_mode):
                    out["st_size"] = n.size
                return out

        def readdir(self, path: str, fh: int) -> list[str]:
            with lock:
                live()
                names = os.listdir(real(path))
                return [".", ".."] + [x for x in names if not (path == "/" and x == TRASH)]

        def readlink(self, path: str) -> str:
            return os.readlink(real(path))

        def statfs(self, path: str) -> dict[str, Any]:
            sv = os.statvfs(real(path))
            return {k: getattr(sv, k) for k in ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail",
                                                "f_ffree", "f_files", "f_flag", "f_frsize", "f_namemax")}

        def chmod(self, path: str, mode: int) -> None:
            with lock:
                live()
                p = real(path)
                old = stat.S_IMODE(os.lstat(p).st_mode)
                os.chmod(p, mode)
                undo.append(lambda: os.chmod(p, old))

        def chown(self, path: str, uid: int, gid: int) -> None:
            with lock:
                live()
                p = real(path)
                st = os.lstat(p)
                os.lchown(p, uid, gid)
                undo.append(lambda: os.lchown(p, st.st_uid, st.st_gid))

        def utimens(self, path: str, times: Any = None) -> None:
            with lock:
                live()
                if times:
                    os.utime(real(path), ns=times, follow_symlinks=False)
                else:
                    os.utime(real(path), follow_symlinks=False)

        def mkdir(self, path: str, mode: int) -> None:
            make(path, lambda p: os.mkdir(p, mode), os.rmdir)

        def rmdir(self, path: str) -> None:
            with lock:
                live()
                p = real(path)
                if os.listdir(p):
                    raise fail(errno.ENOTEMPTY)
                kept = to_trash(p)
                undo.append(lambda: os.rename(kept, p))

        def mknod(self, path: str, mode: int, dev: int) -> None:
            make(path, lambda p: os.mknod(p, mode, dev), os.unlink)

        def symlink(self, target: str, source: str) -> None:
            make(target, lambda p: os.symlink(source, p), os.unlink)

        def link(self, target: str, source: str) -> None:
            raise fail(errno.EPERM)

        def unlink(self, path: str) -> None:
            with lock:
                live()
                p = real(path)
                kept = to_trash(p)
                undo.append(lambda: os.rename(kept, p))
                n = nodes.pop(path, None)
                if n is not None:
                    n.linked = False
                    release_node(n)

        def rename(self, old: str, new: str) -> None:
            with lock:
                live()
                po, pn = real(old), real(new)
                if os.path.isdir(pn) and not os.path.islink(pn) and os.listdir(pn):
                    raise fail(errno.ENOTEMPTY)
                replaced = to_trash(pn) if os.path.lexists(pn) else None
                try:
                    os.rename(po, pn)
                except OSError:
                    if replaced is not None:
                        os.rename(replaced, pn)
                    raise

                def back() -> None:
                    os.rename(pn, po)
                    if replaced is not None:
                        os.rename(replaced, pn)

                undo.append(back)
                gone = nodes.pop(new, None)
                if gone is not None:
                    gone.linked = False
                    release_node(gone)
                moved = {k: v for k, v in nodes.items() if k == old or k.startswith(old + "/")}
                for k, v in moved.items():
                    del nodes[k]
                    v.rel = new + k[len(old):]
                    nodes[v.rel] = v

        def create(self, path: str, mode: int, fi: Any) -> int:
            with lock:
                live()
                p = real(path)
                existed = os.path.lexists(p)
                fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | (fi.flags & os.O_EXCL), mode)
                if not existed:
                    owned(p)
                    undo.append(lambda: os.unlink(p))
                os.close(fd)
                n = open_node(path)
                if fi.flags & os.O_TRUNC and n.size:
                    n.ops.append(("t", 0, b""))
                    n.size = 0
                return handle(n, fi)

        def open(self, path: str, fi: Any) -> int:
            with lock:
                live()
                st = os.lstat(real(path))
                if not stat.S_ISREG(st.st_mode):
                    raise fail(errno.ENXIO)  # FIFOs and devices are not passed through
                n = open_node(path)
                if fi.flags & os.O_TRUNC and n.size:
                    n.ops.append(("t", 0, b""))
                    n.size = 0
                return handle(n, fi)

        def read(self, path: str, size: int, offset: int, fi: Any) -> bytes:
            with lock:
                live()
                n = node_of(path, fi)
                if n is None:
                    raise fail(errno.EBADF)
                for r in rules:
                    if r["path"] not in (None, n.rel):
                        continue
                    if offset >= (r["end"] if r["end"] is not None else offset + size + 1) or \
                            offset + size <= r["start"]:
                        continue
                    if r["times"] is not None:
                        if r["times"] <= 0:
                            continue
                        r["times"] -= 1
                    state["read_errors"] += 1
                    raise fail()
                return n.view(offset, size)

        def write(self, path: str, data: bytes, offset: int, fi: Any) -> int:
            with lock:
                live()
                n = node_of(path, fi)
                if n is None:
                    raise fail(errno.EBADF)
                n.ops.append(("w", offset, bytes(data)))
                n.size = max(n.size, offset + len(data))
                return len(data)

        def truncate(self, path: str, length: int, fi: Any = None) -> None:
            with lock:
                live()
                n = node_of(path, fi) or open_node(path)
                n.ops.append(("t", length, b""))
                n.size = length
                release_node(n)

        def fsync(self, path: str, datasync: int, fi: Any) -> None:
            with lock:
                live()
                n = node_of(path, fi)
                commit()
                if n is not None:
                    n.apply()
                state["syncs"] += 1

        def fsyncdir(self, path: str, datasync: int, fh: int) -> None:
            with lock:
                live()
                commit()
                state["syncs"] += 1

        def flush(self, path: str, fi: Any) -> None:
            return None

        def release(self, path: str, fi: Any) -> None:
            with lock:
                n = handles.pop(fi.fh, None)
                if n is not None:
                    n.handles -= 1
                    release_node(n)

    def cut(keep: float, seed: int | None) -> dict[str, Any]:
        rng = random.Random(seed)
        with lock:
            state["frozen"] = True
            dropped = 0
            for n in list(nodes.values()) + list(handles.values()):
                if not n.ops:
                    continue
                kept = [op for op in n.ops if keep > 0 and rng.random() < keep]
                dropped += len(n.ops) - len(kept)
                try:
                    n.apply(kept)
                except OSError:
                    pass
            keep_meta = rng.randint(0, len(undo)) if keep > 0 else 0
            undone = 0
            for fn in reversed(undo[keep_meta:]):
                try:
                    fn()
                    undone += 1
                except OSError:
                    pass  # e.g. a folder made non-empty by a change that was kept
            undo.clear()
            shutil.rmtree(trash, ignore_errors=True)
            return {"dropped_writes": dropped, "undone": undone}

    def sync_all() -> dict[str, Any]:
        with lock:
            for n in list(nodes.values()) + list(handles.values()):
                if n.ops:
                    n.apply()
            commit()
            return {}

    def control_loop(srv: socket.socket) -> None:
        while True:
            conn, _ = srv.accept()
            with conn:
                f = conn.makefile("rwb")
                line = f.readline()
                if not line:
                    continue
                req = json.loads(line)
                cmd = req.pop("cmd")
                try:
                    if cmd == "ping":
                        out: dict[str, Any] = {"mounted": state["mounted"]}
                    elif cmd == "fail_reads":
                        with lock:
                            rules.append({"path": req.get("path"), "start": int(req.get("start", 0)),
                                          "end": req.get("end"), "times": req.get("times")})
                        out = {}
                    elif cmd == "clear":
                        with lock:
                            rules.clear()
                        out = {}
                    elif cmd == "stats":
                        with lock:
                            out = {"read_errors": state["read_errors"], "syncs": state["syncs"],
                                   "pending_writes": sum(len(n.ops) for n in nodes.values()),
                                   "uncommitted": len(undo), "frozen": state["frozen"]}
                    elif cmd == "cut":
                        out = cut(float(req.get("keep", 0.0)), req.get("seed"))
                    elif cmd == "sync_all":
                        out = sync_all()
                    else:
                        out = {"error": f"unknown command {cmd!r}"}
                except Exception as exc:  # the reply says what failed; the file system carries on
                    out = {"error": f"{type(exc).__name__}: {exc}"}
                f.write(json.dumps(out).encode() + b"\n")
                f.flush()

    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(control)
    srv.listen(8)
    threading.Thread(target=control_loop, args=(srv,), daemon=True).start()
    os.makedirs(trash, exist_ok=True)
    shutil.rmtree(trash, ignore_errors=True)
    opts: dict[str, Any] = {"foreground": True, "nothreads": False, "raw_fi": True, "use_ino": True,
                            "default_permissions": True, "hard_remove": True, "fsname": "faultfs"}
    if os.geteuid() == 0:
        opts["allow_other"] = True
    FUSE(Ops(), mountpoint, **opts)


# -- the test side ------------------------------------------------------------------------------
class FaultFS:
    """A FUSE mount of ``backing`` at ``mountpoint`` with faults controlled at run time (see the
    module's docstring). ``cached``: file name patterns whose reads may be served by the page
    cache (files that are mapped into memory need it)."""

    def __init__(self, backing: str | os.PathLike[str], mountpoint: str | os.PathLike[str], *,
                 cached: tuple[str, ...] = ("*.mdb",), timeout: float = 20.0) -> None:
        self.backing = Path(backing)
        self.mountpoint = Path(mountpoint)
        self.cached = cached
        self.timeout = timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: str | None = None
        self._cut = False

    # lifecycle
    def __enter__(self) -> FaultFS:
        reason = skip_reason()
        if reason is not None:
            raise RuntimeError(reason)
        self.backing.mkdir(parents=True, exist_ok=True)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        self._dir = tempfile.mkdtemp(prefix="faultfs-")
        self._sock = os.path.join(self._dir, "control")
        log = open(os.path.join(self._dir, "log"), "wb")  # noqa: SIM115 - the child keeps it
        env = {**os.environ, "FAULTFS_CACHED": json.dumps(list(self.cached))}
        self._proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve", str(self.backing),
                                       str(self.mountpoint), self._sock], stdout=log, stderr=log, env=env,
                                      start_new_session=True)
        log.close()
        end = time.monotonic() + self.timeout
        try:
            while True:
                if self._proc.poll() is not None:
                    raise RuntimeError(f"the FUSE file system exited ({self._proc.returncode}): {self.log()[-800:]}")
                if os.path.exists(self._sock) and os.path.ismount(self.mountpoint):
                    try:
                        if self._call("ping").get("mounted"):
                            return self
                    except OSError:
                        pass
                if time.monotonic() > end:
                    raise RuntimeError(f"the FUSE file system did not mount within {self.timeout} s: "
                                       f"{self.log()[-800:]}")
                time.sleep(0.02)
        except BaseException:
            self.unmount()
            raise

    def __exit__(self, *exc: object) -> None:
        if not self._cut and self._proc is not None and self._proc.poll() is None:
            try:
                self._call("sync_all")  # a clean unmount writes everything
            except OSError:
                pass
        self.unmount()

    def log(self) -> str:
        if self._dir is None:
            return ""
        try:
            return Path(self._dir, "log").read_text(errors="replace")
        except OSError:
            return ""

    def _call(self, cmd: str, **args: Any) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(self.timeout)
            s.connect(self._sock)
            s.sendall(json.dumps({"cmd": cmd, **args}).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                got = s.recv(65536)
                if not got:
                    break
                data += got
        out: dict[str, Any] = json.loads(data or b"{}")
        if "error" in out:
            raise RuntimeError(f"faultfs {cmd}: {out['error']}")
        return out

    def _rel(self, path: str | os.PathLike[str]) -> str:
        p = Path(path)
        if p.is_absolute():
            p = p.relative_to(self.mountpoint)
        return "/" + str(p).strip("/")

    # faults
    def fail_reads(self, path: str | os.PathLike[str] | None = None, start: int = 0, end: int | None = None,
                   times: int | None = None) -> None:
        """Make reads of ``path`` (relative to the mount point, or absolute under it; None:
        every file) that overlap bytes [``start``, ``end``) fail with EIO; only the first
        ``times`` such reads when given (a transient error)."""
        self._call("fail_reads", path=None if path is None else self._rel(path), start=start, end=end, times=times)

    def clear_faults(self) -> None:
        """Reads succeed again."""
        self._call("clear")

    def read_errors(self) -> int:
        """How many reads failed with EIO so far."""
        return int(self._call("stats")["read_errors"])

    def stats(self) -> dict[str, Any]:
        """``read_errors``, ``syncs``, ``pending_writes`` (unsynced), ``uncommitted`` namespace
        changes, ``frozen``."""
        return self._call("stats")

    def power_cut(self, keep: float = 0.0, seed: int | None = None) -> dict[str, Any]:
        """Lose power: every later call on the mount fails, what was not synced is dropped
        (``keep``: the chance that each unsynced write reached the disk anyway), and the file
        system is unmounted. Returns ``dropped_writes`` and ``undone`` (namespace changes)."""
        out = self._call("cut", keep=keep, seed=seed)
        self._cut = True
        self.unmount()
        return out

    def unmount(self) -> None:
        """Unmount (lazily: a process still using the mount keeps only EIO) and stop the file
        system's process. Safe to call more than once."""
        proc = self._proc
        if proc is not None and proc.poll() is None or os.path.ismount(self.mountpoint):
            if os.geteuid() == 0:
                cmd = ["umount", "-l", str(self.mountpoint)]
            else:
                cmd = ["fusermount", "-u", "-z", str(self.mountpoint)]
            subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        if proc is not None:
            try:
                proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=self.timeout)
            self._proc = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[1] != "serve":
        sys.exit("usage: faultfs.py serve BACKING MOUNTPOINT CONTROL_SOCKET")
    _serve(sys.argv[2], sys.argv[3], sys.argv[4])

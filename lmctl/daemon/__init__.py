"""``lmctl serve``: the cache-manager daemon on a local Unix socket.

One thread per client connection over one shared ``Store`` (thread-safe); a maintenance
thread that keeps tiers under their high watermark and compacts dead space; clean exit on
SIGTERM/SIGINT. The socket is mode 0600 and peers of another uid are refused (peer
credentials, read as the connection is accepted: a refused peer gets one reply and is hung
up on, never taking a client slot, a thread or a wait), unless allowed with
``--allow-uid``; such a uid must also be able to reach
the socket (``--socket`` outside the private store folder, ``--socket-mode``,
``--socket-group``), which ``serve`` checks before it starts.

The daemon's jobs, a module each: ``access`` (the socket, peers, what a read-only peer may
ask), ``folders`` (locks, the store folder, ``--init``, opening the store), ``jobs`` (a
running request), ``server`` (the accept loop, clients, dispatch, maintenance).
"""

from .access import AlreadyServing, SocketUnreachable, bind_socket, changes_the_store, check_socket_path, socket_access
from .folders import NoStore
from .jobs import DaemonState, RunningJob
from .server import MAX_CLIENTS, Daemon, sd_notify

__all__ = ["MAX_CLIENTS", "AlreadyServing", "Daemon", "DaemonState", "NoStore", "RunningJob", "SocketUnreachable",
           "bind_socket", "changes_the_store", "check_socket_path", "sd_notify", "socket_access"]

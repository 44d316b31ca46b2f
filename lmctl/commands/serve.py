"""``lmctl serve``: the daemon in the foreground, its options and config file made into settings."""

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

import typer

from ..terminal import CommandError, ExitStatus, Terminal


@contextmanager
def _daemon_errors() -> Iterator[None]:
    """The daemon's errors as the CLI's: a ``UsageError`` is a usage error, any other
    ``StoreError`` a failure."""
    from store import StoreError

    from ..errors import LmctlError, UsageError

    try:
        yield
    except UsageError as exc:
        raise CommandError("usage", str(exc)) from None
    except (StoreError, LmctlError) as exc:
        raise CommandError("failed", str(exc)) from None


def serve(
    ctx: typer.Context,
    store: Annotated[str | None, typer.Option(envvar="LMCTL_STORE", help="store folder")] = None,
    init: Annotated[bool, typer.Option("--init", help="create the store if the folder holds none")] = False,
    config: Annotated[str | None, typer.Option(help="TOML config file ([daemon], [store], [tiers.NAME])")] = None,
    socket_path: Annotated[str | None, typer.Option(
        "--socket", help="socket path [default: STORE/lmctl.sock]")] = None,
    allow_uid: Annotated[list[int] | None, typer.Option(
        help="also accept clients of this uid; repeatable (the socket must be reachable: see --socket-mode)")] = None,
    allow_uid_ro: Annotated[list[int] | None, typer.Option(
        "--allow-uid-ro", help="also accept clients of this uid for reads only (status, ls, lookup, inspect, "
                               "events, verify, top, dry runs); repeatable")] = None,
    socket_mode: Annotated[str | None, typer.Option(
        help="the socket's mode, octal; 0660 with --socket-group shares it with a group [default: 0600]")] = None,
    socket_group: Annotated[str | None, typer.Option(help="the socket's group: a group name or gid")] = None,
    maintenance_interval: Annotated[float | None, typer.Option(
        help="seconds between background evict/compact runs [default: 30]")] = None,
    capacity: Annotated[list[str] | None, typer.Option(
        help="a tier's capacity, TIER=SIZE (or SIZE for the default tier); repeatable")] = None,
    tier_path: Annotated[list[str] | None, typer.Option(
        help="a tier's folder, TIER=PATH (e.g. dram=/dev/shm/lmctl-UID/main, a folder of yours); repeatable")] = None,
    pin_budget: Annotated[list[str] | None, typer.Option(
        help="a tier's pin budget, TIER=FRACTION or TIER=SIZE; repeatable")] = None,
    codec: Annotated[str | None, typer.Option(help="codec for new chunks: raw, zstd or zstd-shuffle")] = None,
    codec_level: Annotated[int | None, typer.Option(help="zstd level for new chunks, 1-19")] = None,
    remote: Annotated[str | None, typer.Option(
        metavar="URL", help="the shared remote tier: redis://HOST:PORT/DB, rediss://... or unix:///PATH")] = None,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", help="any store setting, KEY=VALUE (see lmctl config show); repeatable")] = None,
    log_level: Annotated[str | None, typer.Option(help="debug, info, warning or error [default: info]")] = None,
    metrics: Annotated[str | None, typer.Option(
        metavar="[ADDR:]PORT", help="serve Prometheus metrics over HTTP here (a bare port: loopback only)")] = None,
) -> None:
    """Run the daemon in the foreground (logs to stderr; SIGTERM or Ctrl-C stops it).

    \b
    Examples:
      lmctl serve --store /var/lib/lmctl --init --capacity nvme=500GiB
      lmctl serve --store /var/lib/lmctl --config /etc/lmctl.toml --metrics 9464
    """
    import logging

    from ..daemon import Daemon, socket_access
    from ..settings import check_id, serve_settings
    from ..settings import maintenance_interval as check_interval

    term = Terminal.of(ctx)

    def body() -> None:
        for flag, values in (("--capacity", capacity), ("--tier-path", tier_path), ("--pin-budget", pin_budget),
                             ("--set", set_)):
            _once_per_key(flag, values or [], "=" in (values or [""])[0] or flag != "--capacity")
        with _daemon_errors():
            daemon, changes = serve_settings(config, capacity=capacity, tier_path=tier_path, pin_budget=pin_budget,
                                             codec=codec, codec_level=codec_level, remote=remote, settings=set_)
            store_dir = store or daemon.get("store")
            if not store_dir:
                raise CommandError("usage", "give --store DIR (or $LMCTL_STORE, or store in the config file's "
                                            "[daemon])")
            # the socket: serve's --socket, else the global --socket / $LMCTL_SOCKET, else the file's
            sock = socket_path or (term.address if term.socket_given or os.environ.get("LMCTL_SOCKET") else None)
            sock = sock or daemon.get("socket")
            # --quiet: the daemon logs warnings and errors only, unless a level is given
            level = (log_level or daemon.get("log_level") or ("warning" if term.quiet else "info")).upper()
            if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
                raise CommandError("usage", f"--log-level must be debug, info, warning or error, not {level.lower()!r}")
            interval = check_interval(maintenance_interval if maintenance_interval is not None else daemon.get(
                "maintenance_interval", 30))
            uids = [check_id(u, "--allow-uid") for u in allow_uid or daemon.get("allow_uid") or []]
            ro_uids = [check_id(u, "--allow-uid-ro") for u in allow_uid_ro or daemon.get("allow_uid_ro") or []]
            both = sorted(set(uids) & set(ro_uids))
            if both:
                raise CommandError("usage", f"uid {both[0]} is given both full (--allow-uid) and read-only "
                                            "(--allow-uid-ro) access: give one")
            mode, gid = socket_access(socket_mode or daemon.get("socket_mode") or "0600",
                                      socket_group or daemon.get("socket_group"))
            logging.basicConfig(stream=term.err, level=getattr(logging, level),
                                format="%(asctime)s lmctl[%(process)d] %(levelname)s %(message)s")
            listen = metrics or daemon.get("metrics")
            clean = Daemon(store_dir, sock, uids, interval, socket_mode=mode, socket_group=gid, init=init,
                           settings=changes, metrics=None if listen is None else str(listen),
                           allow_ro_uids=ro_uids).serve()
        raise typer.Exit(ExitStatus.OK if clean else ExitStatus.ERROR)

    term.run(body)


def _once_per_key(flag: str, values: list[str], keyed: bool) -> None:
    """Each tier (or setting) once per repeatable KEY=VALUE option: given twice, the parser
    would keep the last without a word."""
    seen: dict[str, str] = {}
    for v in values:
        k = v.partition("=")[0].strip() if "=" in v else ""  # no key: the default tier
        if k in seen:
            what = f"names {'setting' if flag == '--set' else 'tier'} {k}" if k else "gives the default tier"
            raise CommandError("usage", f"{flag} {what} twice ({seen[k]}, {v}): give it once")
        seen[k] = v

"""``lmctl remote secret PATH``: a new deployment secret for the shared remote tier.

Made here, with no daemon and no store library: 32 random bytes from the operating system,
hex, in a file created with mode 0600 that must not exist yet (a secret is never
overwritten: every store that uses it would lose its shared chunks). store/format/remote_auth.py
reads it (``remote.secret_file``).
"""

from __future__ import annotations

import os
import secrets

from .terminal import CommandError

SECRET_BYTES = 32


def new_secret(path: str) -> str:
    """Write a new secret to ``path``; its absolute path. ``CommandError`` if the file
    exists (a link too) or cannot be made."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise CommandError("usage", f"{path} exists: lmctl never overwrites a secret (every store that uses it would "
                           "lose its shared chunks); give a new path, or remove that file first") from None
    except OSError as exc:
        raise CommandError("failed", f"cannot create {path}: {exc.strerror}") from None
    try:
        os.fchmod(fd, 0o600)  # exactly 0600, whatever the umask
        os.write(fd, (secrets.token_hex(SECRET_BYTES) + "\n").encode())
        os.fsync(fd)
    except OSError as exc:
        os.close(fd)
        os.unlink(path)
        raise CommandError("failed", f"cannot write {path}: {exc.strerror}") from None
    os.close(fd)
    return os.path.abspath(path)

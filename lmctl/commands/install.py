"""Commands that need no daemon: ``lmctl completion`` (shell completion scripts) and ``lmctl remote
secret`` (the remote tier's deployment secret)."""

import os
from typing import Annotated

import typer

from ..completion import complete_values
from ..terminal import Terminal

completion_app = typer.Typer(help="Shell completion scripts (bash, zsh, fish).", no_args_is_help=True)


@completion_app.command("show")
def completion_show(ctx: typer.Context, shell_name: Annotated[str, typer.Argument(
        metavar="SHELL", help="bash, zsh or fish", autocompletion=complete_values("SHELL"))]) -> None:
    """Print the completion script for a shell.

    \b
    Examples:
      lmctl completion show bash > /etc/bash_completion.d/lmctl
      source <(lmctl completion show bash)
    """
    from .. import completion

    term = Terminal.of(ctx).without_json()
    term.run(lambda: term.echo(completion.script(shell_name), end=""))


@completion_app.command("install")
def completion_install(ctx: typer.Context, shell_name: Annotated[str | None, typer.Option(
        "--shell", help="bash, zsh or fish [default: from $SHELL]", autocompletion=complete_values("--shell"))]
        = None) -> None:
    """Install the completion script where the shell finds it (in your home folder).

    \b
    Examples:
      lmctl completion install
      lmctl completion install --shell zsh
    """
    from .. import completion

    term = Terminal.of(ctx).without_json()

    def body() -> None:
        for line in completion.install(shell_name, os.path.expanduser("~"), os.environ.get("SHELL", "bash")):
            term.echo(line)

    term.run(body)


remote_app = typer.Typer(help="The shared remote tier (Redis): its deployment secret.", no_args_is_help=True)


@remote_app.command("secret")
def remote_secret(ctx: typer.Context, path: Annotated[str, typer.Argument(
        metavar="PATH", help="the file to create (it must not exist)")]) -> None:
    """Generate a deployment secret (32 random bytes, hex, a new file of mode 0600); no daemon needed.

    Give it to every store of the deployment as remote.secret_file (copy it to each host
    over a private channel).

    \b
    Examples:
      lmctl remote secret /etc/lmctl/remote.secret
      lmctl config set remote.secret_file=/etc/lmctl/remote.secret
    """
    from ..secret import SECRET_BYTES, new_secret

    term = Terminal.of(ctx)

    def body() -> None:
        r = {"path": new_secret(path), "bytes": SECRET_BYTES, "mode": "0600"}
        term.emit(r, lambda t, r: t.say(
            f"wrote a new remote secret to {path} (mode 0600); set remote.secret_file to it on every store that "
            "shares the tier"))

    term.run(body)

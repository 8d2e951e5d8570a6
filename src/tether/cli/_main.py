"""The ``tether`` command tree: each group's commands registered under its name."""

from __future__ import annotations

import typer

from .history import history_export_command, replay_command
from .keys import keys_create_command, keys_list_command, keys_revoke_command
from .queues import queues_command
from .runs import (
    cancel_command,
    get_command,
    resume_command,
    runs_command,
    signal_command,
    start_command,
    suspend_command,
    terminate_command,
)
from .serve import serve_command
from .store import store_migrate_command
from .testing import cassette_export_command, eval_command
from .worker import worker_command


def _build() -> typer.Typer:
    cli = typer.Typer(
        name="tether",
        help="Durable workflows: run workers, start runs, inspect and steer them.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_show_locals=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    cli.command("worker")(worker_command)
    cli.command("serve")(serve_command)
    cli.command("start")(start_command)
    cli.command("runs")(runs_command)
    cli.command("queues")(queues_command)
    cli.command("get")(get_command)
    cli.command("signal")(signal_command)
    cli.command("cancel")(cancel_command)
    cli.command("terminate")(terminate_command)
    cli.command("suspend")(suspend_command)
    cli.command("resume")(resume_command)
    cli.command("replay")(replay_command)
    history = typer.Typer(
        help="Inspect run histories.",
        no_args_is_help=True,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    history.command("export")(history_export_command)
    cli.add_typer(history, name="history")
    store = typer.Typer(
        help="Manage stores: copy runs between them.",
        no_args_is_help=True,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    store.command("migrate")(store_migrate_command)
    cli.add_typer(store, name="store")
    cli.command("eval")(eval_command)
    cassette = typer.Typer(
        help="Turn recorded runs into regression tests.",
        no_args_is_help=True,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    cassette.command("export")(cassette_export_command)
    cli.add_typer(cassette, name="cassette")
    keys = typer.Typer(
        help="API keys of the HTTP service (tether serve).",
        no_args_is_help=True,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    keys.command("create")(keys_create_command)
    keys.command("list")(keys_list_command)
    keys.command("revoke")(keys_revoke_command)
    cli.add_typer(keys, name="keys")
    return cli

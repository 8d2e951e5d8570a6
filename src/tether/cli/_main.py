"""The ``tether`` command tree: each group's commands registered under its name."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import typer

from .approvals import (
    approvals_decide_command,
    approvals_list_command,
    approvals_show_command,
)
from .dead_letters import (
    dead_letters_list_command,
    dead_letters_replay_command,
    dead_letters_resolve_command,
)
from .demo import demo_command
from .history import history_export_command, replay_command
from .keyring import (
    keyring_init_command,
    keyring_list_command,
    keyring_new_key_command,
    keyring_retire_command,
    keyring_rotate_command,
    keyring_shred_command,
    keyring_wrap_command,
)
from .keys import keys_create_command, keys_list_command, keys_revoke_command
from .lifecycle import (
    erase_tenant_command,
    purge_command,
    retention_list_command,
    retention_set_command,
    store_backup_command,
    store_check_command,
    store_gc_blobs_command,
    store_reseal_command,
    store_restore_command,
)
from .queues import queues_command
from .runs import (
    audit_command,
    cancel_command,
    complete_step_command,
    get_command,
    resume_command,
    retry_command,
    runs_command,
    signal_command,
    start_command,
    suspend_command,
    terminate_command,
)
from .schedules import (
    schedules_create_command,
    schedules_delete_command,
    schedules_list_command,
    schedules_pause_command,
    schedules_resume_command,
    schedules_trigger_command,
)
from .serve import serve_command
from .store import store_migrate_command
from .switches import switch_list_command, switch_off_command, switch_on_command
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
    _add(cli, "demo", demo_command)
    _add(cli, "worker", worker_command)
    _add(cli, "serve", serve_command)
    _add(cli, "start", start_command)
    _add(cli, "runs", runs_command)
    _add(cli, "queues", queues_command)
    _add(cli, "get", get_command)
    _add(cli, "signal", signal_command)
    _add(cli, "cancel", cancel_command)
    _add(cli, "terminate", terminate_command)
    _add(cli, "suspend", suspend_command)
    _add(cli, "resume", resume_command)
    _add(cli, "retry", retry_command)
    _add(cli, "complete-step", complete_step_command)
    _add(cli, "audit", audit_command)
    _add(cli, "replay", replay_command)
    _group(cli, "history", "Inspect run histories.", export=history_export_command)
    _group(
        cli,
        "store",
        "Manage stores: back up, restore, check, copy runs between them.",
        migrate=store_migrate_command,
        backup=store_backup_command,
        restore=store_restore_command,
        check=store_check_command,
        reseal=store_reseal_command,
        **{"gc-blobs": store_gc_blobs_command},
    )
    _add(cli, "purge", purge_command)
    _add(cli, "erase-tenant", erase_tenant_command)
    _add(cli, "eval", eval_command)
    _group(
        cli,
        "cassette",
        "Turn recorded runs into regression tests.",
        export=cassette_export_command,
    )
    _group(
        cli,
        "keys",
        "API keys of the HTTP service (tether serve).",
        create=keys_create_command,
        list=keys_list_command,
        revoke=keys_revoke_command,
    )
    _group(
        cli,
        "retention",
        "How long each tenant's ended runs are kept (workers purge older ones).",
        set=retention_set_command,
        list=retention_list_command,
    )
    _group(
        cli,
        "keyring",
        "Encryption keys that seal payloads at rest (TETHER_KEYRING).",
        init=keyring_init_command,
        list=keyring_list_command,
        rotate=keyring_rotate_command,
        retire=keyring_retire_command,
        shred=keyring_shred_command,
        wrap=keyring_wrap_command,
        **{"new-key": keyring_new_key_command},
    )
    _group(
        cli,
        "approvals",
        "Reviews opened by tether.approval: list, show, decide.",
        list=approvals_list_command,
        show=approvals_show_command,
        decide=approvals_decide_command,
    )
    _group(
        cli,
        "schedules",
        "Schedules that start runs on a cron or an interval, once per tick across workers.",
        list=schedules_list_command,
        create=schedules_create_command,
        pause=schedules_pause_command,
        resume=schedules_resume_command,
        trigger=schedules_trigger_command,
        delete=schedules_delete_command,
    )
    _group(
        cli,
        "switch",
        "Kill switches: stop a workflow, activity, model or tenant on every worker.",
        off=switch_off_command,
        on=switch_on_command,
        list=switch_list_command,
    )
    _group(
        cli,
        "dead-letters",
        "Steps and runs that exhausted their failure policy: list, replay, resolve.",
        list=dead_letters_list_command,
        replay=dead_letters_replay_command,
        resolve=dead_letters_resolve_command,
    )
    return cli


def _group(cli: typer.Typer, name: str, help: str, **commands: Callable[..., None]) -> None:
    """Add the command group ``tether <name>`` with ``commands`` (sub-command name: function)."""
    group = typer.Typer(
        help=help, no_args_is_help=True, context_settings={"help_option_names": ["-h", "--help"]}
    )
    for sub, fn in commands.items():
        _add(group, sub, fn)
    cli.add_typer(group, name=name)


def _add(cli: typer.Typer, name: str, fn: Callable[..., None]) -> None:
    """Register ``fn`` as ``name`` with its docstring as help, each paragraph one line:
    rich help keeps a paragraph's line breaks, which then fall mid-sentence."""
    doc = inspect.cleandoc(fn.__doc__ or "")
    cli.command(name, help="\n\n".join(" ".join(p.split()) for p in doc.split("\n\n")))(fn)

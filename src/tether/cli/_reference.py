"""The CLI reference page (``docs/cli.md``), generated from the commands themselves.

``python -m tether.cli._reference > docs/cli.md`` writes it; a test checks the page
is what this module makes, so the reference never drifts from the commands.
"""

from __future__ import annotations

from typing import Any

from typer.main import get_command

from ._main import _build


def markdown() -> str:
    """The whole reference, one section per command, in the CLI's order."""
    root = get_command(_build())
    lines = [
        "# CLI reference",
        "",
        "Every `tether` command, generated from the commands themselves "
        "(`python -m tether.cli._reference > docs/cli.md`). `tether COMMAND --help` prints "
        "the same.",
        "",
    ]
    for path, command in _walk(root, []):
        lines += _section(path, command)
    return "\n".join(lines).rstrip() + "\n"


def _walk(command: Any, path: list[str]) -> list[tuple[list[str], Any]]:
    """Every leaf command under ``command`` (typer's own click: duck-typed)."""
    if hasattr(command, "commands"):
        out: list[tuple[list[str], Any]] = []
        for name, sub in command.commands.items():
            out += _walk(sub, [*path, name])
        return out
    return [(path, command)]


def _section(path: list[str], command: Any) -> list[str]:
    name = "tether " + " ".join(path)
    args = " ".join(
        (p.metavar or p.name or "").upper()
        for p in command.params
        if p.param_type_name == "argument"
    )
    lines = [f"## `{name}`", "", (command.help or "").strip().split("\n\n")[0], ""]
    lines += ["```text", f"{name} [OPTIONS]{' ' + args if args else ''}", "```", ""]
    options = [p for p in command.params if p.param_type_name == "option" and not p.hidden]
    if options:
        lines += ["| option | what it does | default |", "| --- | --- | --- |"]
        for opt in options:
            flags = ", ".join(f"`{o}`" for o in (*opt.opts, *opt.secondary_opts))
            lines.append(f"| {flags} | {_cell(opt.help or '')} | {_default(opt)} |")
        lines.append("")
    return lines


def _default(opt: Any) -> str:
    value: Any = opt.default
    if value is None or value == () or (opt.is_flag and value is False):
        return ""
    return f"`{value}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


if __name__ == "__main__":
    print(markdown(), end="")

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
    arguments = [p for p in command.params if p.param_type_name == "argument"]
    usage = " ".join(["[OPTIONS]", *(_usage(a) for a in arguments)])
    lines = [f"## `{name}`", ""]
    for paragraph in (command.help or "").strip().split("\n\n"):  # all of it, as --help
        lines += [" ".join(paragraph.split()), ""]
    lines += ["```text", f"{name} {usage}", "```", ""]
    if arguments:
        lines += ["| argument | what it is | default |", "| --- | --- | --- |"]
        for arg in arguments:
            lines.append(f"| `{_metavar(arg)}` | {_cell(arg.help or '')} | {_needed(arg)} |")
        lines.append("")
    options = [p for p in command.params if p.param_type_name == "option" and not p.hidden]
    if options:
        lines += ["| option | what it does | default |", "| --- | --- | --- |"]
        for opt in options:
            flags = ", ".join(f"`{o}`" for o in (*opt.opts, *opt.secondary_opts))
            lines.append(f"| {flags} | {_cell(opt.help or '')} | {_default(opt)} |")
        lines.append("")
    return lines


def _metavar(arg: Any) -> str:
    return str(arg.metavar) if arg.metavar else str(arg.name or "").upper()


def _usage(arg: Any) -> str:
    """An argument as --help shows it: ``NAME``, ``[NAME]`` when optional, ``...``
    after one that takes any number."""
    text = _metavar(arg) if arg.required else f"[{_metavar(arg)}]"
    return text + ("..." if arg.nargs == -1 else "")


def _needed(arg: Any) -> str:
    """An argument's default column: required, optional, or its default."""
    if arg.required:
        return "required, one or more" if arg.nargs == -1 else "required"
    if arg.default is None or arg.default == () or arg.default == "":
        return "optional, any number" if arg.nargs == -1 else "optional"
    return f"`{arg.default}`"


def _default(opt: Any) -> str:
    value: Any = opt.default
    if value is None or value == () or value == "" or (opt.is_flag and value is False):
        return ""
    return f"`{value}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


if __name__ == "__main__":
    print(markdown(), end="")

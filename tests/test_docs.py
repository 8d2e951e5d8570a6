"""Every Python code block of the documentation runs, page by page, as written.

A page's blocks run in order in one namespace (a later block may use what an
earlier one defined), in a fresh process whose working directory is empty, so a
block that needs something must show it. Top-level ``await`` works, as in an
async REPL. Shell blocks are checked too: every ``tether`` command they use must
exist with the options they pass (its ``--help`` parses).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parent.parent
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)

RUNNER = r"""
import ast, asyncio, json, sys, traceback
blocks = json.loads(sys.stdin.read())
namespace = {"__name__": "__docs__"}
loop = asyncio.new_event_loop()
asyncio.set_event_loop(loop)
for i, (line, code) in enumerate(blocks):
    try:
        compiled = compile(code, f"block {i + 1} (line {line})", "exec",
                           flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
        result = eval(compiled, namespace)
        if asyncio.iscoroutine(result):
            loop.run_until_complete(result)
    except BaseException:
        print(f"BLOCK {i + 1} at line {line} FAILED:\n{code}", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
"""


def _blocks(page: Path, language: str) -> list[tuple[int, str]]:
    text = page.read_text()
    return [
        (text[: m.start()].count("\n") + 1, m.group(2))
        for m in FENCE.finditer(text)
        if m.group(1) == language
    ]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("page", [p for p in PAGES if _blocks(p, "python")], ids=lambda p: p.name)
def test_the_python_blocks_of_a_page_run(page: Path, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests" / "docs_run")]),
        "OPENAI_API_KEY": "sk-docs-not-a-real-key",
        "ANTHROPIC_API_KEY": "sk-ant-docs-not-a-real-key",
    }
    out = subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=json.dumps(_blocks(page, "python")),
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert out.returncode == 0, out.stderr[-4000:]


@pytest.mark.parametrize("page", [p for p in PAGES if _blocks(p, "python")], ids=lambda p: p.name)
def test_the_python_blocks_of_a_page_use_only_names_they_define(page: Path) -> None:
    """What running cannot see: a name used inside a function that no test called."""
    code = "\n\n".join(block for _line, block in _blocks(page, "python"))
    out = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--select", "F821",
         "--stdin-filename", f"{page.stem}.py", "-"],
        input=code,
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:]


def _tether_commands(page: Path) -> list[list[str]]:
    found = []
    shell = [b for lang in ("bash", "sh", "shell") for b in _blocks(page, lang)]
    for _line, block in shell:
        for raw in block.replace("\\\n", " ").splitlines():
            command = raw.split("#", 1)[0].strip()
            if command.startswith("tether "):
                words = shlex.split(re.sub(r"\$\([^)]*\)", "X", command))  # $(...): a value
                ends = [i for i, w in enumerate(words) if w in {">", ">>", "<", "|", "&&", ";"}]
                found.append(words[: ends[0]] if ends else words)  # the shell's part is not ours
    return found


@pytest.mark.parametrize("page", [p for p in PAGES if _tether_commands(p)], ids=lambda p: p.name)
def test_the_tether_commands_of_a_page_exist(page: Path) -> None:
    """Each line parses as the CLI would parse it: the command, its options, and no
    argument too many (placeholders such as RUN_ID stand for real values)."""
    from typer.main import get_command

    from tether.cli._main import _build

    cli = get_command(_build())
    for argv in _tether_commands(page):
        args = list(argv[1:])
        command, names = cli, ["tether"]
        while hasattr(command, "commands") and args and args[0] in command.commands:
            names.append(args[0])
            command = command.commands[args.pop(0)]
        assert not hasattr(command, "commands"), f"{page.name}: `{' '.join(argv)}` names a group"
        try:
            command.make_context(" ".join(names), args)
        except Exception as exc:  # click's UsageError, BadParameter...
            raise AssertionError(f"{page.name}: `{' '.join(argv)}`: {exc}") from None


def test_the_cli_reference_is_generated_from_the_commands() -> None:
    from tether.cli._reference import markdown

    page = (ROOT / "docs" / "cli.md").read_text()
    assert page == markdown(), "docs/cli.md is stale: python -m tether.cli._reference > docs/cli.md"


def test_the_cli_reference_shows_arguments_as_help_does() -> None:
    """docs/cli.md showed `tether signal ... JSON_PAYLOAD`, `keyring list PATH`,
    `start ... JSON_ARGS` where --help shows `[JSON_PAYLOAD]`, `[PATH]` (default
    $TETHER_KEYRING), `[JSON_ARGS]...`, and an empty-string default (`` `` ``) for
    `replay --app`. Each usage line is now --help's (its braces around required
    arguments left out), and arguments have a table as options do."""
    import click
    from typer.main import get_command

    from tether.cli._main import _build
    from tether.cli._reference import _walk, markdown

    page = markdown()
    for path, command in _walk(get_command(_build()), []):
        name = "tether " + " ".join(path)
        pieces = command.collect_usage_pieces(click.Context(command, info_name=name))
        usage = re.sub(r"\{([^}]*)\}", r"\1", " ".join([name, *pieces]))
        assert f"```text\n{usage}\n```" in page, (usage, page[page.index(f"## `{name}`") :][:300])
    assert "| `JSON_PAYLOAD` | The payload as JSON (default null). | optional |" in page
    assert "| `PATH` | The keyring file (default: $TETHER_KEYRING). | optional |" in page
    assert "| `RUN_ID` | The run's id. | required |" in page
    assert "| `JSON_ARGS` | Positional arguments" in page
    assert "tether replay [OPTIONS] [HISTORY.json]..." in page
    assert "| `--app` | The App with today's code. |  |" in page and "| `` |" not in page


def test_every_command_summary_is_one_short_sentence() -> None:
    """`tether --help` (and each group's) lists a command by its help's first paragraph:
    a paragraph that went on over several lines showed cut mid-sentence ("(and, for a
    run that" then "cannot move on..."). Each is one line now, a whole sentence; the
    rest of the help follows it after a blank line (and is in docs/cli.md too)."""
    from typer.main import get_command

    from tether.cli._main import _build
    from tether.cli._reference import markdown

    page = markdown()

    def walk(command: Any, path: list[str]) -> Iterator[tuple[str, Any]]:
        yield " ".join(["tether", *path]), command
        for name, sub in getattr(command, "commands", {}).items():
            yield from walk(sub, [*path, name])

    for name, command in walk(get_command(_build()), []):
        paragraphs = (command.help or "").strip().split("\n\n")
        summary = paragraphs[0]
        assert "\n" not in summary and len(summary) <= 90, (name, summary)
        assert summary.endswith("."), (name, summary)
        if name != "tether" and not hasattr(command, "commands"):
            for rest in paragraphs[1:]:
                assert " ".join(rest.split()) in page, (name, rest)


@pytest.mark.timeout(300)
def test_the_documentation_site_builds_strictly(tmp_path: Path) -> None:
    """MkDocs (Material, mkdocstrings) with --strict: a broken link, a page missing from
    the navigation or a docstring griffe cannot read fails the build."""
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert 'id="tether.App' in api and 'id="tether.ai.structured' in api

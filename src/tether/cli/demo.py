"""``tether demo``: the document pipeline that crashes, resumes and asks for reviews."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def demo_command(
    store: Annotated[
        Path,
        typer.Option(
            "--store",
            help="The SQLite file the demo writes (started afresh; a file the demo did not "
            "make is refused).",
        ),
    ] = Path("tether-demo.db"),
    auto_approve: Annotated[
        bool,
        typer.Option("--auto-approve", help="Approve every review instead of asking."),
    ] = False,
    fast: Annotated[bool, typer.Option("--fast", help="No pauses between steps (for CI).")] = False,
    crash: Annotated[
        bool,
        typer.Option("--crash/--no-crash", help="Kill the worker part-way and resume."),
    ] = True,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            help="A real model instead of the offline one: a pydantic-ai model name such as "
            "openai:gpt-4o-mini (its API key from the environment), or the model's name on "
            "--base-url.",
        ),
    ] = None,
    base_url: Annotated[
        str | None,
        typer.Option("--base-url", help="An OpenAI-compatible server (vLLM, Ollama...)."),
    ] = None,
) -> None:
    """Run a document pipeline on the embedded store: crash it, resume it, review, check."""
    try:
        from ..demo.run import Options, main
    except ImportError as exc:
        typer.echo(f"tether demo needs the AI extra: pip install 'tether[ai]' ({exc})", err=True)
        raise typer.Exit(2) from None
    code = main(
        Options(
            store=store,
            auto_approve=auto_approve,
            fast=fast,
            crash=crash,
            model=model,
            base_url=base_url,
        )
    )
    raise typer.Exit(code)

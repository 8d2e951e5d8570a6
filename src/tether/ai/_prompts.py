"""Versioned prompts: a run keeps the prompt version it started with.

A prompt is code, and a deploy changes it like any other code; but a run that is
half way through a conversation (or waiting a week for a human between two model
steps) should not switch wording under itself. ``gateway.prompt(name, versions)``
registers the versions a deploy knows; a run started now is pinned to the current
one (in ``app.get(run).attrs["pins"]``), renders that version until it ends, and
records ``name@version`` on every call it makes with it. ``app.fork(...,
prompts={name: version})`` runs the rest of a real run with another version, to
compare them side by side.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from .._errors import ConfigurationError
from ..workflow._instance import WorkflowInstance, current_instance

#: a version's text: a ``str.format`` template (literal braces doubled) or a function
Template = str | Callable[..., str]
#: a run's pins on the prompt's gateway (``_gateway._run_pins``)
Pins = Callable[[WorkflowInstance], dict[str, Any]]
#: records a pin change once per run (``_gateway._note_repin``)
Note = Callable[[WorkflowInstance, str, str, dict[str, Any]], None]


class PromptText(str):
    """A rendered prompt: the text, and the ``name@version`` it was rendered from (which
    ``ai.complete`` and ``ai.structured`` record on the call)."""

    prompt_version: str

    def __new__(cls, text: str, prompt_version: str) -> PromptText:
        out = super().__new__(cls, text)
        out.prompt_version = prompt_version
        return out


class Prompt:
    """A named prompt with versions, registered on a gateway (``gateway.prompt``)."""

    def __init__(
        self,
        name: str,
        versions: Mapping[str, Template],
        current: str | None,
        pins: Pins,
        note: Note,
    ) -> None:
        if not isinstance(name, str) or not name or "@" in name:
            raise ConfigurationError(f"a prompt needs a name without '@' (got {name!r})")
        if not versions:
            raise ConfigurationError(f"prompt {name!r} needs at least one version")
        for version, template in versions.items():
            if not isinstance(version, str) or not version:
                raise ConfigurationError(f"prompt {name!r}: version {version!r} is not a name")
            if not isinstance(template, str) and not callable(template):
                raise ConfigurationError(
                    f"prompt {name!r} version {version!r} must be a template string or a "
                    f"function returning the text (got {type(template).__name__})"
                )
        self._pins, self._note = pins, note
        self.name = name
        self._versions = dict(versions)
        self.current = current if current is not None else list(self._versions)[-1]
        if self.current not in self._versions:
            raise ConfigurationError(
                f"prompt {name!r}: current version {self.current!r} is not among its "
                f"versions ({', '.join(self._versions)})"
            )

    def __repr__(self) -> str:
        return f"Prompt({self.name!r}, versions={list(self._versions)}, current={self.current!r})"

    @property
    def versions(self) -> tuple[str, ...]:
        """The versions this deploy knows, oldest first."""
        return tuple(self._versions)

    def version(self) -> str:
        """The version in use: the one the current run is pinned to (its start, or a
        fork's choice), else the current one. A pinned version this deploy no longer
        has falls back to the current one, recorded once as ``prompt_repinned``."""
        inst = current_instance()
        if inst is None:
            return self.current
        pinned = (self._pins(inst).get("prompts") or {}).get(self.name)
        if pinned is None or pinned == self.current:
            return self.current
        if pinned in self._versions:
            return str(pinned)
        self._note(
            inst,
            f"prompt:{self.name}",
            "prompt_repinned",
            {
                "prompt": self.name,
                "from": pinned,
                "to": self.current,
                "why": f"this deploy has no version {pinned!r} of the prompt "
                f"(it has {', '.join(self._versions)})",
            },
        )
        return self.current

    def render(self, version: str | None = None, /, **values: Any) -> PromptText:
        """The text of ``version`` (default: the one in use, ``version()``) with
        ``values`` filled in."""
        chosen = version if version is not None else self.version()
        template = self._versions.get(chosen)
        if template is None:
            raise ConfigurationError(
                f"prompt {self.name!r} has no version {chosen!r} "
                f"(known: {', '.join(self._versions)})"
            )
        try:
            text = template(**values) if callable(template) else template.format(**values)
        except (KeyError, IndexError) as exc:
            raise ConfigurationError(
                f"prompt {self.name!r} version {chosen!r} needs a value for {exc} "
                "(pass it to render; a literal brace in a template is written twice)"
            ) from None
        return PromptText(text, f"{self.name}@{chosen}")


def version_of(*texts: Any) -> str | None:
    """The ``name@version`` of the first rendered prompt among ``texts`` (None: none)."""
    for text in texts:
        if isinstance(text, PromptText):
            return text.prompt_version
    return None

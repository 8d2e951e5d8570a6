"""What the engine may log of a text that may hold payload data (an error message).

By default nothing: such text is replaced by a placeholder. ``set_redactor`` installs
a hook that returns what may be shown (a masked copy, or the text itself).
"""

from __future__ import annotations

import re
from collections.abc import Callable

#: decides what of a payload-bearing text may be logged (None: nothing)
_redactor: Callable[[str], str | None] | None = None


def set_redactor(hook: Callable[[str], str | None] | None) -> None:
    """Let ``hook(text)`` decide what the engine may log of a text that may hold payload
    data (an error message): return it (or a masked copy) to log it, None to hide it.
    ``None`` restores the default: such text is never logged."""
    global _redactor
    _redactor = hook


def redact(text: str) -> str:
    """What the engine logs of ``text``: the redaction hook's answer, else a placeholder."""
    hook = _redactor
    if hook is not None and text:
        try:
            shown = hook(text)
        except Exception:  # a faulty hook must not leak the text or break the caller
            shown = None
        if shown is not None:
            return shown
    return f"<{len(text)} characters redacted>" if text else ""


#: a NonDeterminismError's parts the engine writes: a command as ``Type('name')`` or
#: ``Type``, or "no command" with the engine's reason
_ND_PART = r"(?:no command(?: \([a-z ]+\))?|[A-Za-z]+(?:\('[^']*'\)|\(\"[^\"]*\"\))?)"
#: a quoted id, name or path as the engine writes it (``repr``)
_QUOTED = r"(?:'[^']*'|\"[^\"]*\"|None)"
#: where an unreadable payload was met, as the engine names it: the run, step, event,
#: dead letter, blob... from ids and numbers alone (``run 'r1', event 3 (step 2)``)
_WHERE = rf"(?:(?:[a-z_ ,.()]|\d|sha256:[0-9a-f]{{64}}|{_QUOTED})+: )*"
_UTC = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC"
#: why a payload could not be read (a ``KeyUnavailableError`` or ``BlobError``), as
#: ``tether.encryption`` and ``tether.blobs`` write it: key ids, hashes, paths, times
_KEY_PROBLEM = (
    r"this keyring has no such key"
    rf"|the key was destroyed \(tenant {_QUOTED} erased at {_UTC}\); the data it sealed is "
    r"unreadable for good"
    rf"|keyring {_QUOTED} retired the key at {_UTC} \(tether keyring retire\); data still "
    r"sealed with it opens only with a copy of the keyring from before"
    rf"|keyring {_QUOTED} has no such key \(is it the right keyring\?\)"
    rf"|keyring {_QUOTED} keeps it wrapped by {_QUOTED} and this process has no wrapper "
    r"\(set TETHER_KEY_WRAPPER\)"
    r"|it does not open with this keyring's key of that id \(a different key under the "
    r"same id, or the value was changed\)"
    r"|this store is encrypted and this process has no keyring: set TETHER_KEYRING \(a "
    r"keyring file\) or TETHER_ENCRYPTION_KEYS, or pass App\(encryption=\.\.\.\)"
)
_UNREADABLE = (
    rf"{_WHERE}(?:payload sealed with key {_QUOTED}: (?:{_KEY_PROBLEM})"
    rf"|missing from the blob store at {_QUOTED}"
    r"|the stored bytes do not match the hash(?: \(\d+ bytes, recorded \d+\): the file "
    r"was changed or damaged|: left as they are)"
    r"|kept in a blob store this process has not opened)"
)
#: the task errors the engine writes from names and step numbers alone (no payload)
_ENGINE_MADE = re.compile(
    r"NonDeterminismError: non-deterministic workflow code in run '[^']*' at step \d+: "
    rf"history recorded {_ND_PART}, but the code now produced {_ND_PART}\. The run is left "
    r"as it was and will be retried: [a-z ,.()]*tether\.patched\) and it will continue"
    r"(?:\. A run that should not continue can be ended \(tether terminate\), or forked "
    r"from the step before \(app\.fork\('[^']*', at_step=\d+\)\) to run today's code "
    r"from there)?"
    r"|UnknownActivityError: step \d+ \(activity '[^']*', queue '[^']*'\) waits for a "
    r"worker that registers '[^']*'; worker \S+ does not"
    r"|SwitchedOff: (?:workflow|activity|model|tenant) '[^']*' is switched off; the run's "
    r"(?:workflow task|step \d+) waits \(no attempt spent\) until it is switched on"
    rf"|KeyUnavailableError: {_UNREADABLE}|BlobError: {_UNREADABLE}",
    re.DOTALL,
)


def engine_made(task_error: str) -> bool:
    """Whether a run's ``task_error`` (``"Type: message"``) is one the engine writes from
    names and step numbers alone, so it holds no payload: a ``NonDeterminismError``'s
    text, the note on a step whose activity the worker lacks or a switch holds, or why a
    payload could not be read (``KeyUnavailableError``, ``BlobError``: key ids, blob
    references, paths)."""
    return _ENGINE_MADE.fullmatch(task_error) is not None


def redact_error(type_name: str, text: str) -> str:
    """What the engine logs of an error's message: all of it when the engine made it
    from names alone (``engine_made``), else what ``redact`` allows."""
    return text if engine_made(f"{type_name}: {text}") else redact(text)

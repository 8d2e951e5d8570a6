"""What a worker needs from the App it serves: a small protocol, so the worker layer
never imports the client layer (``_app`` imports ``_worker``, not the other way)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ._definitions import Activity, Workflow
from .store.base import Store


class WorkerApp(Protocol):
    """The App as its workers see it (``tether.App`` is one)."""

    @property
    def store(self) -> Store:
        """The store the App's runs live in."""
        ...

    #: in-process workers (``tether.Worker``) of this App, for starts handed to them
    _local_workers: list[Any]

    def queues(self) -> list[str]:
        """Every queue the App's workflows and activities use."""
        ...

    def get_workflow(self, name: str) -> Workflow[Any, Any]:
        """The workflow registered under ``name``."""
        ...

    def workflows(self) -> list[Workflow[Any, Any]]:
        """Every workflow registered on the App."""
        ...

    def get_activity(self, name: str) -> Activity[Any, Any]:
        """The activity registered under ``name``."""
        ...

    async def _write_queue_limits(self, *, force: bool = False) -> None: ...

    def _note_running_here(self, run_id: str) -> None: ...

    async def _loans_repaid(self, worker: Any, grace: float) -> None:
        """Wait for the starts other threads run on ``worker``'s loop (it is stopping)."""
        ...

    def _alert(self, run_id: str, error: dict[str, Any]) -> object: ...

    async def _purge_before(
        self,
        cutoff: float,
        workflow: str | None,
        tenant: str | None,
        *,
        dry_run: bool = False,
        batch: int = 500,
        stopping: Callable[[], bool] = ...,
        blobs: bool = ...,
    ) -> dict[str, int]: ...

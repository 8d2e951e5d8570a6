"""Stores: where runs, histories and tasks live."""

from __future__ import annotations

from ._open import open_store
from .base import Store, WorkflowTaskResult

__all__ = ["Store", "WorkflowTaskResult", "open_store"]

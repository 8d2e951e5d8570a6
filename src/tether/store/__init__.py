"""Stores: where runs, histories and tasks live."""

from __future__ import annotations

from .base import Store, WorkflowTaskResult, open_store

__all__ = ["Store", "WorkflowTaskResult", "open_store"]

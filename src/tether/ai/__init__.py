"""tether.ai: model calls as recorded facts, validated output, budgets and a shared gateway.

In a pipeline the model proposes and code disposes: every model call is a
recorded step (never regenerated on replay), its output is typed and validated
before anything trusts it, and spend is bounded before a call, not discovered
after it. Built on pydantic-ai's model layer and genai-prices (``tether[ai]``).
"""

from __future__ import annotations

try:  # the ai extra: said so, rather than a bare ModuleNotFoundError from deep inside
    import genai_prices  # noqa: F401
    import pydantic_ai  # noqa: F401
except ModuleNotFoundError as exc:
    raise ImportError(
        f"tether.ai needs the ai extra: pip install 'tether[ai]' ({exc.name} is not installed)"
    ) from exc

from .._usage import Budget, Usage
from ..workflow._route import route
from ._agent import DurableAgent, RecordedModel, ToolApproval, durable
from ._batch import BatchError, BatchResult, batch
from ._errors import BudgetExceeded, ContentRefused, ModelConfigError, OutputInvalid
from ._gateway import DEFAULT_MODEL_RETRY, Gateway, ModelRef, Price, expand_history
from ._mapreduce import ChunkFailure, MapReduceError, MapReduceResult, chunk_text, map_reduce
from ._models import anthropic, openai_compatible
from ._prompts import Prompt, PromptText
from ._scripted import ScriptedModel, ScriptExhausted
from ._structured import complete, structured
from ._untrusted import UNTRUSTED_RULE, untrusted

__all__ = [
    "BatchError",
    "BatchResult",
    "batch",
    "UNTRUSTED_RULE",
    "ChunkFailure",
    "MapReduceError",
    "MapReduceResult",
    "chunk_text",
    "map_reduce",
    "untrusted",
    "DEFAULT_MODEL_RETRY",
    "Budget",
    "BudgetExceeded",
    "ContentRefused",
    "DurableAgent",
    "Gateway",
    "ModelConfigError",
    "ModelRef",
    "OutputInvalid",
    "Price",
    "Prompt",
    "PromptText",
    "RecordedModel",
    "ScriptExhausted",
    "ScriptedModel",
    "ToolApproval",
    "Usage",
    "anthropic",
    "complete",
    "durable",
    "expand_history",
    "openai_compatible",
    "route",
    "structured",
]

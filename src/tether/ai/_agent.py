"""Durable pydantic-ai agents: every model request and tool call a recorded tether step.

``tether.ai.durable(agent, gateway)`` leaves the agent's code as it is. Called
inside a workflow, its loop runs in the workflow (deterministic: it only
decides), its model requests go through the gateway as recorded steps, and each
call of a function tool runs as the activity ``tether.ai.agent.<name>.tool`` on a
worker, with tether's retries and timeouts. On replay the recorded answers and
tool results come back and the loop reaches the same place without calling the
model or a tool again. Outside a workflow the agent runs as it always did.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import AsyncIterator, Sequence
from datetime import timedelta
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, TypeAdapter, ValidationError, create_model
from pydantic_ai import Agent
from pydantic_ai.exceptions import ModelRetry
from pydantic_ai.messages import InstructionPart, ModelMessage, ModelResponse
from pydantic_ai.models import Model, ModelRequestParameters
from pydantic_ai.settings import ModelSettings
from pydantic_ai.tools import RunContext, ToolDefinition
from pydantic_ai.toolsets import (
    AbstractToolset,
    DynamicToolset,
    FunctionToolset,
    WrapperToolset,
)
from pydantic_ai.toolsets.abstract import ToolsetTool
from pydantic_ai.toolsets.external import TOOL_SCHEMA_VALIDATOR
from pydantic_core import to_jsonable_python

from .._activity_context import activity_context
from .._errors import ConfigurationError, NonRetryable
from .._policy import Retry
from ..workflow._approval import approval
from ..workflow._instance import current_instance
from ._gateway import Gateway, ModelRef

DepsT = TypeVar("DepsT")
OutputT = TypeVar("OutputT")

_TOOL_DEF: TypeAdapter[ToolDefinition] = TypeAdapter(ToolDefinition)
_INSTRUCTIONS: TypeAdapter[Any] = TypeAdapter(
    str | InstructionPart | list[str | InstructionPart] | None
)

#: a tool's ``ModelRetry`` crosses the step boundary as this key of its result
_RETRY_KEY = "tether.ai.model_retry"


class RecordedModel(Model):
    """A pydantic-ai ``Model`` whose requests are recorded steps of the running workflow."""

    def __init__(self, ref: ModelRef, stream: bool = False) -> None:
        super().__init__()
        self._ref = ref
        self._stream = stream

    @property
    def model_name(self) -> str:
        return self._ref.model_name

    @property
    def system(self) -> str:
        return self._ref.provider or "tether"

    async def request(
        self,
        messages: list[ModelMessage],
        model_settings: ModelSettings | None,
        model_request_parameters: ModelRequestParameters,
    ) -> ModelResponse:
        response, _call = await self._ref.gateway.request(
            self._ref,
            list(messages),
            params=model_request_parameters,
            settings=model_settings,
            stream=self._stream,
        )
        return response


def _leaves(toolset: AbstractToolset[Any]) -> list[AbstractToolset[Any]]:
    found: list[AbstractToolset[Any]] = []
    toolset.apply(found.append)
    return found


def _listed_by_a_step(toolset: AbstractToolset[Any]) -> bool:
    """Whether listing ``toolset``'s tools may do I/O (an MCP server, a dynamic toolset's
    function): then the listing is a recorded step, never run in the workflow."""
    return not all(isinstance(leaf, FunctionToolset) for leaf in _leaves(toolset))


def _listed_per_step(toolset: AbstractToolset[Any]) -> bool:
    """A dynamic toolset re-evaluated at every run step is listed again at each step;
    anything else once per agent run (as an MCP server's cached tool list)."""
    return any(isinstance(leaf, DynamicToolset) and leaf.per_run_step for leaf in _leaves(toolset))


@contextlib.asynccontextmanager
async def _entered(
    toolset: AbstractToolset[Any], ctx: RunContext[Any]
) -> AsyncIterator[AbstractToolset[Any]]:
    """``toolset`` as an agent run holds it at this step (worker side): its per-run copy,
    entered (an MCP server connected), and evaluated for the step (a dynamic toolset's
    function run)."""
    run_ts = await toolset.for_run(ctx)
    async with run_ts:
        yield await run_ts.for_run_step(ctx)


def _context(ctx: RunContext[Any]) -> tuple[Any, Any]:
    """The run context and deps as JSON, to cross to the worker that runs a step."""
    from pydantic_ai.durable_exec import DurableRunContext

    context = to_jsonable_python(DurableRunContext.serialize_run_context(ctx))
    deps = to_jsonable_python(ctx.deps) if ctx.deps is not None else None
    return context, deps


@dataclasses.dataclass
class _RecordedToolset(WrapperToolset[Any]):
    """Runs each tool call of the wrapped toolset as a recorded step; a toolset whose
    listing does I/O (MCP, dynamic) is listed by a recorded step too, and never entered
    in the workflow: the worker that runs a step enters it around that step."""

    durable: DurableAgent[Any, Any] = dataclasses.field(default=None)  # type: ignore[arg-type]
    index: int = 0
    listed: bool = False
    per_step: bool = False
    #: the last recorded listing: (run step or -1, tools, instructions)
    listing: list[Any] = dataclasses.field(default_factory=list)

    @property
    def id(self) -> str | None:
        """The wrapped toolset's id: instructions and tool names are attributed to it."""
        return self.wrapped.id

    async def for_run(self, ctx: RunContext[Any]) -> AbstractToolset[Any]:
        return self if self.listed else await super().for_run(ctx)

    async def for_run_step(self, ctx: RunContext[Any]) -> AbstractToolset[Any]:
        return self if self.listed else await super().for_run_step(ctx)

    async def __aenter__(self) -> Any:
        if not self.listed:
            await super().__aenter__()
        return self

    async def __aexit__(self, *args: Any) -> bool | None:
        return None if self.listed else await super().__aexit__(*args)

    async def get_tools(self, ctx: RunContext[Any]) -> dict[str, ToolsetTool[Any]]:
        if not self.listed:
            return await super().get_tools(ctx)
        tools, _instructions = await self._listing(ctx)
        return tools

    async def get_instructions(self, ctx: RunContext[Any]) -> Any:
        if not self.listed:
            return await super().get_instructions(ctx)
        _tools, instructions = await self._listing(ctx)
        return instructions

    async def _listing(self, ctx: RunContext[Any]) -> tuple[dict[str, ToolsetTool[Any]], Any]:
        key = ctx.run_step if self.per_step else -1
        if not self.listing or self.listing[0] != key:
            context, deps = _context(ctx)
            out = await self.durable.list_step(self.durable.name, self.index, context, deps)
            tools: dict[str, ToolsetTool[Any]] = {}
            for item in out["tools"]:
                tool_def = _TOOL_DEF.validate_python(item["tool_def"])
                tools[tool_def.name] = ToolsetTool(
                    toolset=self,
                    tool_def=tool_def,
                    max_retries=item["max_retries"],
                    args_validator=TOOL_SCHEMA_VALIDATOR,  # checked by the worker's own tool
                )
            self.listing[:] = [key, tools, _INSTRUCTIONS.validate_python(out["instructions"])]
        return self.listing[1], self.listing[2]

    async def call_tool(
        self, name: str, tool_args: dict[str, Any], ctx: RunContext[Any], tool: ToolsetTool[Any]
    ) -> Any:
        if current_instance() is None:
            return await super().call_tool(name, tool_args, ctx, tool)
        context, deps = _context(ctx)
        tool_def = to_jsonable_python(tool.tool_def) if self.listed else None
        out = await self.durable.tool_step(
            self.durable.name, self.index, name, tool_args, context, deps, tool_def
        )
        if isinstance(out, dict) and _RETRY_KEY in out:
            raise ModelRetry(str(out[_RETRY_KEY]))
        return out["value"] if isinstance(out, dict) else out


#: the patch marker of a run whose deferred tool calls are proposed as a typed call
#: (``{"tool": <that tool>, "args": {...}}``, nothing else), so an edit of another
#: shape is refused by the review; older runs proposed a plain dict
TYPED_TOOL_EDIT = "tether.ai.typed-tool-edit"
#: the patch marker of a run that opens the reviews of the tool calls one model answer
#: defers all at once and waits for them together; older runs reviewed them in turn
TOOL_REVIEWS_TOGETHER = "tether.ai.tool-reviews-together"
#: the patch marker of an older run (plain dict proposal) that denies a tool call whose
#: approved edit is not ``{"tool": <that tool>, "args": {...}}`` instead of running
#: the original arguments
EDIT_FAILS_CLOSED = "tether.ai.edit-fails-closed"


@functools.lru_cache(maxsize=256)
def _tool_call_type(tool: str) -> type[BaseModel]:
    """The type of a proposed call of ``tool``: its name, exactly, and its arguments."""
    return create_model(
        "ToolCall",
        __config__=ConfigDict(extra="forbid"),
        tool=(Literal[tool], ...),  # type: ignore[arg-type]
        args=(dict[str, Any], ...),
    )


def _edited_args(decision: Any, tool: str) -> tuple[dict[str, Any] | None, str | None]:
    """The arguments an approved decision runs the tool with (None: the proposal's), or
    why its edit is not a call of ``tool``."""
    if not decision.edited:
        return None, None
    edited = decision.value
    if isinstance(edited, BaseModel):
        edited = edited.model_dump()
    if not isinstance(edited, dict) or set(edited) != {"tool", "args"}:
        return None, 'it must be {"tool": ..., "args": {...}}'
    if edited["tool"] != tool:
        return None, f"it names tool {edited['tool']!r}, not {tool!r}"
    if not isinstance(edited["args"], dict):
        return None, "its args must be an object"
    return edited["args"], None


def _fails_closed() -> bool:
    """Whether this run denies a malformed edit (older histories ran the original call)."""
    inst = current_instance()
    return inst is not None and inst.patched(EDIT_FAILS_CLOSED)


@dataclasses.dataclass(frozen=True)
class ToolApproval:
    """Who approves the tool calls an agent defers, by when, and what happens then
    (``tether.approval``'s options)."""

    deadline: float | timedelta
    approvers: Sequence[str] | str = ()
    escalate_to: Sequence[tuple[Sequence[str] | str, float | timedelta]] = ()
    allow_edit: bool = False
    default: str = "reject"


class DurableAgent(Generic[DepsT, OutputT]):
    """A pydantic-ai agent whose model requests and tool calls are recorded steps."""

    def __init__(
        self,
        agent: Agent[DepsT, OutputT],
        gateway: Gateway,
        *,
        name: str,
        model: ModelRef,
        tool_retry: Retry | None,
        tool_timeout: float | timedelta | None,
        stream: bool = False,
    ) -> None:
        self.agent = agent
        self.stream = stream
        self.gateway = gateway
        self.name = name
        self.model = model
        self.toolsets: list[AbstractToolset[Any]] = list(agent.toolsets)
        self._deps: TypeAdapter[Any] = TypeAdapter(agent.deps_type)
        self.tool_step = gateway.app.activity(
            name=f"{gateway.name}.agent.{name}.tool", retry=tool_retry, timeout=tool_timeout
        )(self._run_tool)
        self.list_step = gateway.app.activity(
            name=f"{gateway.name}.agent.{name}.tools", retry=tool_retry, timeout=tool_timeout
        )(self._list_tools)
        # the agent's run context (its run id, usage so far) is made anew by every
        # replay: replay compares the other arguments (the tool, its arguments, deps)
        self.tool_step.replay_unchecked = self.list_step.replay_unchecked = frozenset({"context"})

    async def run(
        self,
        user_prompt: str | Sequence[Any] | None = None,
        *,
        deps: DepsT = None,  # type: ignore[assignment]
        message_history: Sequence[ModelMessage] | None = None,
        model_settings: ModelSettings | None = None,
        approve_tools: ToolApproval | None = None,
        **kwargs: Any,
    ) -> Any:
        """``agent.run(...)``: durable inside a workflow, the plain agent outside one.

        With ``approve_tools``, tool calls the agent defers for approval (tools declared
        with ``requires_approval=True``, the agent's output types including
        ``DeferredToolRequests``) each become a ``tether.approval`` of the call (tool
        and arguments), waited for durably; the agent then goes on with the approved
        calls run (edited arguments when the review allows edits) and the others
        denied, until it answers without deferring."""
        result = await self._run_once(
            user_prompt,
            deps=deps,
            message_history=message_history,
            model_settings=model_settings,
            **kwargs,
        )
        if approve_tools is None or current_instance() is None:
            return result
        from pydantic_ai import DeferredToolRequests, DeferredToolResults, ToolApproved, ToolDenied

        while isinstance(result.output, DeferredToolRequests) and result.output.approvals:
            answers: dict[str, Any] = {}
            calls = list(result.output.approvals)
            inst = current_instance()
            # a run since this marker opens the reviews of one answer's calls at once and
            # waits for them together (at most one deadline); older runs one by one
            together = inst is not None and inst.patched(TOOL_REVIEWS_TOGETHER)
            decisions: list[Any] = []
            if together:
                decisions = list(
                    await asyncio.gather(*(self._review(call, approve_tools) for call in calls))
                )
            for i, call in enumerate(calls):
                typed = inst is not None and inst.patched(TYPED_TOOL_EDIT)
                decision = decisions[i] if together else await self._review(call, approve_tools)
                if decision.approved:
                    override, problem = _edited_args(decision, call.tool_name)
                    if problem is not None and (typed or _fails_closed()):
                        # fail closed: never run the original arguments for an edit; the
                        # marker says so next to the approval_decided that approved it
                        why = f"denied: the edit by {decision.by} is not a call of this tool"
                        answers[call.tool_call_id] = ToolDenied(f"{why} ({problem})")
                        if inst is not None:
                            inst.record(
                                "tool_call_denied",
                                {
                                    "approval_id": decision.approval_id,
                                    "tool": call.tool_name,
                                    "reason": f"{why} ({problem})",
                                },
                            )
                        continue
                    answers[call.tool_call_id] = ToolApproved(override_args=override)
                else:
                    who = decision.by or "the deadline"
                    why = f"denied by {who}" + (f": {decision.reason}" if decision.reason else "")
                    answers[call.tool_call_id] = ToolDenied(why)
            result = await self._run_once(
                None,
                deps=deps,
                message_history=result.all_messages(),
                model_settings=model_settings,
                deferred_tool_results=DeferredToolResults(approvals=answers),
                **kwargs,
            )
        return result

    async def _review(self, call: Any, approve_tools: ToolApproval) -> Any:
        """The ``tether.approval`` of one deferred tool call (its tool and arguments)."""
        inst = current_instance()
        proposal: Any = {"tool": call.tool_name, "args": call.args_as_dict()}
        if inst is not None and inst.patched(TYPED_TOOL_EDIT):
            # an edit is validated as {"tool": <this tool>, "args": {...}}
            proposal = _tool_call_type(call.tool_name)(**proposal)
        return await approval(
            proposal,
            deadline=approve_tools.deadline,
            approvers=approve_tools.approvers,
            escalate_to=approve_tools.escalate_to,
            allow_edit=approve_tools.allow_edit,
            default=approve_tools.default,
            name=f"{self.name}.{call.tool_name}",
        )

    @contextlib.asynccontextmanager
    async def run_stream(
        self,
        user_prompt: str | Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[Any]:
        """``agent.run_stream(...)``: the plain agent's stream outside a workflow.

        Inside one, the run is the durable ``run`` (each request a recorded step) and
        the result streams what was recorded: ``stream_text`` / ``stream_output`` give
        the final answer as one item, the same on every replay, because a replay has
        no stream to read. Live text for a person watching goes to the run's
        followers instead (``durable(..., stream=True)``, ``gateway.follow``, the HTTP
        event stream), never through workflow code."""
        if current_instance() is None:
            async with self.agent.run_stream(user_prompt, **kwargs) as streamed:
                yield streamed
            return
        yield _RecordedStream(await self.run(user_prompt, **kwargs))

    async def _run_once(
        self,
        user_prompt: str | Sequence[Any] | None,
        *,
        deps: DepsT,
        message_history: Sequence[ModelMessage] | None,
        model_settings: ModelSettings | None,
        **kwargs: Any,
    ) -> Any:
        if current_instance() is None:
            return await self.agent.run(
                user_prompt,
                deps=deps,
                message_history=message_history,
                model_settings=model_settings,
                **kwargs,
            )
        wrapped = [
            _RecordedToolset(
                ts,
                durable=self,
                index=i,
                listed=_listed_by_a_step(ts),
                per_step=_listed_per_step(ts),
            )
            for i, ts in enumerate(self.toolsets)
        ]
        # tools=[] empties the agent's own function toolset: its tools run through the wrapper
        recorded = RecordedModel(self.model, self.stream)
        with self.agent.override(model=recorded, toolsets=wrapped, tools=[]):
            return await self.agent.run(
                user_prompt,
                deps=deps,
                message_history=message_history,
                model_settings=model_settings,
                **kwargs,
            )

    def _toolset(
        self, agent: str, toolset: int, context: dict[str, Any], deps: Any
    ) -> tuple[AbstractToolset[Any], RunContext[Any]]:
        """The toolset a step names, and the run context rebuilt from the workflow's."""
        from pydantic_ai.durable_exec import DurableRunContext

        if agent != self.name or not 0 <= toolset < len(self.toolsets):
            raise NonRetryable(
                f"tool step for agent {agent!r} (toolset {toolset}) does not match this worker's "
                f"agent {self.name!r}: deploy the same agent definition to every worker"
            )
        ctx = DurableRunContext.deserialize_run_context(
            context, deps=self._deps.validate_python(deps)
        )
        return self.toolsets[toolset], ctx

    async def _list_tools(
        self, agent: str, toolset: int, context: dict[str, Any], deps: Any = None
    ) -> dict[str, Any]:
        """The tools (and instructions) of a toolset whose listing does I/O (worker side):
        entered for this step, as the agent would enter it for a run."""
        ts, ctx = self._toolset(agent, toolset, context, deps)
        async with _entered(ts, ctx) as run_ts:
            tools = await run_ts.get_tools(ctx)
            instructions = await run_ts.get_instructions(ctx)
        return {
            "tools": [
                {"tool_def": to_jsonable_python(t.tool_def), "max_retries": t.max_retries}
                for t in tools.values()
            ],
            "instructions": to_jsonable_python(instructions),
        }

    async def _run_tool(
        self,
        agent: str,
        toolset: int,
        name: str,
        args: dict[str, Any],
        context: dict[str, Any],
        deps: Any = None,
        tool_def: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One tool call (worker side), with the run context rebuilt from the workflow's;
        the arguments are checked here by the tool's own validator (a listed tool's
        definition crossed as JSON, without it)."""
        ts, ctx = self._toolset(agent, toolset, context, deps)
        async with _entered(ts, ctx) as run_ts:
            tool: ToolsetTool[Any] | None
            if tool_def is None:
                tool = (await run_ts.get_tools(ctx)).get(name)
            else:
                try:
                    tool = await run_ts.get_tool_for_tool_def(
                        _TOOL_DEF.validate_python(tool_def), ctx
                    )
                except KeyError:
                    tool = None
            if tool is None:
                raise NonRetryable(
                    f"agent {self.name!r} has no tool {name!r} in toolset {toolset} on this "
                    "worker: deploy the same agent definition (and tool servers) to every worker"
                )
            try:
                valid = tool.args_validator.validate_python(args)
            except ValidationError as exc:
                return {_RETRY_KEY: f"invalid arguments for tool {name!r}: {exc}"}
            await self._event({"event": "tool_call", "tool": name, "args": args})
            try:
                value = await run_ts.call_tool(name, valid, ctx, tool)
            except ModelRetry as exc:
                await self._event({"event": "tool_result", "tool": name, "ok": False})
                return {_RETRY_KEY: exc.message}
        await self._event({"event": "tool_result", "tool": name, "ok": True})
        return {"value": to_jsonable_python(value)}

    async def _event(self, item: dict[str, Any]) -> None:
        """An agent event for whoever follows the run (worker side; never recorded)."""
        ctx = activity_context()
        event = {"run_id": ctx.run_id, "step": ctx.step, "agent": self.name, **item}
        self.gateway._publish(ctx.run_id, event)
        await self.gateway._broadcast(self.gateway._step_store(), ctx.run_id, event)


class _RecordedStream:
    """A durable agent run's result with the streamed result's reading methods: the
    recorded answer, whole (deterministic on replay)."""

    def __init__(self, result: Any) -> None:
        self.result = result

    @property
    def output(self) -> Any:
        return self.result.output

    async def get_output(self) -> Any:
        return self.result.output

    async def stream_output(self, *, debounce_by: float | None = None) -> AsyncIterator[Any]:
        yield self.result.output

    async def stream_text(
        self, *, delta: bool = False, debounce_by: float | None = None
    ) -> AsyncIterator[str]:
        yield str(self.result.output)

    def all_messages(self) -> list[ModelMessage]:
        return list(self.result.all_messages())

    def new_messages(self) -> list[ModelMessage]:
        return list(self.result.new_messages())

    def usage(self) -> Any:
        return self.result.usage()

    #: the answer was recorded whole
    is_complete = True


def durable(
    agent: Agent[DepsT, OutputT],
    gateway: Gateway,
    *,
    name: str | None = None,
    model: ModelRef | None = None,
    tool_retry: Retry | None = None,
    tool_timeout: float | timedelta | None = None,
    stream: bool = False,
) -> DurableAgent[DepsT, OutputT]:
    """Make ``agent`` durable on ``gateway``'s app; its code does not change.

    The agent's model is registered on the gateway as ``agent:<name>`` (or pass
    ``model=`` a gateway model, with its fallbacks and limits). ``name`` defaults
    to the agent's own and must be stable: recorded steps carry it. Followers of the
    run (``gateway.follow``, the HTTP event stream) get each tool call and result as
    an event, and with ``stream`` the model's text as it comes; none of it is recorded.
    """
    label = name or agent.name
    if not label:
        raise ConfigurationError(
            "a durable agent needs a stable name: Agent(..., name='triage') or durable(name=)"
        )
    if model is None:
        if agent.model is None:
            raise ConfigurationError(
                f"agent {label!r} has no model: give the Agent one, or pass model= a gateway model"
            )
        model = gateway.model(f"agent:{label}", agent.model)
    return DurableAgent(
        agent,
        gateway,
        name=label,
        model=model,
        tool_retry=tool_retry,
        tool_timeout=tool_timeout,
        stream=stream,
    )

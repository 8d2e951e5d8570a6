"""A scripted OpenAI-compatible chat server on 127.0.0.1, for tests without a network.

Real HTTP, so the whole path is exercised: the provider SDK, its error mapping,
headers such as ``Retry-After``, timeouts and garbage bodies. Each model name has
a script, a list of answers taken in order; a request after its script ran out
gets HTTP 500 with ``script exhausted`` and is counted in ``exhausted``, so a test
that makes more calls than it planned fails loudly. ``requests`` keeps every
request (model, arrival time, body) for assertions such as "the model was called
exactly twice".
"""

from __future__ import annotations

import collections
import dataclasses
import http.server
import json
import select
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from ._fake_batches import FakeBatches


@dataclasses.dataclass
class Answer:
    """One scripted answer: a reply, an HTTP error or a raw body."""

    status: int = 200
    #: the assistant's text content (a JSON string for structured output in text mode)
    text: str | None = None
    #: tool calls: (name, arguments) where arguments is a dict or a raw (maybe broken) string
    tool_calls: list[tuple[str, dict[str, Any] | str]] = dataclasses.field(default_factory=list)
    input_tokens: int = 10
    output_tokens: int = 5
    cached_tokens: int = 0
    finish_reason: str = "stop"
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    #: a body sent verbatim instead of a completion (garbage, an error document)
    raw: str | None = None
    delay: float = 0.0
    #: pause between streamed chunks (a request with ``"stream": true`` gets chunks)
    chunk_delay: float = 0.0
    #: streamed: the connection closes after this many chunks, with no finish reason
    #: and no ``[DONE]`` (a stream a proxy cut off)
    cut_after: int | None = None


def reply(
    text: str | None = None,
    *,
    tool: tuple[str, dict[str, Any] | str] | None = None,
    input_tokens: int = 10,
    output_tokens: int = 5,
    cached_tokens: int = 0,
    finish_reason: str | None = None,
    headers: dict[str, str] | None = None,
    delay: float = 0.0,
    chunk_delay: float = 0.0,
    cut_after: int | None = None,
) -> Answer:
    """A completion with ``text`` or one tool call ``(name, arguments)``, and its usage.

    Streamed (word by word) when the request asks for a stream."""
    return Answer(
        text=text,
        tool_calls=[tool] if tool is not None else [],
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        cached_tokens=cached_tokens,
        finish_reason=finish_reason or ("tool_calls" if tool is not None else "stop"),
        headers=dict(headers or {}),
        delay=delay,
        chunk_delay=chunk_delay,
        cut_after=cut_after,
    )


def error(
    status: int,
    message: str = "scripted error",
    *,
    code: str | None = None,
    retry_after: float | None = None,
    headers: dict[str, str] | None = None,
    delay: float = 0.0,
) -> Answer:
    """An HTTP error answer in OpenAI's error shape (429 with ``retry_after``, 5xx...)."""
    hdrs = dict(headers or {})
    if retry_after is not None:
        hdrs["Retry-After"] = f"{retry_after:g}"
    body = {"error": {"message": message, "type": "scripted", "code": code}}
    return Answer(status=status, raw=json.dumps(body), headers=hdrs, delay=delay)


def garbage(body: str = "<html>502 bad gateway</html>", status: int = 200) -> Answer:
    """A body that is not a completion at all."""
    return Answer(status=status, raw=body)


@dataclasses.dataclass(frozen=True)
class Request:
    """One request the server received."""

    model: str
    at: float  #: time.monotonic() on arrival
    body: dict[str, Any]
    headers: dict[str, str] = dataclasses.field(default_factory=dict)  #: lower-cased names


class ModelServer:
    """An OpenAI-compatible ``/v1/chat/completions`` endpoint answering from scripts
    (and Anthropic's ``/v1/messages``, at ``anthropic_url``).

    ``with ModelServer() as server:`` starts it on a free port; point a client at
    ``server.base_url``. ``server.script("m", reply("hi"), error(429, retry_after=2))``
    appends answers for model ``m``; ``server.default`` (a function of the request
    body) answers when a model has no script at all, e.g. for benchmarks.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self._scripts: dict[str, collections.deque[Answer]] = collections.defaultdict(
            collections.deque
        )
        self._lock = threading.Lock()
        self.requests: list[Request] = []
        #: requests whose client closed the connection while their answer was delayed
        #: (a call cancelled, its HTTP request aborted), with when it was noticed
        #: (time.monotonic(), within 0.05 s)
        self.aborted: list[tuple[Request, float]] = []
        self.exhausted: list[str] = []
        self.default: Callable[[dict[str, Any]], Answer] | None = None
        #: the provider batch API (files, batches) answering from the same scripts
        self.batches = FakeBatches(self._batch_answer)
        #: called with each request as it arrives, before it is answered (e.g. to kill
        #: the client process between the provider's work and the client's record of it)
        self.on_request: Callable[[Request], None] | None = None
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                return

            def setup(self) -> None:
                super().setup()
                # headers and body go out in two writes: without this, Nagle's algorithm
                # and the client's delayed ACK add ~40 ms to every answer
                self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

            def _json(self, status: int, payload: Any) -> None:
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                path = self.path.split("?")[0].rstrip("/")
                parts = path.split("/")
                found: Any = None
                if path.endswith("/batches"):
                    query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
                    found = server.batches.listing(
                        int(query.get("limit", ["20"])[0]), query.get("after", [None])[0]
                    )
                elif len(parts) >= 2 and parts[-2] == "batches":
                    found = server.batches.retrieve(parts[-1])
                elif path.endswith("/content") and len(parts) >= 3:
                    found = server.batches.content(parts[-2])
                if found is None:
                    self._json(404, {"error": {"message": f"no {path}", "type": "not_found"}})
                else:
                    self._json(200, found)

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                path = self.path.split("?")[0].rstrip("/")
                if path.endswith("/files"):
                    self._json(200, server.batches.upload(self.headers["Content-Type"], raw))
                    return
                if path.endswith("/batches"):
                    self._json(200, server.batches.create(json.loads(raw or b"{}")))
                    return
                try:
                    body = json.loads(raw or b"{}")
                except ValueError:
                    body = {}
                headers = {k.lower(): v for k, v in self.headers.items()}
                answer, request = server._take_request(body, headers)
                if answer.delay and server._delay(self.connection, answer.delay, request):
                    self.close_connection = True
                    return  # the client gave up while it waited: nothing to answer
                anthropic = path.endswith("/messages")
                if anthropic and body.get("stream"):
                    self._json(400, _anthropic_error("streaming is not scripted here"))
                    return
                if body.get("stream") and answer.raw is None and answer.status == 200:
                    self._stream(body, answer)
                    return
                shape = _anthropic_message if anthropic else _completion
                payload = (
                    answer.raw.encode()
                    if answer.raw is not None
                    else json.dumps(shape(body, answer)).encode()
                )
                try:
                    self.send_response(answer.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    for k, v in answer.headers.items():
                        self.send_header(k, v)
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up
                    pass

            def _stream(self, body: dict[str, Any], answer: Answer) -> None:
                """The answer as Server-Sent Events chunks, a word at a time."""
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Connection", "close")
                    for k, v in answer.headers.items():
                        self.send_header(k, v)
                    self.end_headers()
                    chunks = _chunks(body, answer)
                    if answer.cut_after is not None:
                        chunks = chunks[: answer.cut_after]
                    for chunk in chunks:
                        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                        self.wfile.flush()
                        if answer.chunk_delay:
                            time.sleep(answer.chunk_delay)
                    if answer.cut_after is not None:
                        self.close_connection = True
                        return  # cut off: no finish, no [DONE]
                    self.wfile.write(b"data: [DONE]\n\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    pass
                self.close_connection = True

        self._httpd = http.server.ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (``http://127.0.0.1:PORT/v1``)."""
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}/v1"

    @property
    def anthropic_url(self) -> str:
        """The Anthropic base URL (``http://127.0.0.1:PORT``; the SDK adds ``/v1/messages``).

        The same scripts answer in the Messages API's shape (not streamed)."""
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    def script(self, model: str, *answers: Answer) -> ModelServer:
        """Append answers to ``model``'s script (taken first in, first out)."""
        with self._lock:
            self._scripts[model].extend(answers)
        return self

    def count(self, model: str | None = None) -> int:
        """Requests received (for ``model``, or all)."""
        with self._lock:
            return sum(1 for r in self.requests if model is None or r.model == model)

    def calls(self, model: str | None = None) -> list[Request]:
        """The requests received (for ``model``, or all), oldest first."""
        with self._lock:
            return [r for r in self.requests if model is None or r.model == model]

    def pending(self, model: str) -> int:
        """Answers left in ``model``'s script."""
        with self._lock:
            return len(self._scripts.get(model, ()))

    def _batch_answer(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """One line of a batch, answered like a chat request."""
        answer = self._take(body, {})
        return answer.status, _completion(body, answer)

    def _take(self, body: dict[str, Any], headers: dict[str, str]) -> Answer:
        return self._take_request(body, headers)[0]

    def _delay(self, conn: socket.socket, seconds: float, request: Request) -> bool:
        """Wait ``seconds`` before answering (True: the client closed the connection
        meanwhile, noted in ``aborted``)."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            readable, _, _ = select.select([conn], [], [], min(0.05, left))
            if not readable:
                continue
            try:
                closed = conn.recv(1, socket.MSG_PEEK) == b""
            except OSError:
                closed = True
            if closed:
                with self._lock:
                    self.aborted.append((request, time.monotonic()))
                return True
            time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
        return False

    def _take_request(
        self, body: dict[str, Any], headers: dict[str, str]
    ) -> tuple[Answer, Request]:
        model = str(body.get("model", ""))
        request = Request(model, time.monotonic(), body, headers)
        if self.on_request is not None:
            self.on_request(request)
        with self._lock:
            self.requests.append(request)
            script = self._scripts.get(model)
            if script:
                return script.popleft(), request
            if self.default is not None and model not in self._scripts:
                return self.default(body), request
            self.exhausted.append(model)
        return error(500, f"script exhausted for model {model!r}"), request

    def start(self) -> ModelServer:
        """Serve in a daemon thread."""
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="tether-model-server", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> ModelServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _completion(body: dict[str, Any], a: Answer) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": a.text}
    if a.tool_calls:
        message["tool_calls"] = [
            {
                "id": f"call_{i}",
                "type": "function",
                "function": {
                    "name": name,
                    "arguments": args if isinstance(args, str) else json.dumps(args),
                },
            }
            for i, (name, args) in enumerate(a.tool_calls)
        ]
    usage: dict[str, Any] = {
        "prompt_tokens": a.input_tokens,
        "completion_tokens": a.output_tokens,
        "total_tokens": a.input_tokens + a.output_tokens,
    }
    if a.cached_tokens:
        usage["prompt_tokens_details"] = {"cached_tokens": a.cached_tokens}
    return {
        "id": "chatcmpl-scripted",
        "object": "chat.completion",
        "created": 0,
        "model": body.get("model", ""),
        "choices": [{"index": 0, "message": message, "finish_reason": a.finish_reason}],
        "usage": usage,
    }


#: OpenAI finish reasons as Anthropic stop reasons
_STOP_REASONS = {
    "stop": "end_turn",
    "tool_calls": "tool_use",
    "length": "max_tokens",
    "content_filter": "refusal",
}


def _anthropic_message(body: dict[str, Any], a: Answer) -> dict[str, Any]:
    """The answer as an Anthropic Messages API response."""
    content: list[dict[str, Any]] = []
    if a.text is not None:
        content.append({"type": "text", "text": a.text})
    for i, (name, args) in enumerate(a.tool_calls):
        if isinstance(args, str):  # a broken argument string: Anthropic sends objects only
            try:
                args = json.loads(args)
            except ValueError:
                args = {"_raw": args}
        content.append({"type": "tool_use", "id": f"toolu_{i}", "name": name, "input": args})
    return {
        "id": "msg_scripted",
        "type": "message",
        "role": "assistant",
        "model": body.get("model", ""),
        "content": content,
        "stop_reason": _STOP_REASONS.get(a.finish_reason, a.finish_reason),
        "stop_sequence": None,
        "usage": {
            "input_tokens": a.input_tokens - a.cached_tokens,
            "output_tokens": a.output_tokens,
            "cache_read_input_tokens": a.cached_tokens,
            "cache_creation_input_tokens": 0,
        },
    }


def _anthropic_error(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


def _chunks(body: dict[str, Any], a: Answer) -> list[dict[str, Any]]:
    """A text answer as OpenAI ``chat.completion.chunk`` objects, then the usage."""
    base = {
        "id": "chatcmpl-scripted",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": body.get("model", ""),
    }
    words = [w + " " for w in (a.text or "").split(" ")] if a.text else []
    if words:
        words[-1] = words[-1][:-1]
    out = [
        {
            **base,
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": w}, "finish_reason": None}
            ],
        }
        for w in words
    ]
    for i, (name, args) in enumerate(a.tool_calls or ()):
        call = {
            "index": i,
            "id": f"call_{i}",
            "type": "function",
            "function": {
                "name": name,
                "arguments": args if isinstance(args, str) else json.dumps(args),
            },
        }
        out.append(
            {
                **base,
                "choices": [{"index": 0, "delta": {"tool_calls": [call]}, "finish_reason": None}],
            }
        )
    finish = a.finish_reason or ("tool_calls" if a.tool_calls else "stop")
    out.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    out.append(
        {
            **base,
            "choices": [],
            "usage": {
                "prompt_tokens": a.input_tokens,
                "completion_tokens": a.output_tokens,
                "total_tokens": a.input_tokens + a.output_tokens,
            },
        }
    )
    return out

"""A provider batch API for tests, served by ``ModelServer`` (OpenAI's shape): upload a
JSONL file of requests, create a batch, poll it, download its output and error files.

Each request line is answered like a chat request to the server (its scripts or
``default``). Failure cases are set per custom id: ``fail_once`` (an error line the
first time the id is in a batch), ``drop_once`` (left out of the first output),
``unknown`` (ids the first output adds that were never asked).
"""

from __future__ import annotations

import email.parser
import email.policy
import json
import threading
import time
from collections.abc import Callable
from typing import Any

#: answers one request body: (HTTP status, the chat completion JSON)
Answerer = Callable[[dict[str, Any]], tuple[int, dict[str, Any]]]


class FakeBatches:
    """The batch endpoints' state; ``created`` counts batches made."""

    def __init__(self, answer: Answerer) -> None:
        self._answer = answer
        self._lock = threading.Lock()
        self.files: dict[str, bytes] = {}
        self.batches: dict[str, dict[str, Any]] = {}
        #: seconds a batch takes from creation to completion
        self.complete_after = 0.5
        self.fail_once: set[str] = set()
        self.drop_once: set[str] = set()
        self.unknown: list[str] = []
        self._failed: set[str] = set()
        self._dropped: set[str] = set()
        self._unknown_sent = False

    @property
    def created(self) -> int:
        """Batches created so far."""
        with self._lock:
            return len(self.batches)

    # -- the endpoints (path, body) -> (status, JSON or bytes) -------------------------

    def upload(self, content_type: str, raw: bytes) -> dict[str, Any]:
        """``POST /v1/files`` (multipart, purpose=batch)."""
        message = email.parser.BytesParser(policy=email.policy.default).parsebytes(
            f"Content-Type: {content_type}\r\n\r\n".encode() + raw
        )
        data = b""
        for part in message.iter_parts():
            if part.get_param("name", header="content-disposition") == "file":
                payload = part.get_payload(decode=True)
                data = payload if isinstance(payload, bytes) else b""
        with self._lock:
            fid = f"file-{len(self.files) + 1}"
            self.files[fid] = data
        return _file(fid, len(data))

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        """``POST /v1/batches``."""
        with self._lock:
            bid = f"batch_{len(self.batches) + 1}"
            self.batches[bid] = {
                "id": bid,
                "object": "batch",
                "endpoint": body.get("endpoint", "/v1/chat/completions"),
                "input_file_id": body["input_file_id"],
                "completion_window": body.get("completion_window", "24h"),
                "status": "in_progress",
                "output_file_id": None,
                "error_file_id": None,
                "created_at": int(time.time()),
                "metadata": body.get("metadata") or {},
                "_created": time.monotonic(),
            }
            return _public(self.batches[bid])

    def retrieve(self, bid: str) -> dict[str, Any] | None:
        """``GET /v1/batches/{id}``: completes the batch once its time has come."""
        with self._lock:
            batch = self.batches.get(bid)
            if batch is None:
                return None
            ready = time.monotonic() - batch["_created"] >= self.complete_after
            if batch["status"] == "in_progress" and ready:
                self._complete(batch)
            return _public(batch)

    def listing(self, limit: int = 20, after: str | None = None) -> dict[str, Any]:
        """``GET /v1/batches?limit=&after=``: newest first, a page at a time as OpenAI's
        (``limit`` 1 to 100, default 20; ``after`` the last id of the previous page)."""
        limit = max(1, min(int(limit), 100))
        with self._lock:
            newest = list(reversed(list(self.batches.values())))
        if after is not None:
            ids = [b["id"] for b in newest]
            newest = newest[ids.index(after) + 1 :] if after in ids else []
        data = [_public(b) for b in newest[:limit]]
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": len(newest) > limit,
        }

    def content(self, fid: str) -> bytes | None:
        """``GET /v1/files/{id}/content``."""
        with self._lock:
            return self.files.get(fid)

    # -- running a batch -----------------------------------------------------------

    def _complete(self, batch: dict[str, Any]) -> None:
        lines = [json.loads(x) for x in self.files[batch["input_file_id"]].splitlines() if x]
        out: list[dict[str, Any]] = []
        errors: list[dict[str, Any]] = []
        for line in lines:
            cid = line["custom_id"]
            if cid in self.fail_once and cid not in self._failed:
                self._failed.add(cid)
                errors.append(
                    {
                        "id": f"req-{cid}",
                        "custom_id": cid,
                        "response": None,
                        "error": {"code": "server_error", "message": f"request {cid} failed"},
                    }
                )
                continue
            if cid in self.drop_once and cid not in self._dropped:
                self._dropped.add(cid)
                continue
            status, completion = self._answer(line["body"])
            out.append(
                {
                    "id": f"req-{cid}",
                    "custom_id": cid,
                    "response": {"status_code": status, "body": completion},
                    "error": None,
                }
            )
        if self.unknown and not self._unknown_sent:
            self._unknown_sent = True
            for cid in self.unknown:
                out.append({"id": f"req-{cid}", "custom_id": cid, "response": None, "error": None})
        batch["status"] = "completed"
        batch["output_file_id"] = self._store_file(out)
        batch["error_file_id"] = self._store_file(errors) if errors else None
        batch["request_counts"] = {
            "total": len(lines),
            "completed": len(out),
            "failed": len(errors),
        }

    def _store_file(self, lines: list[dict[str, Any]]) -> str:
        fid = f"file-{len(self.files) + 1}"
        self.files[fid] = "\n".join(json.dumps(x) for x in lines).encode()
        return fid


def _public(batch: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in batch.items() if not k.startswith("_")}


def _file(fid: str, size: int) -> dict[str, Any]:
    return {
        "id": fid,
        "object": "file",
        "bytes": size,
        "created_at": int(time.time()),
        "filename": "batch.jsonl",
        "purpose": "batch",
        "status": "processed",
    }

"""A WSGI app using the blocking client, served by ``wsgiref`` in a subprocess:
``python tests/wsgi_app.py STORE PORT``. ``GET /start?n=N`` starts ``double(N)`` and
answers its run id; ``GET /result?id=ID`` blocks for the run's result. No worker runs
in this process: the test runs one on the same store.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIServer, make_server

import tether


def build_app(store: str) -> tether.App:
    app = tether.App(store=store)

    @app.activity
    def times_two(n: int) -> int:
        return 2 * n

    @app.workflow
    async def double(n: int) -> int:
        return await times_two(n)

    return app


def wsgi(client: tether.SyncClient) -> Callable[..., Iterable[bytes]]:
    def application(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        query = parse_qs(environ.get("QUERY_STRING", ""))
        path = environ["PATH_INFO"]
        if path == "/start":
            run = client.start("double", int(query["n"][0]))
            body: Any = {"id": run.run_id}
        elif path == "/result":
            body = {"result": client.get_run(query["id"][0]).result(timeout=20)}
        else:
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not found"]
        start_response("200 OK", [("Content-Type", "application/json")])
        return [json.dumps(body).encode()]

    return application


def main(store: str, port: int) -> None:
    client = tether.SyncClient(build_app(store))
    server: WSGIServer = make_server("127.0.0.1", port, wsgi(client))
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))

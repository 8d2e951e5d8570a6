"""Problem documents of a real ``tether serve`` that say what was wrong."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from test_http_api import Server


@pytest.fixture
def served(store_url: str) -> Iterator[Server]:
    s = Server(store_url, "--no-auth")
    yield s
    s.stop()


def test_a_start_of_a_workflow_the_service_does_not_have_names_it(served: Server) -> None:
    r = served.http.post("/v1/workflows/nope/runs", json={"input": {}})
    assert r.status_code == 404
    assert r.headers["content-type"] == "application/problem+json"
    detail = r.json()["detail"]
    assert "'nope'" in detail and "approve" in detail and "GET /v1/workflows" in detail, detail
    r = served.http.post("/v1/workflows/approve/runs", json={"input": {"doc": "d"}})
    assert r.status_code == 202, r.text  # the service's own workflows still start
    assert "/v1/workflows/{name}/runs" not in served.http.get("/openapi.json").json()["paths"]

"""The HTTP service under load: ``tether serve`` with in-process workers, on SQLite.

``python bench/serve.py [--runs N] [--clients C]`` starts ``tether serve`` in a child
process (one worker in it) on a fresh SQLite file and, from this process over real
sockets, measures:

* ``start``: ``POST /v1/workflows/{name}/runs`` until the ``202``;
* ``start + result``: that plus ``GET /v1/runs/{id}/result?wait=30`` until the result
  of a one-step run;
* throughput of ``start + result`` with C concurrent clients.

Next to them, the raw commit rate of the same disk (LIMIT, as in ``bench/run.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).parent))

from run import FULL, _percentile, bench_limit, check

APP = textwrap.dedent(
    """
    import os
    import tether

    app = tether.App(store=os.environ["BENCH_STORE"])

    @app.activity
    async def double(x: int) -> int:
        return 2 * x

    @app.workflow
    async def one_step(x: int) -> int:
        return await double(x)
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    (workdir / "bench_http_app.py").write_text(APP)
    port = _free_port()
    env = {**os.environ, "BENCH_STORE": f"sqlite:///{workdir / 'tether.db'}"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tether.cli",
            "serve",
            "bench_http_app:app",
            "--port",
            str(port),
            "--workers",
            "1",
            "--no-auth",
        ],
        cwd=workdir,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(f"{base}/v1/workflows", timeout=2)
            return proc, base
        except httpx.TransportError:
            check(proc.poll() is None and time.monotonic() < deadline, "tether serve did not start")
            time.sleep(0.1)


def _one(http: httpx.Client, i: int, wait: bool) -> tuple[float, float]:
    t0 = time.perf_counter()
    res = http.post("/v1/workflows/one_step/runs", json={"input": {"x": i}})
    check(res.status_code == 202, f"start answered {res.status_code}: {res.text}")
    started = time.perf_counter()
    if wait:
        out = http.get(f"{res.json()['links']['result']}?wait=30")
        check(out.status_code == 200 and out.json()["result"] == 2 * i, f"result: {out.text}")
    return (started - t0) * 1000, (time.perf_counter() - t0) * 1000


def measure(base: str, runs: int, clients: int) -> dict[str, Any]:
    with httpx.Client(base_url=base, timeout=60) as http:
        for i in range(20):  # warm up
            _one(http, i, True)
        starts = [_one(http, i, False)[0] for i in range(runs)]
        both = [_one(http, i, True)[1] for i in range(runs)]

    def client(k: int) -> int:
        with httpx.Client(base_url=base, timeout=60) as http:
            for i in range(runs // clients):
                _one(http, k * 100_000 + i, True)
        return runs // clients

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        done = sum(pool.map(client, range(clients)))
    elapsed = time.perf_counter() - t0
    return {
        "start_p50_ms": _percentile(starts, 50),
        "start_p99_ms": _percentile(starts, 99),
        "start_result_p50_ms": _percentile(both, 50),
        "start_result_p99_ms": _percentile(both, 99),
        "runs_per_s": done / elapsed,
        "clients": clients,
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tether-http-bench-") as tmp:
        workdir = Path(tmp)
        limit = bench_limit(workdir, FULL)
        proc, base = _serve(workdir)
        try:
            res = measure(base, args.runs, args.clients)
        finally:
            proc.terminate()
            proc.wait(30)
    per_commit = 1000 / limit["commits_per_s"]
    print(f"LIMIT: {limit['commits_per_s']:,.0f} commits/s ({per_commit:.3f} ms/commit)")
    print(
        f"start (202)           p50 {res['start_p50_ms']:6.2f} ms  "
        f"p99 {res['start_p99_ms']:6.2f} ms"
    )
    print(
        f"start + result        p50 {res['start_result_p50_ms']:6.2f} ms  "
        f"p99 {res['start_result_p99_ms']:6.2f} ms"
    )
    print(
        f"{res['clients']} clients, start + result: {res['runs_per_s']:,.0f} runs/s "
        f"({res['runs_per_s'] / limit['commits_per_s']:.2f} x LIMIT)"
    )
    print(json.dumps({"limit": limit, **res}, indent=2))


if __name__ == "__main__":
    main()

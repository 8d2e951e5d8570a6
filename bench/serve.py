"""The HTTP service under load: ``tether serve`` with in-process workers, on SQLite.

``python bench/serve.py [--runs N] [--clients C]`` starts ``tether serve`` in a child
process (one worker in it) on a fresh SQLite file and, from this process over real
sockets, measures:

* ``start``: ``POST /v1/workflows/{name}/runs`` until the ``202``;
* ``start + result``: that plus ``GET /v1/runs/{id}/result?wait=30`` until the result
  of a one-step run;
* throughput of ``start + result`` with C concurrent clients;
* starts/s and POST -> 202 latency with S (50) concurrent keep-alive clients that only
  start, next to ``app.start`` in-process on the same disk (the same S concurrent
  callers, no HTTP) measured in the same run;
* the time from a signal's POST until its ``SignalReceived`` event reaches a client
  following the run's SSE stream (an upper bound of commit -> SSE event).

Next to them, the raw commit rate of the same disk (LIMIT, as in ``bench/run.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
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

    @app.workflow
    async def pinger(n: int) -> int:
        for _ in range(n):
            await tether.wait_event("ping")
        return n
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


def _load(base: str, clients: int, per: int, interval: float | None) -> tuple[list[float], float]:
    """``clients`` keep-alive clients start ``per`` runs each, back to back (``interval``
    None: a closed loop) or one every ``interval`` seconds each (an open loop);
    returns the POST -> 202 latencies (ms) and the seconds it all took."""
    barrier = threading.Barrier(clients + 1)

    def client(k: int) -> list[float]:
        out = []
        with httpx.Client(base_url=base, timeout=60) as http:
            http.get("/healthz")  # the connection is open before the clock starts
            barrier.wait()
            t_next = time.perf_counter() + (k * interval / clients if interval else 0.0)
            for i in range(per):
                if interval:
                    pause = t_next - time.perf_counter()
                    if pause > 0:
                        time.sleep(pause)
                    t_next += interval
                t0 = time.perf_counter()
                res = http.post("/v1/workflows/one_step/runs", json={"input": {"x": k * per + i}})
                check(res.status_code == 202, f"start answered {res.status_code}: {res.text}")
                out.append((time.perf_counter() - t0) * 1000)
        return out

    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(client, k) for k in range(clients)]
        barrier.wait()
        t0 = time.perf_counter()
        lat = [x for f in futures for x in f.result()]
        return lat, time.perf_counter() - t0


def measure_starts(base: str, starts: int, clients: int) -> dict[str, Any]:
    """S keep-alive clients that only start runs: starts/s and POST -> 202 latency."""
    lat, elapsed = _load(base, clients, starts // clients, None)
    return {
        "starts_per_s": len(lat) / elapsed,
        "start_load_p50_ms": _percentile(lat, 50),
        "start_load_p99_ms": _percentile(lat, 99),
        "start_clients": clients,
    }


def measure_paced(base: str, rate: float, seconds: float, clients: int) -> dict[str, Any]:
    """S keep-alive clients that together offer ``rate`` starts/s (each on its own
    schedule, an open loop): POST -> 202 latency at that load."""
    interval = clients / rate
    lat, elapsed = _load(base, clients, max(1, int(seconds / interval)), interval)
    return {
        "paced_rate": rate,
        "paced_achieved": len(lat) / elapsed,
        "paced_p50_ms": _percentile(lat, 50),
        "paced_p99_ms": _percentile(lat, 99),
    }


def measure_in_process(workdir: Path, starts: int, clients: int) -> float:
    """``app.start`` rate in this process (S concurrent callers, no worker), same disk."""
    sys.path.insert(0, str(workdir))
    os.environ["BENCH_STORE"] = f"sqlite:///{workdir / 'inproc.db'}"
    import bench_http_app

    app = bench_http_app.app

    async def go() -> float:
        per = starts // clients

        async def caller(k: int) -> None:
            for i in range(per):
                await app.start("one_step", k * per + i)

        await app.start("one_step", -1)  # open the store
        t0 = time.perf_counter()
        await asyncio.gather(*(caller(k) for k in range(clients)))
        rate = per * clients / (time.perf_counter() - t0)
        await app.close()
        return rate

    return asyncio.run(go())


def measure_sse(base: str, pings: int) -> dict[str, Any]:
    """POST a signal, time until its SignalReceived event arrives on the SSE stream."""
    seen: queue.SimpleQueue[float] = queue.SimpleQueue()
    with httpx.Client(base_url=base, timeout=60) as http:
        run = http.post("/v1/workflows/pinger/runs", json={"input": {"n": pings}}).json()

        def follow() -> None:
            with (
                httpx.Client(base_url=base, timeout=60) as c,
                c.stream("GET", run["links"]["events"]) as stream,
            ):
                for line in stream.iter_lines():
                    if line == "event: SignalReceived":
                        seen.put(time.perf_counter())

        reader = threading.Thread(target=follow, daemon=True)
        reader.start()
        time.sleep(0.5)
        lat = []
        for _ in range(pings):
            t0 = time.perf_counter()
            res = http.post(f"/v1/runs/{run['id']}/signals/ping", json={})
            check(res.status_code == 202, f"signal answered {res.status_code}")
            lat.append((seen.get(timeout=10) - t0) * 1000)
        reader.join(10)
    return {"sse_p50_ms": _percentile(lat, 50), "sse_p99_ms": _percentile(lat, 99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--starts", type=int, default=3000)
    parser.add_argument("--start-clients", type=int, default=50)
    parser.add_argument("--pings", type=int, default=100)
    parser.add_argument("--paced-rate", type=float, default=500.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tether-http-bench-") as tmp:
        workdir = Path(tmp)
        limit = bench_limit(workdir, FULL)
        proc, base = _serve(workdir)
        try:
            res = measure(base, args.runs, args.clients)
            res |= measure_sse(base, args.pings)
            res |= measure_starts(base, args.starts, args.start_clients)
            res |= measure_paced(base, args.paced_rate, 4.0, args.start_clients)
        finally:
            proc.terminate()
            proc.wait(30)
        res["inproc_starts_per_s"] = measure_in_process(workdir, args.starts, args.start_clients)
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
    print(
        f"{res['start_clients']} clients, starts only: {res['starts_per_s']:,.0f} starts/s, "
        f"POST -> 202 p50 {res['start_load_p50_ms']:.2f} ms p99 {res['start_load_p99_ms']:.2f} ms"
    )
    print(
        f"{res['start_clients']} clients offering {res['paced_rate']:,.0f} starts/s "
        f"(achieved {res['paced_achieved']:,.0f}): POST -> 202 p50 {res['paced_p50_ms']:.2f} ms "
        f"p99 {res['paced_p99_ms']:.2f} ms"
    )
    print(
        f"in-process app.start, {res['start_clients']} callers: "
        f"{res['inproc_starts_per_s']:,.0f} starts/s "
        f"(HTTP is {res['starts_per_s'] / res['inproc_starts_per_s']:.2f} x of it; "
        f"{res['inproc_starts_per_s'] / limit['commits_per_s']:.2f} x LIMIT)"
    )
    print(
        f"signal POST -> its SSE event p50 {res['sse_p50_ms']:.2f} ms  "
        f"p99 {res['sse_p99_ms']:.2f} ms"
    )
    print(json.dumps({"limit": limit, **res}, indent=2))


if __name__ == "__main__":
    main()

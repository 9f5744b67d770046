"""serve: time to first chunk and request latency of the demo over HTTP (SSE through ``omni
serve``), against ``Pipeline.stream`` called directly, at several concurrencies.

- http: a real ``omni serve demo`` process; ``concurrency`` httpx clients each post streamed
  requests (``"stream": true``) back to back; time to first chunk = until the first
  ``event: chunk`` line arrived, latency = until the ``event: result`` line.
- direct: the same pipeline config started in this process, ``concurrency`` tasks each iterating
  ``Pipeline.stream`` back to back; the same two times.

Both pipelines run during the whole scenario, and rounds alternate between them so both see the
same machine load. The ratio http/direct is the overhead of the serving edge (HTTP, JSON, SSE, one
more process hop for the bytes).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import tempfile
import time
from typing import Any

from . import common

NAME = "serve"
SIZES = {
    "quick": {"concurrency": [1, 4], "requests_per_client": 2, "rounds": 1, "max_tokens": 6},
    "full": {"concurrency": [1, 16, 64], "requests_per_client": 2, "rounds": 2, "max_tokens": 13},
}
IMPLS = {"http": "omni serve (HTTP + SSE)", "direct": "Pipeline.stream"}


def _inputs(max_tokens: int) -> dict[str, Any]:
    return {"text": "hello omni", "max_tokens": max_tokens}


async def _direct(pipeline: Any, concurrency: int, per_client: int, inputs: dict) -> list[tuple[float, float]]:
    async def client() -> list[tuple[float, float]]:
        out = []
        for _ in range(per_client):
            t0 = time.perf_counter()
            first = None
            async for event in pipeline.stream(inputs):
                if first is None and not event.is_result:
                    first = time.perf_counter() - t0
            out.append((first if first is not None else float("nan"), time.perf_counter() - t0))
        return out

    return [x for part in await asyncio.gather(*(client() for _ in range(concurrency))) for x in part]


async def _http(url: str, concurrency: int, per_client: int, inputs: dict) -> list[tuple[float, float]]:
    import httpx

    body = {"input": inputs, "stream": True}

    async def client(http: Any) -> list[tuple[float, float]]:
        out = []
        for _ in range(per_client):
            t0 = time.perf_counter()
            first = None
            async with http.stream("POST", f"{url}/v1/pipelines/demo/requests", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:500]}")
                event = None
                async for line in r.aiter_lines():
                    if line.startswith("event: "):
                        event = line[7:]
                        if event == "chunk" and first is None:
                            first = time.perf_counter() - t0
                        elif event == "error":
                            raise RuntimeError("the stream ended with an error event")
            out.append((first if first is not None else float("nan"), time.perf_counter() - t0))
        return out

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    # TCP_NODELAY, as curl and browsers set it: without it the body, written after the headers,
    # waits for the server's delayed ACK (about 40 ms on Linux) and the bench measures that.
    transport = httpx.AsyncHTTPTransport(limits=limits, socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
    async with httpx.AsyncClient(timeout=300, transport=transport) as http:
        parts = await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return [x for part in parts for x in part]


def run(params: dict[str, Any], *, quick: bool, ray: bool) -> dict[str, Any]:
    from omni_core import Pipeline
    from omni_core.testing.serve import ServerProcess

    doc = common.result(NAME, quick=quick, parameters=params)
    inputs = _inputs(params["max_tokens"])
    per = params["requests_per_client"]
    samples: dict[tuple[int, str], list[tuple[float, float]]] = {}
    workdir = tempfile.mkdtemp(prefix="omni-bench-serve-")  # the demo's WAV files land here
    server = ServerProcess("demo", "--drain-timeout", "5", cwd=workdir, env={"OMNI_LOG_LEVEL": "warning"})
    cwd = os.getcwd()
    with common.Loop() as loop:
        server.start()
        os.chdir(workdir)
        pipeline = Pipeline("demo")
        try:
            loop.run(pipeline.start())
            loop.run(_direct(pipeline, 1, 1, inputs))  # warm both up
            loop.run(_http(server.url, 1, 1, inputs))
            for i, order in enumerate(common.rounds(list(IMPLS), params["rounds"])):
                for n in params["concurrency"]:
                    for impl in order:
                        common.log(f"serve: round {i + 1}, concurrency {n}, {IMPLS[impl]}")
                        if impl == "http":
                            got = loop.run(_http(server.url, n, per, inputs))
                        else:
                            got = loop.run(_direct(pipeline, n, per, inputs))
                        samples.setdefault((n, impl), []).extend(got)
        finally:
            loop.run(pipeline.stop())
            os.chdir(cwd)
            code = server.stop()
            if code != 0:
                doc["notes"].append(f"omni serve exited with {code}")
            left = server.leftovers()
            if left:
                doc["notes"].append(f"omni serve left behind: {left}")
    for (n, impl), got in sorted(samples.items()):
        doc["rows"].append({
            "concurrency": n, "impl": impl, "requests": len(got),
            "ttfc_s": common.summarize(t for t, _ in got),
            "latency_s": common.summarize(latency for _, latency in got),
        })
    for n in params["concurrency"]:
        http, direct = _get(doc, n, "http"), _get(doc, n, "direct")
        if http and direct:
            doc["ratios"][str(n)] = {
                "ttfc p50 http/direct": common.ratio(http["ttfc_s"]["median"], direct["ttfc_s"]["median"]),
                "latency p50 http/direct": common.ratio(http["latency_s"]["median"], direct["latency_s"]["median"]),
                "latency p99 http/direct": common.ratio(http["latency_s"]["p99"], direct["latency_s"]["p99"]),
            }
    doc["checks"]["every request over HTTP completed"] = all(
        r["requests"] == n * per * params["rounds"] for r in doc["rows"] for n in [r["concurrency"]])
    doc["checks"]["omni serve exited 0 and left nothing"] = not doc["notes"]
    doc["notes"].append(f"demo inputs {json.dumps(inputs)}; {per} request(s) per client per round")
    return doc


def _get(doc: dict[str, Any], n: int, impl: str) -> dict[str, Any] | None:
    return next((r for r in doc["rows"] if r["concurrency"] == n and r["impl"] == impl), None)


def summary(doc: dict[str, Any]) -> str:
    headers = ["concurrency", "direct ttfc p50 ms", "http ttfc p50 ms", "direct p50 ms", "http p50 ms",
               "http p99 ms", "ttfc http/direct", "latency http/direct"]
    rows = []
    for n in sorted({r["concurrency"] for r in doc["rows"]}):
        d, h = _get(doc, n, "direct") or {}, _get(doc, n, "http") or {}
        ratios = doc["ratios"].get(str(n), {})

        def ms(row: dict, key: str, stat: str = "median") -> float | None:
            value = row.get(key, {}).get(stat)
            return None if value is None else value * 1000

        rows.append([n, ms(d, "ttfc_s"), ms(h, "ttfc_s"), ms(d, "latency_s"), ms(h, "latency_s"),
                     ms(h, "latency_s", "p99"), ratios.get("ttfc p50 http/direct"), ratios.get("latency p50 http/direct")])
    return "demo over HTTP (SSE) against Pipeline.stream (ratio 1.0 = no overhead)\n" + common.table(headers, rows)


def plot(doc: dict[str, Any], path: str, plt: Any) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    ns = sorted({r["concurrency"] for r in doc["rows"]})
    for ax, key, title in zip(axes, ("ttfc_s", "latency_s"), ("time to first chunk", "request latency"), strict=True):
        for impl, label in IMPLS.items():
            pts = [(n, (_get(doc, n, impl) or {}).get(key, {}).get("median")) for n in ns]
            pts = [(n, v * 1000) for n, v in pts if v is not None]
            ax.plot([n for n, _ in pts], [v for _, v in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel("ms (median)")
        ax.set_title(f"serve: {title}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)

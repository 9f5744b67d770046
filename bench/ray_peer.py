"""The optional peer baseline: a Ray Compiled Graph chain of the same shape as the omni chain.

Runs in its own process (``python -m bench.ray_peer SPEC.json OUT.json``) so Ray's daemons and
threads never share a process with the other measurements, and a Ray that cannot start costs a
message, not the run. Each actor is a separate worker process whose method returns its input;
the driver runs ``execute`` → ``ray.get`` per request (hop) or keeps ``concurrency`` executions in
flight (throughput). The raw pyzmq chain is measured in the same phase, interleaved, so the
Ray / raw pyzmq ratio is taken under the same load as Ray itself.

Install with ``pip install -e '.[bench]'`` (the ``bench`` extra pulls ``ray``).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import sys
import time
import traceback
from typing import Any

from .baselines import ZmqChain
from .common import rounds, summarize


def available() -> str | None:
    """None when Ray can be imported, else why not."""
    try:
        import ray  # noqa: F401
        from ray.dag import InputNode  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the environment
        return f"ray is not installed ({type(exc).__name__}: {exc}); pip install -e '.[bench]'"
    return None


class RayChain:
    label = "Ray Compiled Graph"

    def __init__(self, n: int, max_inflight: int = 16):
        import ray
        from ray.dag import InputNode

        @ray.remote(num_cpus=0)
        class Stage:
            def f(self, x: Any) -> Any:
                return x

        self.ray = ray
        self.actors = [Stage.remote() for _ in range(n)]
        with InputNode() as inp:
            node = inp
            for actor in self.actors:
                node = actor.f.bind(node)
        self.dag = node.experimental_compile(_max_inflight_executions=max_inflight)
        self.request({"ping": 1})

    def request(self, payload: Any) -> Any:
        return self.ray.get(self.dag.execute(payload))

    def pipelined(self, payload: Any, concurrency: int, duration: float) -> tuple[int, float]:
        get, execute = self.ray.get, self.dag.execute
        t0 = time.perf_counter()
        end = t0 + duration
        window = collections.deque(execute(payload) for _ in range(concurrency))
        done = 0
        while window:
            get(window.popleft())
            done += 1
            if time.perf_counter() < end:
                window.append(execute(payload))
        return done, time.perf_counter() - t0

    def close(self) -> None:
        try:
            self.dag.teardown()
        finally:
            for actor in self.actors:
                self.ray.kill(actor)


def hop(spec: dict[str, Any]) -> dict[str, Any]:
    payload, out = spec["payload"], {}
    for n in spec["ns"]:
        chains: dict[str, Any] = {}
        try:
            chains["ray"] = RayChain(n)
            chains["zmq"] = ZmqChain(n)
            samples: dict[str, list[float]] = {k: [] for k in chains}
            for name in chains:
                for _ in range(spec["warmup"]):
                    chains[name].request(payload)
            for order in rounds(list(chains), spec["rounds"], seed=n):
                for name in order:
                    chain = chains[name]
                    for _ in range(spec["requests"]):
                        t0 = time.perf_counter()
                        chain.request(payload)
                        samples[name].append(time.perf_counter() - t0)
            out[str(n)] = {name: {"rtt_us": summarize(s, 1e6), "hop_us": summarize(s, 1e6 / (n + 1))} for name, s in samples.items()}
        except Exception as exc:
            out[str(n)] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        finally:
            for chain in chains.values():
                with contextlib.suppress(Exception):
                    chain.close()
    return out


def throughput(spec: dict[str, Any]) -> dict[str, Any]:
    payload, n, out = spec["payload"], spec["stages"], {}
    chains: dict[str, Any] = {}
    try:
        chains["ray"] = RayChain(n, max_inflight=max(spec["concurrency"]) + 1)
        chains["zmq"] = ZmqChain(n)
        for c in spec["concurrency"]:
            rates: dict[str, list[float]] = {k: [] for k in chains}
            for name in chains:
                chains[name].pipelined(payload, c, spec["warmup_s"])
            for order in rounds(list(chains), spec["rounds"], seed=c):
                for name in order:
                    done, elapsed = chains[name].pipelined(payload, c, spec["duration_s"])
                    rates[name].append(done / elapsed)
            out[str(c)] = {name: {"rps": summarize(r)} for name, r in rates.items()}
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc()
    finally:
        for chain in chains.values():
            with contextlib.suppress(Exception):
                chain.close()
    return out


def main(argv: list[str]) -> int:
    spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    # Read when ray is imported: a loaded 2-core machine needs more than the 10 s default.
    os.environ.setdefault("RAY_CGRAPH_get_timeout", "120")
    os.environ.setdefault("RAY_CGRAPH_submit_timeout", "120")
    why = available()
    if why:
        result = {"skipped": why}
    else:
        import ray

        t0 = time.perf_counter()
        # "local": a Ray of its own, never one that auto-detection finds on the machine
        ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
                 logging_level="ERROR")
        init_s = time.perf_counter() - t0
        try:
            result = {"ray_version": ray.__version__, "init_s": init_s}
            result.update({"hop": hop, "throughput": throughput}[spec["mode"]](spec))
        finally:
            ray.shutdown()
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


def run(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    """Run the peer in a fresh process; ``{"skipped": why}`` when Ray is missing or failed."""
    import importlib.util
    import subprocess
    import tempfile

    if importlib.util.find_spec("ray") is None:
        return {"skipped": "ray is not installed; pip install -e '.[bench]' to add the Ray peer"}
    with tempfile.TemporaryDirectory(prefix="omni-bench-ray-") as tmp:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        with open(spec_path, "w") as f:
            json.dump(spec, f)
        proc = subprocess.Popen([sys.executable, "-m", "bench.ray_peer", spec_path, out_path], cwd=_ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            proc.communicate()
            return {"skipped": f"the Ray peer did not finish within {timeout:g} s"}
        if proc.returncode != 0 or not os.path.exists(out_path):
            tail = (stderr or stdout or "").strip().splitlines()[-5:]
            return {"skipped": f"the Ray peer failed (exit code {proc.returncode}): {' / '.join(tail)}"}
        with open(out_path) as f:
            return json.load(f)


def _kill_tree(pid: int) -> None:
    """Kill the peer and every process it started (Ray's daemons), by pid."""
    import signal

    from .common import descendants

    for victim in [*descendants(pid), pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

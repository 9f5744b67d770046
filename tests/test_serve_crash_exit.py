"""``omni serve`` whose pipeline cannot go on (``restart: never`` and a stage process killed):
the request in flight fails, ``/health`` and ``/ready`` say why while the server is still up, and
the server exits non-zero within seconds, leaving nothing behind, so that systemd or Kubernetes
restart it. And the stage processes carry their names in ``ps``."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from omni_core.serve.server import PIPELINE_FAILED_EXIT
from omni_core.testing.serve import ServerProcess
from omni_core.testing.waiting import holds_within

pytestmark = pytest.mark.timeout(180)

HERE = Path(__file__).parent
CONFIG = str(HERE / "configs" / "serve" / "never.yaml")
REQUESTS = "/v1/pipelines/never/requests"
ENV = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}




def cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode().strip()


def test_stage_processes_carry_their_names_in_ps():
    server = ServerProcess(CONFIG, env=ENV).start()
    try:
        pids = httpx.get(f"{server.url}/v1/pipelines", timeout=30).json()["pipelines"][0]["processes"]
        assert set(pids) == {"shout", "words"}
        for process, pid in pids.items():
            assert cmdline(pid) == f"omni: never/{process}"
    finally:
        server.stop_cleanly()


def test_a_killed_stage_under_restart_never_fails_the_request_in_flight_and_the_server_exits_non_zero(tmp_path):
    server = ServerProcess(CONFIG, env=ENV).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            pid = client.get("/v1/pipelines").json()["pipelines"][0]["processes"]["words"]
            # A request waits in the words stage (for a gate that never opens) while the stage dies.
            answer: dict = {}

            def in_flight() -> None:
                try:
                    answer["response"] = httpx.post(f"{server.url}{REQUESTS}", timeout=60, json={
                        "input": {"text": "one two", "gate": str(tmp_path / "never-opened")}})
                except httpx.TransportError as exc:  # noqa: PERF203 - the answer is what we check
                    answer["error"] = exc

            worker = threading.Thread(target=in_flight)
            worker.start()
            assert holds_within(lambda: client.get("/metrics").text.count('omni_stage_in_flight{stage="words"} 1.0') == 1)
            os.kill(pid, signal.SIGKILL)
            # Meanwhile (until the server is gone) /health and /ready say why.
            seen = []

            def probe() -> bool:
                try:
                    r = client.get("/health")
                except httpx.TransportError:
                    return True  # already gone
                seen.append(r)
                return r.status_code == 503
            assert holds_within(probe, 10)
            worker.join(60)
            assert not worker.is_alive()
        start = time.monotonic()
        code = server.wait(30)
        assert code == PIPELINE_FAILED_EXIT, server.output()
        assert time.monotonic() - start < 15
    finally:
        server.stop()
    r = answer.get("response")
    assert r is not None, answer  # the request in flight was answered, not dropped
    assert r.status_code in (500, 503) and "words" in r.text, r.text
    failed = [x.json() for x in seen if x.status_code == 503]
    assert not failed or "error" in failed[-1]
    assert any("pipeline stopped: exiting" in line for line in server.lines), server.output()
    server.assert_nothing_left()

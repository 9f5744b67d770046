"""``omni serve`` when the process holding a request dies before its first event: with
``retry`` the request runs again once the process is back and the client gets its answer
(200); without, a 503 with ``Retry-After`` (never a 500). Counted in ``/metrics``."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import httpx
import pytest
from test_serve_http import metric

from omni_core.testing.serve import ServerProcess
from omni_core.testing.waiting import holds_within

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

HERE = Path(__file__).parent
ENV = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}




def _killed_mid_request(name: str, gate: Path) -> tuple[httpx.Response, str]:
    """POST ``{"gate": gate, "x": 5}``: the stage holds it until the test creates ``gate``, which it
    does once the stage's process was killed (a retry then runs to the end)."""
    server = ServerProcess(str(HERE / "configs" / "serve" / f"{name}.yaml"), env=ENV).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            answer: list[httpx.Response] = []
            sender = threading.Thread(target=lambda: answer.append(client.post(
                f"/v1/pipelines/{name}/requests", json={"input": {"gate": str(gate), "x": 5}})))
            sender.start()
            assert holds_within(lambda: metric(client.get("/metrics").text, "omni_requests_in_flight", pipeline=name) == 1)
            pid = client.get("/v1/pipelines").json()["pipelines"][0]["processes"]["nap"]
            os.kill(pid, signal.SIGKILL)
            gate.touch()
            sender.join(60)
            assert answer, "no answer"
            return answer[0], client.get("/metrics").text
    finally:
        server.stop()


def test_a_retryable_request_whose_process_died_is_answered(tmp_path):
    response, metrics = _killed_mid_request("retrying", tmp_path / "go")
    assert response.status_code == 200, response.text
    assert response.json()["result"] == {"gate": str(tmp_path / "go"), "x": 5}
    assert metric(metrics, "omni_request_retries_total", pipeline="retrying", error="ProcessDied") == 1


def test_without_retry_the_request_gets_503_with_retry_after_never_500(tmp_path):
    response, _ = _killed_mid_request("notretrying", tmp_path / "go")
    assert response.status_code == 503, response.text
    assert response.headers.get("Retry-After") and response.json()["error"]["type"] == "ProcessDied"

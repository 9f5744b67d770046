"""``omni serve`` when a stage process dies: a restart is counted in ``/metrics`` and the server
serves again; past the restart budget the pipeline stops and the server exits with status 3 (for its
supervisor to restart it), leaving nothing behind."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest
from test_serve_http import metric

from omni_core.testing.serve import ServerProcess
from omni_core.testing.waiting import holds_within

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

HERE = Path(__file__).parent
CONFIG = str(HERE / "configs" / "serve" / "restarting.yaml")
REQUESTS = "/v1/pipelines/restarting/requests"
ENV = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}




def pid_of(client: httpx.Client, process: str) -> int:
    return client.get("/v1/pipelines").json()["pipelines"][0]["processes"][process]


def test_a_restart_is_counted_then_a_second_death_stops_the_pipeline_and_the_server_says_so():
    server = ServerProcess(CONFIG, env=ENV).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            assert client.post(REQUESTS, json={"input": {"text": "before"}}).status_code == 200
            first = pid_of(client, "words")
            os.kill(first, signal.SIGKILL)
            # restart: on-failure (max 1): a new process, counted, and the server is ready again.
            assert holds_within(lambda: pid_of(client, "words") not in (first, None) and client.get("/ready").status_code == 200)
            assert holds_within(lambda: metric(client.get("/metrics").text, "omni_process_restarts_total", process="words") == 1)
            assert metric(client.get("/metrics").text, "omni_process_restarts_total", process="shout") == 0
            r = client.post(REQUESTS, json={"input": {"text": "after restart"}})
            assert r.status_code == 200 and r.json()["result"]["text"] == "AFTER RESTART"

            # Past max_restarts the pipeline stops and the server exits non-zero (its supervisor
            # restarts it); until it is gone, /health and requests answer 503 saying why.
            os.kill(pid_of(client, "words"), signal.SIGKILL)
            code = server.wait(30)
        assert code == 3, server.output()
        assert any("pipeline stopped: exiting" in line and "died" in line for line in server.lines), server.output()
    finally:
        server.stop()
    server.assert_nothing_left()


def test_a_server_that_never_gets_ready_is_stopped_by_the_failed_start(tmp_path):
    """``ServerProcess.start`` that gives up (the pipeline's factory waits forever) leaves no
    server, stage process, runtime dir or segment behind."""
    marker, gate = tmp_path / "marker", tmp_path / "gate"
    marker.write_text("started once")  # so Gate's factory waits for ``gate``, which never comes
    config = tmp_path / "stuck.yaml"
    config.write_text(
        "name: stuck\n"
        "stages:\n"
        "  - name: held\n"
        "    factory: omni_test_stages:Gate\n"
        f"    args: {{marker: {str(marker)!r}, gate: {str(gate)!r}}}\n"
        "    terminal: true\n"
        "limits: {stop_timeout: 5}\n"
    )
    server = ServerProcess(str(config), env=ENV, ready_timeout=8)
    with pytest.raises(RuntimeError, match="omni serve"):
        server.start()
    assert server.returncode is not None, "the failed start left the server running"
    assert holds_within(lambda: not server.leftovers(), 20), server.leftovers()

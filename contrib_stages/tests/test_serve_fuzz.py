"""A property-based fuzz of ``omni serve demo`` over its OpenAPI document (``GET /openapi.json``):
hypothesis draws requests for every operation the document lists (the core routes, the console's,
the OpenAI API's), in the shapes the document describes and far outside them (wrong types, unknown
fields, paths where files go, data URLs that are not media, huge numbers, bodies that are not JSON
or nest deeply, wrong methods and content types), with and without an API key set on the server.

No answer may be a 5xx: a client's mistake is a 4xx, and nothing the client sends may crash the
server (the one exception: a 504 for a request that set its own ``timeout``, which is the answer it
asked for). The server still answers ``/ready`` after, and stops cleanly. Seeded and bounded:
:data:`REQUESTS` requests per server, in batches sent concurrently (:mod:`omni_core.testing.fuzz`).
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from omni_core.testing.fuzz import DEMO_INPUTS, fuzz_server, fuzz_websocket
from omni_core.testing.serve import ServerProcess

pytestmark = pytest.mark.timeout(900)

ENV = {"OMNI_LOAD_PLUGINS": "contrib"}
KEY = "sk-fuzz-0123456789"

#: Requests per server (the keyed and the open one): 2 x 1,200 = 2,400 in all.
REQUESTS = int(os.environ.get("OMNI_FUZZ_REQUESTS", "1200"))
#: Realtime sessions per server (``/v1/realtime``), each a few generated messages.
WEBSOCKET_SESSIONS = int(os.environ.get("OMNI_FUZZ_SESSIONS", "60"))


@pytest.mark.parametrize("key", [None, KEY], ids=["open", "with-key"])
def test_no_request_drawn_from_the_openapi_document_gets_a_5xx(key, tmp_path):
    args = ["--api", "realtime", *(["--api-key", KEY] if key else [])]
    with ServerProcess("demo", *args, env=ENV, cwd=str(tmp_path), ready_timeout=300).serving(stop_timeout=120) as server:
        report = fuzz_server(server.url, pipeline="demo", inputs=DEMO_INPUTS, key=key, requests=REQUESTS)
        print(report.summary())
        assert report.total >= REQUESTS and not report.missed, report.summary()
        assert not report.findings, report.summary()
        websockets = httpx.get(f"{server.url}/openapi.json", headers={"Authorization": f"Bearer {key}"} if key else {},
                               timeout=30).json()["x-websockets"]
        assert websockets == ["/v1/realtime"]
        sessions = fuzz_websocket(server.url, "/v1/realtime", model="demo", key=key, sessions=WEBSOCKET_SESSIONS)
        print(sessions.summary())
        assert not sessions.findings, sessions.summary()
        assert httpx.get(f"{server.url}/ready", timeout=30).status_code == 200
        if key:
            assert report.statuses[401] > 0
    assert not list(Path(tmp_path).rglob("*.wav")), "a request wrote a file in the server's directory"

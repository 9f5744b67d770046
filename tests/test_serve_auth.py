"""``omni serve`` behind API keys (``--api-key``, ``--api-key-file``, ``OMNI_API_KEY``), public
routes, the console with a key, WebSockets (header and the ``openai-insecure-api-key.`` subprotocol),
TLS, the WebSocket refusal that names the API to mount, and ``/openapi.json``: real servers, the
official ``openai`` SDK, httpx and curl."""

from __future__ import annotations

import base64
import datetime
import json
import os
import shutil
import ssl
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from omni_core.errors import OmniError
from omni_core.serve.auth import ApiKeys, load_keys, presented_key, public_routes
from omni_core.testing.serve import ServerProcess

pytestmark = pytest.mark.timeout(300)

HERE = Path(__file__).parent
WORDS = str(HERE / "configs" / "serve" / "words.yaml")
ENV = {"PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]), "OMNI_LOAD_PLUGINS": "contrib"}
KEY = "sk-omni-test-0123456789"
FILE_KEY = "sk-omni-from-file"
ENV_KEY = "sk-omni-from-env"




# -- the rules, in-process ------------------------------------------------------------------------


def test_keys_come_from_flags_files_and_the_environment(tmp_path):
    keys = tmp_path / "keys.txt"
    keys.write_text("# operators\nsk-a\n\n  sk-b  \n")
    assert load_keys(["sk-c"], [str(keys)], env={"OMNI_API_KEY": "sk-d, sk-e"}) == ("sk-c", "sk-a", "sk-b", "sk-d", "sk-e")
    with pytest.raises(OmniError, match="no key in it"):
        (tmp_path / "empty").write_text("# nothing\n")
        load_keys([], [str(tmp_path / "empty")], env={})
    with pytest.raises(OmniError, match="cannot read it"):
        load_keys([], [str(tmp_path / "missing")], env={})
    with pytest.raises(OmniError, match="printable ASCII") as err:
        load_keys(["a key with spaces"], env={})
    assert "a key with spaces" not in str(err.value)  # a key is never shown


def test_public_routes_default_to_health_and_ready():
    assert public_routes(None) == ("/health", "/ready")
    assert public_routes(["/metrics", "health"]) == ("/metrics", "/health")
    assert public_routes(["none"]) == ()
    with pytest.raises(OmniError, match="only /health"):
        public_routes(["/v1/pipelines"])


def test_a_key_is_read_from_bearer_basic_or_the_websocket_subprotocol():
    keys = ApiKeys(["k1", "k2"])
    assert repr(keys) == "ApiKeys(2 key(s))"
    basic = base64.b64encode(b"anyone:k2")
    assert keys.check(presented_key({"type": "http", "headers": [(b"authorization", b"Bearer k1")]}))
    assert keys.check(presented_key({"type": "http", "headers": [(b"authorization", b"Basic " + basic)]}))
    assert keys.check(presented_key({"type": "websocket", "headers": [],
                                     "subprotocols": ["realtime", "openai-insecure-api-key.k2"]}))
    assert not keys.check(presented_key({"type": "http", "headers": [(b"authorization", b"Bearer k3")]}))
    assert not keys.check(presented_key({"type": "http", "headers": []}))
    assert not keys.check(presented_key({"type": "http", "subprotocols": ["openai-insecure-api-key.k1"], "headers": []}))


# -- a real server with keys --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(f"{FILE_KEY}\n")
    srv = ServerProcess(WORDS, "--api-key", KEY, "--api-key-file", str(key_file), "--drain-timeout", "5",
                        env={**ENV, "OMNI_API_KEY": ENV_KEY})
    with srv.serving():
        yield srv


def test_every_key_source_opens_the_core_routes_and_no_key_gets_401(server):
    url = f"{server.url}/v1/pipelines/words/requests"
    for key in (KEY, FILE_KEY, ENV_KEY):
        r = httpx.post(url, json={"input": {"text": "hi there"}}, headers={"Authorization": f"Bearer {key}"}, timeout=30)
        assert r.status_code == 200 and r.json()["result"]["text"] == "HI THERE"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Token " + KEY}):
        r = httpx.post(url, json={"input": {"text": "hi"}}, headers=headers, timeout=30)
        assert r.status_code == 401, r.text
        assert r.headers["www-authenticate"].startswith("Bearer")
        error = r.json()["error"]
        assert error["type"] == "Unauthorized" and "API key" in error["message"]  # the core shape
        assert KEY not in r.text
    for path in ("/v1/pipelines", "/v1/plugins", "/metrics", "/openapi.json", "/", "/console/state", "/nope"):
        assert httpx.get(server.url + path, timeout=30).status_code == 401, path
    assert all(KEY not in line and FILE_KEY not in line and ENV_KEY not in line for line in server.lines)


def test_health_and_ready_are_public_by_default(server):
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
    assert httpx.get(f"{server.url}/ready", timeout=30).status_code == 200


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl")
def test_curl_with_and_without_the_key(server):
    ok = subprocess.run(["curl", "-sS", "-H", f"Authorization: Bearer {KEY}", f"{server.url}/v1/pipelines"],
                        capture_output=True, text=True, timeout=60)
    assert json.loads(ok.stdout)["pipelines"][0]["name"] == "words"
    refused = subprocess.run(["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", f"{server.url}/v1/pipelines"],
                             capture_output=True, text=True, timeout=60)
    assert refused.stdout == "401"


def test_the_console_asks_the_browser_for_the_key_and_takes_it_as_basic_password(server):
    page = httpx.get(f"{server.url}/", timeout=30)
    assert page.status_code == 401
    assert any(v.startswith("Basic") for v in page.headers.get_list("www-authenticate"))
    auth = ("anyone", KEY)
    assert httpx.get(f"{server.url}/", auth=auth, timeout=30).headers["content-type"].startswith("text/html")
    assert httpx.get(f"{server.url}/console/state", auth=auth, timeout=30).json()["topology"]["pipeline"] == "words"
    with httpx.stream("GET", f"{server.url}/console/events", auth=auth, timeout=30) as events:
        assert events.status_code == 200
        first = next(events.iter_lines())
        assert first.startswith("event:")
    r = httpx.post(f"{server.url}/console/requests", auth=auth, json={"input": {"text": "play ground"}}, timeout=30)
    assert r.status_code == 200 and "PLAY GROUND" in r.text
    assert httpx.post(f"{server.url}/console/requests", auth=("anyone", "wrong"),
                      json={"input": {"text": "x"}}, timeout=30).status_code == 401


def test_the_openapi_document_lists_the_core_routes_and_the_key(server):
    doc = httpx.get(f"{server.url}/openapi.json", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    assert doc["openapi"].startswith("3.")
    for path in ("/health", "/ready", "/metrics", "/v1/plugins", "/v1/pipelines", "/v1/pipelines/{name}/requests"):
        assert path in doc["paths"], path
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    assert doc["paths"]["/health"]["get"]["security"] == []  # public
    assert "security" not in doc["paths"]["/metrics"]["get"]  # the document's default: a key


def test_a_websocket_no_api_serves_is_told_how_to_find_one(server):
    """No installed API serves the path here (omni-core alone): the refusal says how to find and
    mount one (contrib's tests check that an installed API is named: test_serve_auth_demo.py)."""
    from websockets.sync.client import connect

    with connect(f"{server.url.replace('http', 'ws')}/v1/nothing-serves-this",
                 additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        event = json.loads(ws.recv(timeout=30))
    assert event["type"] == "error"
    message = event["error"]["message"]
    assert "no WebSocket at /v1/nothing-serves-this" in message and "omni plugins list" in message, message


def test_a_websocket_without_a_key_is_refused_with_401(server):
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    with pytest.raises(InvalidStatus) as refused, connect(f"{server.url.replace('http', 'ws')}/v1/realtime"):
        pass
    assert refused.value.response.status_code == 401


class KeyedServer(ServerProcess):
    """A server whose /ready needs a key: its readiness is polled with the key."""

    def wait_ready(self, deadline: float | None = None) -> None:
        deadline = deadline or time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            assert self.proc is not None and self.proc.poll() is None, self.output()
            try:
                if httpx.get(f"{self.url}/ready", headers={"Authorization": f"Bearer {KEY}"}, timeout=5,
                             verify=False).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError("not ready in time:\n" + self.output())


def test_public_routes_are_configurable(tmp_path):
    srv = KeyedServer(WORDS, "--api-key", KEY, "--public-route", "/metrics", env=ENV, ready_timeout=120)
    with srv.serving():
        assert httpx.get(f"{srv.url}/metrics", timeout=30).status_code == 200
        assert httpx.get(f"{srv.url}/health", timeout=30).status_code == 401
        assert httpx.get(f"{srv.url}/ready", timeout=30).status_code == 401


def test_no_public_route_at_all(tmp_path):
    srv = KeyedServer(WORDS, "--api-key", KEY, "--public-route", "none", env=ENV, ready_timeout=120)
    with srv.serving():
        assert httpx.get(f"{srv.url}/ready", timeout=30).status_code == 401
        assert httpx.get(f"{srv.url}/health", timeout=30).status_code == 401


def test_a_bad_key_file_is_refused_before_anything_starts(tmp_path):
    srv = ServerProcess(WORDS, "--api-key-file", str(tmp_path / "missing.txt"), env=ENV, ready_timeout=60)
    with pytest.raises(RuntimeError, match="cannot read it"):
        srv.start()
    assert srv.returncode == 2


def test_serving_beyond_loopback_without_a_key_warns(tmp_path):
    class AnyAddress(ServerProcess):
        def serve_args(self):
            return ["serve", self.config, "--host", "0.0.0.0", "--port", "0", *self.args]

    with AnyAddress(WORDS, env=ENV, ready_timeout=120).serving() as srv:
        assert any("without an API key" in line and "warning" in line for line in srv.lines), srv.output()
    with ServerProcess(WORDS, env=ENV, ready_timeout=120).serving() as local:  # loopback: no warning
        assert not any("without an API key" in line for line in local.lines), local.output()


# -- TLS ------------------------------------------------------------------------------------------------


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_tls_serves_https_with_the_given_certificate(tmp_path):
    cert, key = self_signed(tmp_path)
    srv = KeyedServer(WORDS, "--api-key", KEY, "--ssl-certfile", str(cert), "--ssl-keyfile", str(key), env=ENV,
                      ready_timeout=120)
    with srv.serving():
        assert srv.url.startswith("https://")
        r = httpx.post(f"{srv.url}/v1/pipelines/words/requests", json={"input": {"text": "over tls"}},
                       headers={"Authorization": f"Bearer {KEY}"}, verify=ssl.create_default_context(cafile=str(cert)),
                       timeout=30)
        assert r.json()["result"]["text"] == "OVER TLS"
        with pytest.raises(httpx.ConnectError):  # an unknown certificate is refused by a verifying client
            httpx.get(f"{srv.url}/health", timeout=30)
        with pytest.raises(httpx.TransportError):  # no plain HTTP on the TLS port
            httpx.get(srv.url.replace("https", "http") + "/health", timeout=30)


def test_tls_needs_both_files(tmp_path):
    cert, _ = self_signed(tmp_path)
    srv = ServerProcess(WORDS, "--ssl-certfile", str(cert), env=ENV, ready_timeout=60)
    with pytest.raises(RuntimeError, match="--ssl-keyfile"):
        srv.start()
    assert srv.returncode == 1
    srv.assert_nothing_left()

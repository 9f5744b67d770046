"""APIs as plugins: a third-party distribution's ``omni_register_apis`` mounted by ``--api`` into
a real server; the CLI's answers to mistakes (no traceback); the pieces ``omni serve`` is made of
(the JSON encoding, the metrics store and its Prometheus page, the ``serve`` config field)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from plugin_fixtures import run_omni
from runtime_helpers import no_leaks, until  # noqa: F401

from omni_core.config import load_config
from omni_core.encoding import EncodingError, from_jsonable, to_jsonable
from omni_core.errors import ConfigError
from omni_core.metrics import BUCKETS, Store, merge, prometheus_text, restarts
from omni_core.testing.serve import ServerProcess

HERE = Path(__file__).parent
CONFIG = str(HERE / "configs" / "serve" / "words.yaml")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_third_party_api_is_mounted_through_the_hook(plugin_site_dir, tmp_path):
    config = Path(CONFIG).read_text() + "serve:\n  options:\n    acme.api: {greeting: hi}\n"
    server = ServerProcess.of_config(config, tmp_path, "--api", "acme.api", name="words", cwd=Path.cwd(),
                                     env={"OMNI_LOAD_PLUGINS": "good"}, pythonpath=[plugin_site_dir, HERE]).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            r = client.post("/v1/acme/echo", json={"text": "via plugin"})
            assert r.status_code == 200, r.text
            assert r.json() == {"acme": {"text": "VIA PLUGIN", "count": 2}, "pipeline": "words"}
            assert client.get("/v1/acme/options").json() == {"greeting": "hi"}
            # The API's requests go through the server: counted, and errors mapped.
            r = client.post("/v1/acme/echo", json={"text": "x", "fail_at_once": True})
            assert r.status_code == 500 and r.json()["error"]["stage"] == "words"
            assert client.get("/v1/pipelines").json()["pipelines"][0]["apis"] == ["acme.api"]
            good = next(p for p in client.get("/v1/plugins").json() if p["name"] == "good")
            assert good["registered"]["api"] == ["acme.api"]
            assert 'omni_requests_total{pipeline="words",status="ok"}' in client.get("/metrics").text
    finally:
        assert server.stop() == 0, server.output()
    server.assert_nothing_left()


def test_an_unknown_api_fails_before_anything_starts_with_the_known_names():
    result = run_omni("serve", CONFIG, "--port", "0", "--api", "opneai", pythonpath=HERE)
    assert result.returncode == 1
    assert "unknown API 'opneai'" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_a_config_error_is_printed_without_a_traceback(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nstages: []\nserve: {apis: openai, extra: 1}\n")
    result = run_omni("serve", str(bad), "--port", "0")
    assert result.returncode == 1
    assert "serve" in result.stderr and "Traceback" not in result.stderr


def test_a_taken_port_is_a_clear_error():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        result = run_omni("serve", CONFIG, "--port", str(port), pythonpath=HERE)
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "Traceback" not in result.stderr


# -- the serve config field ---------------------------------------------------------------------------


def test_the_serve_field_holds_apis_and_their_options():
    cfg = load_config({"name": "x", "stages": [{"name": "a", "factory": "m:f", "terminal": True}],
                       "serve": {"apis": "openai", "options": {"openai": {"text_stage": "a"}}}}, validate=False)
    assert cfg.serve.apis == ("openai",) and cfg.serve.options == {"openai": {"text_stage": "a"}}


def test_serve_options_must_be_mappings_per_api():
    with pytest.raises(ConfigError, match=r"serve\.options"):
        load_config({"name": "x", "stages": [{"name": "a", "factory": "m:f", "terminal": True}],
                     "serve": {"options": {"openai": 3}}}, validate=False)


# -- the JSON encoding ----------------------------------------------------------------------------------


@pytest.mark.parametrize("tensor", [
    torch.arange(6, dtype=torch.float32).reshape(2, 3),
    torch.tensor([1, -2, 3], dtype=torch.int64),
    torch.tensor([0.5, -1.25], dtype=torch.bfloat16),
    torch.tensor([True, False]),
    torch.empty(0, 4),
])
def test_tensors_round_trip_through_json(tensor):
    encoded = to_jsonable({"t": tensor, "n": [1, (2, 3)]})
    assert set(encoded["t"]) == {"dtype", "shape", "data"}
    assert encoded["t"]["dtype"] == str(tensor.dtype).removeprefix("torch.")
    decoded = from_jsonable(encoded)
    assert decoded["n"] == [1, [2, 3]]
    assert decoded["t"].dtype == tensor.dtype and torch.equal(decoded["t"], tensor)


def test_numpy_arrays_and_bytes_use_the_same_encoding():
    import numpy as np

    encoded = to_jsonable({"a": np.arange(3, dtype=np.int16), "b": b"\x00\xff", "s": np.float32(1.5)})
    assert encoded["a"]["dtype"] == "int16" and encoded["s"] == 1.5
    assert from_jsonable(encoded["b"]) == b"\x00\xff"
    assert from_jsonable(encoded["a"]).tolist() == [0, 1, 2]


def test_a_malformed_tensor_names_its_path():
    with pytest.raises(EncodingError, match=r"input\.x\.data: 3 bytes, but shape \[1\] of float32 needs 4"):
        from_jsonable({"x": {"dtype": "float32", "shape": [1], "data": "AAAA"}})


# -- metrics ----------------------------------------------------------------------------------------------


def test_stores_of_several_processes_merge_and_render_as_prometheus_text():
    a, b = Store(), Store()
    a.inc("omni_stage_calls_total", ("enc", "ok"))
    b.inc("omni_stage_calls_total", ("enc", "ok"), 2)
    a.observe("omni_stage_duration_seconds", ("enc",), 0.003)
    b.observe("omni_stage_duration_seconds", ("enc",), 1000.0)  # above the last bucket
    text = prometheus_text(merge([a.snapshot(), b.snapshot()]))
    assert 'omni_stage_calls_total{stage="enc",status="ok"} 3.0' in text
    assert 'omni_stage_duration_seconds_bucket{le="0.005",stage="enc"} 1.0' in text or \
        'omni_stage_duration_seconds_bucket{stage="enc",le="0.005"} 1.0' in text
    assert 'omni_stage_duration_seconds_count{stage="enc"} 2.0' in text
    inf = [line for line in text.splitlines() if line.startswith("omni_stage_duration_seconds_bucket") and "+Inf" in line]
    assert inf and inf[0].endswith(" 2.0")
    assert len(BUCKETS) + 1 == sum(1 for line in text.splitlines() if line.startswith("omni_stage_duration_seconds_bucket"))


def test_restarts_are_the_pids_a_process_name_exported_beyond_the_first():
    exports = [{"process": "enc", "pid": 1}, {"process": "enc", "pid": 2}, {"process": "dec", "pid": 3}]
    assert restarts(exports) == {"enc": 1, "dec": 0}


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.usefixtures("no_leaks")
def test_an_embedder_gets_the_same_metrics_without_the_server():

    from runtime_helpers import arun

    from omni_core import Pipeline
    from omni_core.metrics import RequestMeter

    async def main():
        async with Pipeline(CONFIG) as pipeline:
            meter = RequestMeter(pipeline)
            assert (await meter.submit({"text": "a b"}))["count"] == 2
            chunks = [e async for e in meter.stream({"text": "c d e"}) if not e.is_result]
            assert len(chunks) == 3
            exported = 'omni_stage_calls_total{stage="words",status="ok"} 2.0'  # every 0.25 s
            await until(lambda: exported in meter.prometheus_text(), "the stage's calls exported")
            return meter.prometheus_text()

    text = arun(main(), timeout=90)
    assert 'omni_requests_total{pipeline="words",status="ok"} 2.0' in text
    assert 'omni_time_to_first_chunk_seconds_count{pipeline="words"} 1.0' in text
    assert 'omni_stream_chunks_total{stage="words"} 5.0' in text

"""The fuzz of ``omni serve`` (:mod:`omni_core.testing.fuzz`) on ``qwen2_5_omni`` with the tiny
checkpoint, with an API key set (requests with it, without it and with a wrong one): every
operation of its OpenAPI document (the core routes, the console's, the OpenAI API's, and Realtime
sessions on ``/v1/realtime``), the pipeline's inputs right and wrong (``text``, ``messages`` with
audio and image parts, server paths, data URLs that are not media, huge token counts); no answer
``>= 500``, ``/ready`` after, no file a request chose."""

from __future__ import annotations

import os

import httpx
import pytest
from hypothesis import strategies as st
from omni_core.testing.fuzz import (
    ANY,
    B64,
    DATA_URLS,
    MESSAGE,
    PATHS,
    WORDS,
    PipelineInputs,
    fuzz_server,
    fuzz_websocket,
)
from omni_core.testing.serve import ServerProcess

pytestmark = pytest.mark.timeout(1200)

KEY = "sk-fuzz-qwen-0123456789"
REQUESTS = int(os.environ.get("OMNI_FUZZ_REQUESTS", "600"))

QWEN_INPUTS = PipelineInputs(
    fields={
        "text": st.one_of(WORDS, ANY), "messages": st.one_of(st.lists(MESSAGE, min_size=1, max_size=3), ANY),
        "audio": st.one_of(PATHS, B64, ANY), "sample_rate": st.one_of(st.integers(-1, 96000), ANY),
        "image": st.one_of(PATHS, DATA_URLS, ANY), "max_new_tokens": st.one_of(st.integers(-2, 8), st.just(10**9), ANY),
        "speaker": st.one_of(st.sampled_from(["Chelsie", "Ethan", "nobody"]), ANY), "wav_path": st.one_of(PATHS, ANY),
        "return_audio": st.one_of(st.booleans(), ANY), "system_prompt": st.one_of(WORDS, ANY),
        "talker_do_sample": st.one_of(st.booleans(), ANY), "seed": ANY, "nope": ANY,
    },
    valid=st.fixed_dictionaries({"text": WORDS.filter(str.strip), "max_new_tokens": st.integers(1, 3)},
                                optional={"return_audio": st.booleans()}),
)


def test_no_request_drawn_from_the_openapi_document_gets_a_5xx(tiny_model, tmp_path):
    srv = ServerProcess("qwen2_5_omni", "--api-key", KEY, env={"OMNI_TRANSFORMERS_MODEL": str(tiny_model)},
                        cwd=str(tmp_path), ready_timeout=300)
    with srv.serving(stop_timeout=120) as server:
        report = fuzz_server(server.url, pipeline="qwen2_5_omni", inputs=QWEN_INPUTS, key=KEY, requests=REQUESTS,
                             timeout=300)
        print(report.summary())
        assert report.total >= REQUESTS and not report.missed, report.summary()
        assert not report.findings, report.summary()
        sessions = fuzz_websocket(server.url, "/v1/realtime", model="qwen2_5_omni", key=KEY, sessions=20)
        print(sessions.summary())
        assert not sessions.findings, sessions.summary()
        assert httpx.get(f"{server.url}/ready", timeout=30).status_code == 200
    # No request wrote a file: network requests may name none, and the shipped config writes no WAV
    # for a request that names none.
    written = {p.name for p in tmp_path.rglob("*") if p.is_file()}
    assert not written, written

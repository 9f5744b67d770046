"""The ``openai`` API's request checks over generated bodies (hypothesis, seeded): any JSON a
client sends is either accepted or refused with a ``BadRequest`` (a 400 naming the field), never
another exception (a 500), for the demo's adapter and for an adapter that maps every sampling
parameter and takes the conversation (Qwen2.5-Omni's)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from omni_contrib_stages.openai_api import (
    FIELDS,
    BadRequest,
    adapter_options,
    include_usage,
    parse_request,
)

from omni_core import load_config

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
parts = st.fixed_dictionaries({"type": st.sampled_from(["text", "input_audio", "image_url", "video"]) | json_values},
                              optional={"text": json_values, "input_audio": json_values, "image_url": json_values})
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer"]) | json_values},
    optional={"content": st.text(max_size=8) | st.lists(parts | json_values, max_size=3) | json_values}),
    max_size=3) | json_values
bodies = st.fixed_dictionaries(
    {"model": st.just("m") | json_values, "messages": messages},
    optional={name: json_values for name in FIELDS if name not in ("model", "messages")}
    | {"modalities": st.lists(st.sampled_from(["text", "audio"]) | json_values, max_size=3) | json_values,
       "audio": st.fixed_dictionaries({}, optional={"voice": st.sampled_from(["alloy", "Chelsie"]) | json_values,
                                                    "format": st.sampled_from(["wav", "pcm16"]) | json_values})
       | json_values,
       "unknown": json_values},
) | json_values


@pytest.fixture(scope="module")
def adapters():
    demo = load_config("demo")
    everything = adapter_options({"messages_key": "messages", "audio_stage": "vocoder", "voices": ["Chelsie"],
                                  "sampling": {"temperature": "t", "top_p": "p", "top_k": "k", "seed": "seed",
                                               "stop": "stop"}}, demo)
    return [adapter_options(demo.serve.options["openai"], demo), everything]


@seed(31)
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(body=bodies)
def test_any_body_is_accepted_or_refused_with_a_bad_request(adapters, body):
    for opts in adapters:
        try:
            req = parse_request(body, "m", opts)
            include_usage(body.get("stream_options"), req["stream"])
        except BadRequest as exc:
            assert exc.status in (400, 404) and exc.message

"""The realtime package's parts in-process: its metrics are defined through omni_core.metrics.define
when the API is mounted (importing it changes nothing), and a client message is read or refused
before any handler runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from omni_core import metrics


def test_importing_the_realtime_package_defines_no_metric():
    code = ("import omni_core.metrics as m; before = dict(m.DEFINITIONS); import omni_contrib_stages.realtime; "
            "print(sorted(set(m.DEFINITIONS) - set(before)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_metrics_define_adds_a_metric_once_and_refuses_another_under_its_name(monkeypatch):
    from omni_contrib_stages.realtime import METRICS

    monkeypatch.setattr(metrics, "DEFINITIONS", dict(metrics.DEFINITIONS))
    for name, kind, help_text, labels in METRICS:
        metrics.define(name, kind, help_text, labels)
        metrics.define(name, kind, help_text, labels)  # again: nothing changes
    store = metrics.Store()
    store.set("omni_realtime_sessions", ("demo",), 2)
    store.inc("omni_realtime_sessions_total", ("demo", "closed"))
    store.observe("omni_realtime_time_to_first_audio_seconds", ("demo",), 0.2)
    text = metrics.prometheus_text(store.snapshot())
    assert 'omni_realtime_sessions{pipeline="demo"} 2.0' in text
    assert 'omni_realtime_sessions_total{pipeline="demo",status="closed"} 1.0' in text
    assert 'omni_realtime_time_to_first_audio_seconds_count{pipeline="demo"} 1.0' in text
    with pytest.raises(ValueError, match="'omni_realtime_sessions' is defined already as"):
        metrics.define("omni_realtime_sessions", "counter", "another", ("pipeline",))
    with pytest.raises(ValueError, match="kind must be one of counter, gauge, histogram, got 'meter'"):
        metrics.define("omni_acme_things", "meter", "things", ())
    with pytest.raises(ValueError, match="a name starts with 'omni_'"):
        metrics.define("acme things", "counter", "things", ())


@pytest.mark.parametrize(
    ("message", "code", "event_id"),
    [
        ({"type": "websocket.receive", "bytes": b"\x00"}, "invalid_event", None),
        ({"type": "websocket.receive", "text": "{not json"}, "invalid_json", None),
        ({"type": "websocket.receive", "text": "[" * 100_000 + "]" * 100_000}, "invalid_json", None),
        ({"type": "websocket.receive", "text": '{"type": "response.create", "x": ' + "[" * 65 + "]" * 65 + "}"},
         "invalid_json", None),
        ({"type": "websocket.receive", "text": "[1]"}, "invalid_event", None),
        ({"type": "websocket.receive", "text": json.dumps({"type": "nope", "event_id": "e1"})}, "unknown_event", "e1"),
        ({"type": "websocket.receive", "text": json.dumps({"type": "response.create", "event_id": "e2",
                                                           "pad": "x" * 200})}, "event_too_large", "e2"),
    ],
)
def test_a_client_message_is_read_or_refused_naming_why(message, code, event_id):
    from omni_contrib_stages.realtime.protocol import Incoming

    incoming = Incoming(message, max_bytes=1_000_000 if "[[" in message.get("text", "") else 100)
    assert incoming.problem is not None and incoming.problem.code == code
    assert incoming.event_id == event_id
    error = incoming.problem.event_error(incoming.event_id)
    assert error["code"] == code and error["event_id"] == event_id and error["message"]
    if "[[" in message.get("text", ""):  # refused by the server's JSON reader before any parser recursed
        assert "nests arrays/objects more than 64 deep" in error["message"]


def test_a_client_event_names_its_handler():
    from omni_contrib_stages.realtime.protocol import CLIENT_EVENTS, Incoming
    from omni_contrib_stages.realtime.session import Session

    incoming = Incoming({"type": "websocket.receive", "text": '{"type": "input_audio_buffer.append"}'}, 100)
    assert incoming.problem is None and incoming.handler == "on_input_audio_buffer_append"
    from omni_contrib_stages.realtime.conversation import Conversation
    from omni_contrib_stages.realtime.responses import Responses

    owners = (Session, Conversation, Responses)
    for kind in CLIENT_EVENTS:  # every event the protocol takes has exactly one handler
        name = "on_" + kind.replace(".", "_")
        assert sum(hasattr(owner, name) for owner in owners) == 1, kind

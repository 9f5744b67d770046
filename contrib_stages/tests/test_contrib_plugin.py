"""The distribution plugs into omni through its entry point, and everything it registers resolves."""

from __future__ import annotations

import importlib.resources
import inspect
import subprocess
import sys

import pytest
from omni_contrib_stages import functions, plugin

from omni_core import load_config
from omni_core.plugins import load_plugins


@pytest.fixture(scope="module")
def plugins():
    """omni-core's built-ins and this distribution only (other omni plugins installed beside it
    register pipelines and APIs of their own)."""
    return load_plugins(env={"OMNI_LOAD_PLUGINS": "omni-contrib-stages"})


def test_the_entry_point_loads_the_plugin_without_errors(plugins):
    info = plugins.info("contrib")
    assert info.distribution == "omni-contrib-stages" and not info.builtin
    assert info.error is None
    assert info.hooks == ["omni_register_stages", "omni_register_functions", "omni_register_pipelines", "omni_register_apis"]


def test_every_registered_name_resolves_to_what_it_says(plugins):
    registry = plugins.registry
    for name, target, _ in plugin.STAGES:
        assert name.startswith("contrib.")
        factory = registry.resolve("stage", name)
        assert callable(factory) and registry.get("stage", name).target == target
    for name, _, kind, _ in plugin.FUNCTIONS:
        assert name.startswith("contrib.")
        fn = registry.resolve(kind, name)
        assert len(inspect.signature(fn).parameters) == {"merge": 1, "project_payload": 1, "route": 2}[kind]
    assert plugin.SPLIT_PARTS == functions.SPLIT_PARTS
    assert registry.names("pipeline") == ["demo"]
    assert registry.names("api") == ["openai", "realtime"]
    assert callable(registry.resolve("api", "openai")) and callable(registry.resolve("api", "realtime"))
    # the console's chat tab finds the chat route by asking the registry
    from omni_contrib_stages.plugin import chat_route, speech_route, transcription_route

    from omni_core.serve.console import chat_path, route_path

    assert registry.get("api", "openai").meta["chat"] == "omni_contrib_stages.plugin:chat_route"
    assert chat_route({}) == chat_route({"kind": "chat"}) == "/v1/chat/completions"
    assert chat_route({"kind": "asr"}) is None and chat_route({"kind": "tts"}) is None  # /v1/audio/* instead
    assert chat_path(("openai",), registry, {"openai": {"kind": "tts"}}) is None
    # the Speech and Transcribe tabs: one route each, for the kind that mounts it
    assert [speech_route({"kind": k}) for k in ("chat", "asr", "tts")] == [None, None, "/v1/audio/speech"]
    assert [transcription_route({"kind": k}) for k in ("chat", "asr", "tts")] == [None, "/v1/audio/transcriptions", None]
    assert route_path("speech", ("openai",), registry, {"openai": {"kind": "tts"}}) == "/v1/audio/speech"
    assert route_path("transcription", ("openai",), registry, {}) is None
    assert "chat" not in registry.get("api", "realtime").meta


def test_loading_the_plugin_imports_no_stage_code():
    code = (
        "import sys; from omni_core import load_config; load_config('demo'); "
        "print(sorted(m for m in sys.modules if m.startswith('omni_contrib_stages')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "['omni_contrib_stages', 'omni_contrib_stages.plugin']"


def test_the_demo_config_ships_in_the_package_and_validates():
    text = importlib.resources.files("omni_contrib_stages").joinpath("pipelines/demo.yaml").read_text()
    assert "name: demo" in text
    cfg = load_config("demo")
    assert cfg.stage_names == ["preprocess", "audio_encoder", "image_encoder", "thinker", "talker", "vocoder"]
    assert cfg.terminal_stages == ["thinker", "vocoder"]
    assert cfg.stage("talker").process == cfg.stage("vocoder").process == "speech"
    assert cfg.stage("thinker").wait_for == ("audio_encoder", "image_encoder")
    assert cfg.stage("thinker").stream_to == ("talker",)

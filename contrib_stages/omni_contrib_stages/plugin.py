"""The omni plugin of omni-contrib-stages: registers its stages, functions, the demo pipeline and
the ``openai`` and ``realtime`` APIs of ``omni serve``.

Everything is registered by dotted path, so loading the plugin (which omni does in every process)
imports nothing but this module; a stage's code is imported only in the process that runs it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import omni_core
from omni_core.options import Option

_S = "omni_contrib_stages.stages:"
_D = "omni_contrib_stages.demo.stages:"
_F = "omni_contrib_stages.functions:"

#: The parts a split payload can have, each with its ``contrib.split.<part>`` projection
#: (the same tuple as :data:`omni_contrib_stages.functions.SPLIT_PARTS`).
SPLIT_PARTS = ("audio", "image", "video", "text", "speech")

#: Stages: (name, dotted path, description).
STAGES: tuple[tuple[str, str, str], ...] = (
    ("contrib.torch_module", _S + "TorchModule", "runs a torch.nn.Module given by dotted path, micro-batching concurrent requests"),
    ("contrib.function", _S + "function_stage", "calls a plain Python function given by dotted path"),
    ("contrib.tee", _S + "Tee", "passes its payload on unchanged; optionally re-emits a stream"),
    ("contrib.collect", _S + "Collect", "gathers a stream's chunks into one list"),
    ("contrib.demo.preprocess", _D + "Preprocess", "demo: checks the inputs and splits them per branch"),
    ("contrib.demo.thinker", _D + "Thinker", "demo: writes words, streaming each one"),
    ("contrib.demo.talker", _D + "Talker", "demo: turns streamed words into codec frames"),
    ("contrib.demo.vocoder", _D + "Vocoder", "demo: turns streamed codec frames into a WAV file"),
)

#: Functions: (name, dotted path, kind, description).
FUNCTIONS: tuple[tuple[str, str, str, str], ...] = (
    ("contrib.concat_tensors", _F + "concat_tensors", "merge", "concatenates tensors under the same key (dim 0)"),
    ("contrib.stack_tensors", _F + "stack_tensors", "merge", "stacks tensors under the same key (new dim 0)"),
    ("contrib.tensors_only", _F + "tensors_only", "project_payload", "keeps only the keys holding tensors"),
    ("contrib.drop_tensors", _F + "drop_tensors", "project_payload", "keeps only the keys not holding tensors"),
    ("contrib.drop_private", _F + "drop_private", "project_payload", "drops the control keys (starting with '_')"),
    *((f"contrib.split.{part}", f"{_F}split_{part}", "project_payload",
       f"payload[{part!r}] with the 'shared' entries (a split payload's {part} branch)") for part in SPLIT_PARTS),
    ("contrib.route.to", _F + "route_to", "route", "routes to the stages named by payload['_to'] (all when absent)"),
)

#: Pipelines: (name, config shipped in this package, description).
PIPELINES: tuple[tuple[str, str, str], ...] = (
    ("demo", "omni_contrib_stages:pipelines/demo.yaml",
     "an omni model in miniature: encoders -> thinker (streams words) -> talker -> vocoder (WAV file)"),
)


@omni_core.hookimpl
def omni_register_stages(register):
    for name, target, description in STAGES:
        register(name, target, description=description)


@omni_core.hookimpl
def omni_register_functions(register):
    for name, target, kind, description in FUNCTIONS:
        register(name, target, kind=kind, description=description)


@omni_core.hookimpl
def omni_register_pipelines(register):
    for name, target, description in PIPELINES:
        register(name, target, description=description)


#: APIs for ``omni serve``: (name, dotted path of the factory, description).
APIS: tuple[tuple[str, str, str], ...] = (
    ("openai", "omni_contrib_stages.openai_audio:make_routes",
     "OpenAI-compatible /v1/chat/completions (text and audio, streamed or not), /v1/audio/transcriptions and "
     "/v1/audio/speech (serve.options.openai.kind asr / tts) and /v1/models"),
    ("realtime", "omni_contrib_stages.realtime:make_routes",
     "OpenAI Realtime protocol on the /v1/realtime WebSocket: voice turns, server VAD, barge-in"),
)


#: The options schema of the ``openai`` API (``serve.options.openai``), declared with its
#: registration so that ``omni validate`` checks a config's adapter options without importing the
#: API; :func:`omni_contrib_stages.openai_api.adapter_options` parses them with it.
OPENAI_OPTIONS: dict[str, Option] = {
    "prompt_key": Option("str", "text", "the prompt goes to inputs[prompt_key]"),
    "max_tokens_key": Option("str", None, "max_tokens / max_completion_tokens go to inputs[max_tokens_key] "
                             "(null: ignored)", nullable=True),
    "prompt_tokens_field": Option("str", "prompt_tokens", "result[text_stage][prompt_tokens_field]: the prompt's "
                                  "tokens as the model saw them (usage.prompt_tokens)"),
    "completion_tokens_field": Option("str", "completion_tokens", "result[text_stage][completion_tokens_field]: "
                                      "the generated tokens (usage.completion_tokens)"),
    "finish_reason_field": Option("str", "finish_reason", "result[text_stage][finish_reason_field]: 'stop', or "
                                  "'length' when max_tokens cut the answer"),
    "inputs": Option("mapping", {}, "merged into every request's inputs"),
    "text_inputs": Option("mapping", {}, "merged when the client asked for text only"),
    "audio_inputs": Option("mapping", {}, "merged when the client asked for audio too"),
    "text_stage": Option("str", None, "the stage whose chunks carry text (null: the first terminal stage)",
                         nullable=True),
    "text_only_stage": Option("str", None, "the stage whose chunks carry text when the client asked for text only "
                              "(null: text_stage)", nullable=True),
    "text_field": Option("str", "text", "chunk[text_field] is one piece of text"),
    "text_joiner": Option("str", " ", "put between two pieces of text"),
    "result_text_field": Option("str", "text", "result[text_stage][result_text_field] is the whole text"),
    "audio_stage": Option("str", None, "the stage whose chunks carry audio (null: the pipeline has none)",
                          nullable=True),
    "audio_field": Option("str", "pcm16", "chunk[audio_field]: mono audio, PCM16 bytes or float samples"),
    "sample_rate": Option("positive_int", 24000, "the audio's sample rate in Hz, unless the chunk says"),
    "sample_rate_field": Option("str", "sample_rate", "chunk[sample_rate_field], when present, is its rate",
                                nullable=True),
    "voices": Option("any", None, "a list of accepted voice names (null: any)"),
    "voice_key": Option("str", None, "the voice goes to inputs[voice_key] (null: not passed on)", nullable=True),
    "messages_key": Option("str", None, "the whole conversation goes to inputs[messages_key], input_audio parts "
                           "as {type: audio, audio: bytes} and image_url parts as {type: image, image: bytes}, "
                           "instead of the last user message's text to prompt_key (null: text only)",
                           nullable=True),
    "allow_local_files": Option("any", None, "removed: the pipeline's serve.allow_local_files decides",
                                replaced_by="set serve.allow_local_files to the directory requests may name files "
                                "in (image_url file:// URLs and paths inside it are then read; without it, data "
                                "URLs only)"),
    "system_messages": Option("bool", True, "with messages_key: system (and developer) messages are passed on; "
                              "false: left out, for a model that needs its own system prompt"),
    "sampling": Option("mapping", {}, "the sampling parameters the pipeline honours, OpenAI name -> input key "
                       "(temperature, top_p, top_k, seed, stop, presence_penalty, frequency_penalty); a parameter "
                       "not mapped is refused (400) unless it is absent, null or OpenAI's default (stop not "
                       "mapped: the API cuts the text itself)"),
    "max_tokens_limit": Option("positive_int", None, "the largest max_tokens / max_completion_tokens the pipeline "
                               "takes; more is refused (400) before the request runs (null: no limit here)",
                               nullable=True),
    "max_choices": Option("positive_int", 8, "the largest n (choices per request; each is a pipeline request)"),
    "kind": Option("choice", "chat", "what the pipeline is: chat mounts /v1/chat/completions, asr "
                   "/v1/audio/transcriptions, tts /v1/audio/speech (/v1/models always)", choices=("chat", "asr", "tts")),
    "audio": Option("mapping", {}, "asr and tts: how a request becomes inputs (audio_key, sample_rate_key, "
                    "language_key, prompt_key, input_key, speed_key, ...; see omni_contrib_stages.openai_audio)"),
}


#: The options schema of the ``realtime`` API (``serve.options.realtime``). Keys it shares with the
#: ``openai`` API default to that API's options in the same config (``serve.options.openai``), so a
#: pipeline set up for one serves both; see :mod:`omni_contrib_stages.realtime`.
REALTIME_SHARED = ("prompt_key", "max_tokens_key", "prompt_tokens_field", "completion_tokens_field",
                   "finish_reason_field", "inputs", "text_inputs", "audio_inputs", "text_stage", "text_only_stage",
                   "text_field", "text_joiner", "result_text_field", "audio_stage", "audio_field", "sample_rate",
                   "sample_rate_field", "voices", "voice_key", "messages_key")
REALTIME_OPTIONS: dict[str, Option] = {
    **{name: OPENAI_OPTIONS[name] for name in REALTIME_SHARED if name != "messages_key"},
    "messages_key": Option("str", None, "the conversation goes to inputs[messages_key] in Qwen's chat format, user "
                           "audio as {type: audio, audio: 1-D float tensor, sample_rate} (null: as text to prompt_key)",
                           nullable=True),
    "audio_key": Option("str", None, "without messages_key: the last user turn's audio (1-D float samples at "
                        "input_sample_rate) goes to inputs[audio_key] (null: not passed on)", nullable=True),
    "input_sample_rate": Option("positive_int", 16000, "the rate the pipeline takes user audio at (resampled "
                                "from the client's 24 kHz PCM16)"),
    "max_items": Option("positive_int", 32, "conversation items kept per session; the oldest are dropped first"),
    "max_history_seconds": Option("positive_number", 300.0, "seconds of user audio kept in a session's "
                                  "conversation; past it the oldest items are dropped first"),
    "max_sessions": Option("positive_int", 16, "sessions open at once on this server; one more is refused with an "
                           "error event"),
    "idle_timeout": Option("positive_number", 300.0, "seconds without a client event (and no response running) "
                           "before a session is closed"),
    "max_buffer_seconds": Option("positive_number", 60.0, "seconds of audio the input buffer holds at most"),
    "max_event_bytes": Option("positive_int", 4 * 1024 * 1024, "the largest client event accepted, in bytes"),
    "default_voice": Option("str", None, "the session's voice until session.update sets one (null: the first of "
                            "voices, else 'alloy')", nullable=True),
}

#: Each API's options schema, by API name.
API_OPTIONS: dict[str, dict[str, Option]] = {"openai": OPENAI_OPTIONS, "realtime": REALTIME_OPTIONS}

#: Each API's OpenAI-style routes the console has a tab for (chat, speech, transcription), by API
#: name: for ``openai``, functions of the pipeline's options, since a pipeline's ``kind`` decides
#: which it mounts (chat: /v1/chat/completions; tts: /v1/audio/speech; asr: /v1/audio/transcriptions).
API_CONSOLE_ROUTES: dict[str, dict[str, str]] = {"openai": {
    "chat": "omni_contrib_stages.plugin:chat_route",
    "speech": "omni_contrib_stages.plugin:speech_route",
    "transcription": "omni_contrib_stages.plugin:transcription_route",
}}


def chat_route(options: Mapping[str, Any]) -> str | None:
    """The ``openai`` API's chat completions route for a pipeline with these options: there is one
    for ``kind: chat`` (the default), none for ``asr`` and ``tts`` pipelines."""
    return "/v1/chat/completions" if options.get("kind", "chat") == "chat" else None


def speech_route(options: Mapping[str, Any]) -> str | None:
    """The ``openai`` API's speech route: for a ``kind: tts`` pipeline only."""
    return "/v1/audio/speech" if options.get("kind") == "tts" else None


def transcription_route(options: Mapping[str, Any]) -> str | None:
    """The ``openai`` API's transcriptions route: for a ``kind: asr`` pipeline only."""
    return "/v1/audio/transcriptions" if options.get("kind") == "asr" else None


@omni_core.hookimpl
def omni_register_apis(register):
    for name, target, description in APIS:
        register(name, target, description=description, options=API_OPTIONS[name],
                 **API_CONSOLE_ROUTES.get(name, {}))

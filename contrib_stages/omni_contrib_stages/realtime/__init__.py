"""The ``realtime`` API of ``omni serve``: the OpenAI Realtime protocol (GA event names) on the
``/v1/realtime`` WebSocket, so ``client.realtime.connect(model=PIPELINE)`` of the official ``openai``
SDK, and any client of that protocol, talks to an omni pipeline.

A session owns its conversation (user turns as audio or text, assistant turns as text), its input
audio buffer and its turn detection (server VAD with the ``silero-vad`` model). Every response is
one ordinary pipeline request (``ApiContext.stream``): cancelling it, a barge-in and a client that
goes away abort that request, and the runtime's guarantees hold.

Options (``serve.options.realtime``; every key optional). The keys the ``openai`` API shares
(prompt_key, messages_key, inputs, text_inputs, audio_inputs, text_stage, text_only_stage,
text_field, text_joiner, result_text_field, audio_stage, audio_field, sample_rate,
sample_rate_field, voices, voice_key, max_tokens_key and the usage fields) default to
``serve.options.openai`` of the same config, so a pipeline set up for the chat API serves realtime
sessions as it is. Its own keys: ``audio_key``, ``input_sample_rate``, ``max_items``,
``max_sessions``, ``idle_timeout``, ``max_buffer_seconds``, ``max_event_bytes``,
``default_voice`` (see :data:`omni_contrib_stages.plugin.REALTIME_OPTIONS` and docs/serving.md).

How a conversation becomes the pipeline's inputs for each response:

- with ``messages_key``: ``inputs[messages_key]`` is the conversation in Qwen's chat format: the
  session's instructions as a ``system`` message, then each item in order; user audio parts as
  ``{"type": "audio", "audio": <1-D float32 tensor>, "sample_rate": input_sample_rate}``, text
  parts as ``{"type": "text", "text"}``; assistant turns as their text;
- without it: ``inputs[prompt_key]`` is the conversation as lines ``"<role>: <text>"`` (an audio
  part reads as its transcript, or ``(audio)``), and with ``audio_key`` the latest user audio goes
  to ``inputs[audio_key]`` (1-D float32 tensor at ``input_sample_rate``).

History is bounded: past ``max_items`` items the oldest are dropped first (the running
response's item is never dropped).

The package's modules: :mod:`.protocol` (client events, options, the values a client sets),
:mod:`.session` (the connection, ``session.update``, the input audio buffer, the route),
:mod:`.conversation` (items), :mod:`.responses` (running a response), :mod:`.transcription`
(input audio transcription by an ASR pipeline of the server), :mod:`.vad` (server VAD)
and :mod:`.audio` (PCM16); what the ``openai`` API shares with it (the resampler of audio both ways too) is
in :mod:`omni_contrib_stages.api_common`.
"""

from __future__ import annotations

from ..api_common import pcm16, usage_of
from ..plugin import REALTIME_OPTIONS, REALTIME_SHARED
from .audio import MIN_COMMIT_MS, RATE, decode_audio, ms_of, resample, to_float, to_pcm16
from .conversation import Conversation, Item
from .protocol import (
    AUDIO_TEXT,
    CLIENT_EVENTS,
    OPENAI_VOICES,
    ClientError,
    new_id,
    realtime_options,
)
from .responses import Response, Responses
from .session import METRICS, Hub, Session, make_routes
from .vad import VAD_DEFAULTS, VAD_MODELS, Vad
from .vad import _Models as _Models

_new_id = new_id

__all__ = [
    "AUDIO_TEXT", "CLIENT_EVENTS", "METRICS", "MIN_COMMIT_MS", "OPENAI_VOICES", "RATE", "REALTIME_OPTIONS",
    "REALTIME_SHARED", "VAD_DEFAULTS", "VAD_MODELS", "ClientError", "Conversation", "Hub", "Item", "Response",
    "Responses", "Session", "Vad", "decode_audio", "make_routes", "ms_of", "new_id", "pcm16", "realtime_options",
    "resample", "to_float", "to_pcm16", "usage_of",
]

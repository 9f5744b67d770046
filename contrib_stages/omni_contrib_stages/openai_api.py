"""The ``openai`` API of ``omni serve``: an OpenAI-compatible ``/v1/chat/completions`` (text and
audio, streamed or not) and ``/v1/models`` for any pipeline that maps text in to text (and audio)
out.

The adapter (``serve.options.openai`` in the pipeline config; every key optional) says how::

    serve:
      apis: [openai]
      options:
        openai:
          prompt_key: text            # the prompt goes to inputs[prompt_key]
          max_tokens_key: max_tokens  # max_tokens / max_completion_tokens go here (null: ignored)
          prompt_tokens_field: prompt_tokens          # result[text_stage][...]: the usage numbers
          completion_tokens_field: completion_tokens  # and why the answer ended ("stop" | "length")
          finish_reason_field: finish_reason
          inputs: {}                  # merged into every request's inputs
          text_inputs: {speak: false} # ... when the client asked for text only
          audio_inputs: {stream_audio: true}   # ... when it asked for audio too
          text_stage: thinker         # whose chunks carry text (default: the first terminal stage)
          text_only_stage: null       # ... when the client asked for text only (null: text_stage)
          text_field: text            # chunk[text_field] is one piece of text
          text_joiner: " "            # put between two pieces
          result_text_field: text     # result[text_stage][result_text_field]: the whole text
          audio_stage: vocoder        # whose chunks carry audio (null: the pipeline has none)
          audio_field: pcm16          # chunk[audio_field]: mono audio, PCM16 bytes or float samples
          sample_rate: 24000          # of that audio, unless the chunk says (sample_rate_field)
          sample_rate_field: sample_rate  # chunk[sample_rate_field], when present, is its rate
          voices: null                # accepted voice names (null: any)
          voice_key: null             # the voice goes to inputs[voice_key] (null: not passed on)
          messages_key: null          # the conversation (with audio / image parts) goes to inputs[messages_key]
          system_messages: true       # with messages_key: pass system / developer messages on
          sampling: {}                # OpenAI sampling parameter -> input key, e.g. {seed: seed}
          max_tokens_limit: null      # the largest max_tokens the pipeline takes
          max_choices: 8              # the largest n

With ``messages_key`` the stage gets the conversation in Qwen's chat format: each message's role
and content, a string or parts ``{"type": "text", "text"}``, ``{"type": "audio", "audio": bytes}``
(from ``input_audio``: base64 ``data`` of a ``wav``, ``mp3`` or ``flac`` file) and ``{"type":
"image", "image": bytes}`` (from ``image_url`` with a ``data:`` URL; a ``file://`` URL or a path
becomes ``"image": path`` only when the pipeline's ``serve.allow_local_files`` names a directory,
and the stage then reads it only inside that directory; other URLs are refused). The API's own
``allow_local_files`` option is gone: a config that still sets it is refused naming
``serve.allow_local_files``.

Audio in a chunk is either mono little-endian 16-bit PCM (``bytes``) or samples: a 1-D torch
tensor, numpy array or list, float in [-1, 1] (any float dtype, bfloat16 included: clipped, scaled
by 32767 and rounded half to even, as omni-transformers writes its WAV files) or int16 (as is).

Every request field is honoured or refused (400 naming it): sampling parameters the pipeline maps
(``sampling``) go to its inputs, the others are refused unless at OpenAI's default, except ``stop``,
which the API applies itself (it cuts the text); ``n`` runs ``n`` pipeline requests (choice ``i``
with ``seed + i``); ``response_format`` text, ``logprobs`` false, ``tools`` empty; ``user`` and
``metadata`` are accepted and ignored; an unknown field is refused listing :data:`FIELDS`.

Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the status
codes of ``omni serve`` (400, 404, 429 + Retry-After, 500, 503, 504).

``usage`` and ``finish_reason`` come from the pipeline: its result (``result[text_stage]``, or
the result itself with one terminal stage) carries ``prompt_tokens`` (int: the prompt's tokens as
the model saw them), ``completion_tokens`` (int: the generated tokens) and ``finish_reason``
(``"stop"``, or ``"length"`` when ``max_tokens`` cut the answer), under the names the
``*_field`` options give. ``usage`` is null when the result has no counts, and ``finish_reason``
is then ``"stop"``. A streamed response's last choice chunk has the finish reason; with
``stream_options: {"include_usage": true}`` one more chunk follows with ``usage`` and no choices
(every chunk has ``usage``, null until then), as OpenAI sends them.

Layout: :func:`parse_request` checks a request; :class:`ChatApi` holds the routes (a whole answer
from each choice's :class:`_Choice`, a streamed one from :class:`_ChunkStream`); how a stage's
chunks and result are read (``text_of``, ``audio_of``, ``rate_of``, ``usage_of``, ``pcm16`` ...)
is :mod:`omni_contrib_stages.api_common`'s, shared with the ``realtime`` API.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Mapping
from typing import Any

from omni_core.logs import get_logger
from omni_core.options import parse_options

from .api_common import (
    FINISH_REASONS,
    audio_of,
    check_stages,
    final_text,
    pcm16,
    rate_of,
    stage_part,
    text_of,
    text_stage_for,
    usage_of,
    wav_bytes,
)
from .plugin import OPENAI_OPTIONS as OPTIONS

_final_text = final_text  # the name the tests and earlier releases used
__all__ = ["FINISH_REASONS", "pcm16", "stage_part", "usage_of", "wav_bytes"]

#: Adapter options and their defaults (the schema is :data:`.plugin.OPENAI_OPTIONS`).
DEFAULTS: dict[str, Any] = {name: option.default for name, option in OPTIONS.items()}

AUDIO_FORMATS = ("wav", "pcm16")

_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}


class BadRequest(Exception):
    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str | None = None
    ):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def adapter_options(options: Mapping[str, Any], pipeline_config: Any) -> dict[str, Any]:
    """The adapter's options with defaults, checked against the schema the API registered (an
    ``OptionsError``, a ValueError, lists every problem with its path) and against the pipeline."""
    opts = parse_options(OPTIONS, options, "serve.options.openai", owner="API 'openai'")
    check_stages(opts, pipeline_config, "serve.options.openai")
    # image_url may name a server file only where the pipeline lets requests name files at all.
    opts["local_files"] = pipeline_config.serve.allow_local_files is not None
    sampling = opts["sampling"]
    for name, key in sampling.items():
        if name not in SAMPLING:
            raise ValueError(f"serve.options.openai.sampling: {name!r} is not an OpenAI sampling parameter "
                             f"(one of: {', '.join(SAMPLING)})")
        if not isinstance(key, str) or not key:
            raise ValueError(f"serve.options.openai.sampling.{name}: the input key it goes to (a string), "
                             f"got {key!r}")
    voices = opts["voices"]
    if voices is not None and (
        not isinstance(voices, list) or not all(isinstance(v, str) for v in voices)
    ):
        raise ValueError(
            f"serve.options.openai.voices: a list of voice names or null, got {voices!r}"
        )
    return opts


def _prompt_checks(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise BadRequest(
            "'messages' must be a non-empty list of {role, content} objects", "messages"
        )
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise BadRequest(
                f"messages[{i}] must be an object with 'role' (a string) and 'content'", f"messages[{i}]"
            )
    if not any(m["role"] == "user" for m in messages):
        raise BadRequest("'messages' needs at least one message with role 'user'", "messages")


def _prompt(messages: Any) -> str:
    _prompt_checks(messages)
    content = [m for m in messages if m["role"] == "user"][-1].get("content")
    if isinstance(content, list):  # content parts: keep the text ones
        content = " ".join(
            p["text"] for p in content
            if isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
        )
    if not isinstance(content, str) or not content.strip():
        raise BadRequest("the last user message needs text content", "messages")
    return content


AUDIO_INPUT_FORMATS = ("wav", "mp3", "flac")


def _b64(data: Any, param: str) -> bytes:
    if not isinstance(data, str) or not data:
        raise BadRequest(f"{param} must be a non-empty base64 string", param)
    try:
        return base64.b64decode(data, validate=True)
    except (ValueError, TypeError):
        raise BadRequest(f"{param} is not valid base64", param) from None


def _part(part: Any, where: str, allow_local_files: bool) -> dict[str, Any]:
    """One OpenAI content part as a part of Qwen's chat format."""
    kind = part.get("type") if isinstance(part, Mapping) else None
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise BadRequest(f"{where}.text must be a string", f"{where}.text")
        return {"type": "text", "text": part["text"]}
    if kind == "input_audio":
        audio = part.get("input_audio")
        if not isinstance(audio, Mapping):
            raise BadRequest(f'{where}.input_audio must be {{"data": base64, "format": "wav"}}', f"{where}.input_audio")
        if audio.get("format") not in AUDIO_INPUT_FORMATS:
            raise BadRequest(f"{where}.input_audio.format must be one of {', '.join(AUDIO_INPUT_FORMATS)}, got "
                             f"{audio.get('format')!r}", f"{where}.input_audio.format")
        return {"type": "audio", "audio": _b64(audio.get("data"), f"{where}.input_audio.data"),
                "where": f"{where} (input_audio)"}
    if kind == "image_url":
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, Mapping) else image
        if not isinstance(url, str) or not url:
            raise BadRequest(f'{where}.image_url must be {{"url": "data:image/...;base64,..."}}', f"{where}.image_url")
        if url.startswith("data:"):
            head, sep, data = url.partition(",")
            if not sep or not head.endswith(";base64"):
                raise BadRequest(f"{where}.image_url.url must be a base64 data URL (data:image/png;base64,...)",
                                 f"{where}.image_url.url")
            return {"type": "image", "image": _b64(data, f"{where}.image_url.url"), "where": f"{where} (image_url)"}
        if "://" in url and not url.startswith("file://"):
            raise BadRequest(f"{where}.image_url.url: this server does not fetch URLs; send the image as a data URL",
                             f"{where}.image_url.url")
        if not allow_local_files:
            raise BadRequest(f"{where}.image_url.url: this server reads no local files (its pipeline sets no "
                             "serve.allow_local_files); send the image as a data URL", f"{where}.image_url.url")
        return {"type": "image", "image": url.removeprefix("file://"), "where": f"{where} (image_url)"}
    raise BadRequest(f"{where}.type must be text, input_audio or image_url, got {kind!r}", f"{where}.type")


def _conversation(messages: Any, allow_local_files: bool, system_messages: bool = True) -> list[dict[str, Any]]:
    """The messages in Qwen's chat format (for ``messages_key``), without system and developer
    messages unless ``system_messages``."""
    _prompt_checks(messages)
    out = []
    for i, message in enumerate(messages):
        if not system_messages and message["role"] in ("system", "developer"):
            continue
        content = message.get("content")
        if isinstance(content, list):
            content = [_part(p, f"messages[{i}].content[{j}]", allow_local_files) for j, p in enumerate(content)]
        elif not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or a list of parts", f"messages[{i}].content")
        out.append({"role": message["role"], "content": content})
    return out


#: The sampling parameters a pipeline may honour (``sampling`` maps each to an input key).
SAMPLING = ("temperature", "top_p", "top_k", "seed", "stop", "presence_penalty", "frequency_penalty")

#: OpenAI's documented defaults: a parameter the pipeline does not take is accepted at its default
#: (or absent, or null), and refused otherwise.
SAMPLING_DEFAULTS: dict[str, Any] = {"temperature": 1, "top_p": 1, "presence_penalty": 0, "frequency_penalty": 0}

#: Every field a request may have. Accepted and ignored: ``user``, ``metadata``, ``store``
#: (false), ``service_tier``, ``parallel_tool_calls``; refused unless at their "off" value:
#: ``logprobs``, ``top_logprobs``, ``logit_bias``, ``tools``, ``tool_choice``, ``response_format``
#: other than text.
FIELDS = ("model", "messages", "stream", "stream_options", "modalities", "audio", "max_completion_tokens",
          "max_tokens", "n", *SAMPLING, "response_format", "logprobs", "top_logprobs", "logit_bias", "tools",
          "tool_choice", "parallel_tool_calls", "user", "metadata", "store", "service_tier")

_INT64 = 2**63


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _sampling_value(name: str, value: Any) -> Any:
    """``value`` of the sampling parameter ``name``, checked (``stop`` as a list of strings)."""
    if name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):
        lo, hi = {"temperature": (0, 2), "top_p": (0, 1)}.get(name, (-2, 2))
        if not _is_number(value) or not lo <= value <= hi:
            raise BadRequest(f"'{name}' must be a number from {lo} to {hi}, got {value!r}", name)
        return value
    if name == "top_k":
        if not _is_int(value) or value < 0:
            raise BadRequest(f"'top_k' must be an integer >= 0 (0: no limit), got {value!r}", name)
        return value
    if name == "seed":
        if not _is_int(value) or not -_INT64 <= value < _INT64:
            raise BadRequest(f"'seed' must be a 64-bit integer, got {value!r}", name)
        return value
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not 1 <= len(stops) <= 4 or not all(isinstance(x, str) and x for x in stops):
        raise BadRequest(f"'stop' must be a non-empty string or a list of 1 to 4 of them, got {value!r}", name)
    return stops


def _refuse_unless(body: Mapping[str, Any], name: str, ok: bool, why: str) -> None:
    if name in body and body[name] is not None and not ok:
        raise BadRequest(f"'{name}' {why}", name)


def _parameters(body: Mapping[str, Any], opts: dict[str, Any]) -> tuple[dict[str, Any], int, list[str]]:
    """The request's sampling inputs (by input key), its ``n`` and the stop sequences the adapter
    applies itself (``stop`` when the pipeline does not take it), after checking every field that
    is not the prompt: unknown fields, parameters the pipeline does not honour, bad values."""
    unknown = [key for key in body if key not in FIELDS]
    if unknown:
        raise BadRequest(f"unknown field(s) {', '.join(repr(k) for k in unknown)}; a chat completion request "
                         f"takes: {', '.join(FIELDS)}", unknown[0])
    inputs: dict[str, Any] = {}
    stops: list[str] = []
    for name in SAMPLING:
        value = body.get(name)
        if value is None:
            continue
        value = _sampling_value(name, value)
        key = opts["sampling"].get(name)
        if key is not None:
            inputs[key] = value
        elif name == "stop":
            stops = value
        elif name not in SAMPLING_DEFAULTS or value != SAMPLING_DEFAULTS[name]:
            default = f" or send {SAMPLING_DEFAULTS[name]}" if name in SAMPLING_DEFAULTS else ""
            taken = ", ".join(opts["sampling"]) or "none"
            raise BadRequest(f"this model does not honour '{name}' (the sampling parameters it takes: {taken}); "
                             f"leave it out{default}", name)
    n = body.get("n")
    if n is None:
        n = 1
    if not _is_int(n) or not 1 <= n <= opts["max_choices"]:
        raise BadRequest(f"'n' must be an integer from 1 to {opts['max_choices']}, got {n!r}", "n")
    fmt = body.get("response_format")
    _refuse_unless(body, "response_format", isinstance(fmt, Mapping) and fmt.get("type") == "text" and len(fmt) == 1,
                   f'must be {{"type": "text"}}: this model answers plain text only, got {fmt!r}')
    _refuse_unless(body, "logprobs", body.get("logprobs") is False, "is not supported: this model returns no "
                   "log probabilities (leave it out or send false)")
    _refuse_unless(body, "top_logprobs", False, "is not supported: this model returns no log probabilities")
    _refuse_unless(body, "logit_bias", body.get("logit_bias") == {}, "is not supported (leave it out)")
    _refuse_unless(body, "tools", body.get("tools") == [], "are not supported: this model calls no tools")
    _refuse_unless(body, "tool_choice", body.get("tool_choice") == "none", 'is not supported: this model calls no '
                   'tools (leave it out or send "none")')
    _refuse_unless(body, "parallel_tool_calls", isinstance(body.get("parallel_tool_calls"), bool),
                   "must be true or false")
    _refuse_unless(body, "user", isinstance(body.get("user"), str), "must be a string")
    metadata = body.get("metadata")
    _refuse_unless(body, "metadata", isinstance(metadata, Mapping) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()), "must be an object of strings")
    _refuse_unless(body, "store", body.get("store") is False, "is not supported: this server stores no completions "
                   "(leave it out or send false)")
    _refuse_unless(body, "service_tier", isinstance(body.get("service_tier"), str), "must be a string")
    return inputs, n, stops


class StopText:
    """A choice's text cut at the first of ``stops`` (the stop sequence itself left out), as it
    grows: :meth:`feed` takes the whole text so far and returns what may be sent now, holding back
    an end that could be the start of a stop sequence; :meth:`finish` the rest once the text is
    whole. ``stopped`` says whether a stop sequence was found. Without stops it holds nothing back."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.sent = ""
        self.stopped = False

    def _safe(self, text: str, final: bool) -> str:
        cuts = [i for i in (text.find(stop) for stop in self.stops) if i >= 0]
        if cuts:
            self.stopped = True
            return text[:min(cuts)]
        if final:
            return text
        hold = max((k for stop in self.stops for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
        return text[:len(text) - hold]

    def feed(self, text: str, final: bool = False) -> str:
        if self.stopped:
            return ""
        safe = self._safe(text, final)
        if not safe.startswith(self.sent):  # the whole text is not the pieces joined: send no more
            return ""
        new, self.sent = safe[len(self.sent):], safe
        return new

    def finish(self, text: str) -> str:
        return self.feed(text, final=True)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request with ``n`` > 1 and ``seed``: ``seed + index``,
    wrapped into the signed 64-bit range (choice 0 runs with the request's own seed)."""
    return (seed + index + _INT64) % (2 * _INT64) - _INT64


def parse_request(body: Any, model: str, opts: dict[str, Any]) -> dict[str, Any]:
    """Check a chat completion request; returns what the handler needs (``choices``: the inputs of
    each of its ``n`` pipeline requests; ``inputs``: the first's)."""
    if not isinstance(body, Mapping):
        raise BadRequest("the body must be a JSON object")
    if "model" not in body:
        raise BadRequest("'model' is required", "model")
    if body["model"] != model:
        raise BadRequest(f"the model {body['model']!r} does not exist; this server serves {model!r}", "model", 404,
                         "model_not_found")
    if opts["messages_key"] is None:
        prompts = {opts["prompt_key"]: _prompt(body.get("messages"))}
    else:
        prompts = {opts["messages_key"]: _conversation(body.get("messages"), opts["local_files"],
                                                       opts["system_messages"])}
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false", "stream")
    want_audio, fmt, voice = _output(body, stream, opts)
    inputs = {**opts["inputs"], **(opts["audio_inputs"] if want_audio else opts["text_inputs"]), **prompts}
    if want_audio and opts["voice_key"] is not None:
        inputs[opts["voice_key"]] = voice
    limit = _max_tokens(body, opts)
    if limit is not None and opts["max_tokens_key"] is not None:
        inputs[opts["max_tokens_key"]] = limit
    sampling, n, stops = _parameters(body, opts)
    if stops and want_audio:
        raise BadRequest("'stop' with audio output is not supported: this model does not take stop sequences, and "
                         "the server can cut the text at one but not the speech; leave 'stop' out or ask for "
                         'modalities ["text"]', "stop")
    inputs.update(sampling)
    return {"inputs": inputs, "choices": _choices(inputs, n, opts), "stops": stops, "stream": stream,
            "audio": want_audio, "format": fmt, "text_stage": text_stage_for(opts, want_audio)}


def _output(body: Mapping[str, Any], stream: bool, opts: dict[str, Any]) -> tuple[bool, str | None, str | None]:
    """``(want_audio, audio format, voice)`` from the request's ``modalities`` and ``audio``."""
    modalities = body.get("modalities") or ["text"]
    if not isinstance(modalities, list) or not all(m in ("text", "audio") for m in modalities) \
            or "text" not in modalities:
        raise BadRequest('\'modalities\' must be ["text"] or ["text", "audio"]', "modalities")
    if "audio" not in modalities:
        return False, None, None
    audio = body.get("audio")
    if opts["audio_stage"] is None:
        raise BadRequest('this model has no audio output; ask for modalities ["text"]', "modalities")
    if not isinstance(audio, Mapping):
        raise BadRequest('modalities with \'audio\' need \'audio\': {"voice": ..., "format": "wav" | "pcm16"}',
                         "audio")
    fmt = audio.get("format", "pcm16" if stream else "wav")
    if fmt not in AUDIO_FORMATS:
        raise BadRequest(f"audio.format must be one of {', '.join(AUDIO_FORMATS)}, got {fmt!r}", "audio.format")
    if stream and fmt != "pcm16":
        raise BadRequest("streamed audio must use audio.format 'pcm16'", "audio.format")
    voice = audio.get("voice")
    if not isinstance(voice, str) or not voice:
        raise BadRequest("audio.voice is required (a voice name)", "audio.voice")
    if opts["voices"] is not None and voice not in opts["voices"]:
        raise BadRequest(f"unknown voice {voice!r}; voices: {', '.join(opts['voices'])}", "audio.voice")
    return True, fmt, voice


def _max_tokens(body: Mapping[str, Any], opts: dict[str, Any]) -> int | None:
    """The request's token limit (``max_completion_tokens`` wins when both it and ``max_tokens``
    are sent), each checked."""
    limits = []
    for name in ("max_completion_tokens", "max_tokens"):
        limit = body.get(name)
        if limit is None:
            continue
        if not _is_int(limit) or limit < 1:
            raise BadRequest(f"'{name}' must be a positive integer, got {limit!r}", name)
        most = opts.get("max_tokens_limit")
        if most is not None and limit > most:
            raise BadRequest(f"'{name}' is {limit}; this model writes at most {most} tokens per answer", name)
        limits.append(limit)
    return limits[0] if limits else None


def _choices(inputs: dict[str, Any], n: int, opts: dict[str, Any]) -> list[dict[str, Any]]:
    """The inputs of each of ``n`` choices: choice i runs with seed + i (seed i without one), so no
    two choices share a seed."""
    choices = [inputs]
    seed_key = opts["sampling"].get("seed")
    for index in range(1, n):
        if seed_key is None:
            choices.append(dict(inputs))
        else:
            choices.append({**inputs, seed_key: choice_seed(inputs.get(seed_key, 0), index)})
    return choices


def include_usage(options: Any, stream: bool) -> bool:
    """``stream_options.include_usage`` of a request; ``stream_options`` go with ``stream: true``."""
    if options is None:
        return False
    if not stream:
        raise BadRequest("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(options, Mapping) or not isinstance(options.get("include_usage", False), bool):
        raise BadRequest("'stream_options' must be an object like {\"include_usage\": true}", "stream_options")
    return options.get("include_usage", False)


def make_routes(api: Any) -> list[Any]:
    """The API factory registered as ``openai``."""
    return ChatApi(api).routes()


class ChatApi:
    """The ``openai`` API of one served pipeline: ``/v1/models``, ``/v1/models/{model}`` and
    ``/v1/chat/completions`` (answered whole by :meth:`_collected`, or streamed by
    :class:`_ChunkStream`), every error in OpenAI's shape."""

    def __init__(self, api: Any):
        self.api = api
        self.model = api.pipeline_name
        self.opts = opts = adapter_options(api.options, api.pipeline.config)
        self.log = get_logger(component="openai", pipeline=self.model)
        # An input key the adapter fills, as the client's parameter (a stage's InvalidInput names the key).
        self.params = {opts["max_tokens_key"]: "max_tokens", opts["voice_key"]: "audio.voice",
                       opts["prompt_key"]: "messages", **{key: name for name, key in opts["sampling"].items()}}
        self.created = int(time.time())

    def routes(self) -> list[Any]:
        from starlette.routing import Route

        for endpoint in (self.models, self.one_model, self.chat_completions):
            endpoint.__func__.omni_error_body = error_body  # type: ignore[attr-defined]
        return [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.one_model, methods=["GET"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
        ]

    # -- errors -----------------------------------------------------------------------------------------------

    def client_param(self, field: Any) -> str | None:
        if not isinstance(field, str):
            return None
        if field.startswith("messages["):  # the adapter's labels of parts: the client's indices already
            return field.split(" ")[0]
        return self.params.get(field)

    def from_exception(self, exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str]]:
        """The OpenAI form of a request's error, logged: a client's mistake (4xx) at warning, a
        failure (5xx) at error with its traceback (the stage's, or this process's)."""
        from omni_core.serve import describe, log_error

        err = describe(exc)
        where = f" (stage {err.stage!r})" if err.stage else ""
        param = self.client_param(err.field)
        body = {"message": f"{err.type}{where}: {err.message}", "type": _ERROR_TYPES.get(err.status, "server_error"),
                "param": param, "code": err.type}
        log_error(self.log, "chat request failed" if err.status >= 500 else "chat request refused", err, exc,
                  **({"param": param} if param else {}))
        return err.status, body, err.headers

    def refused(self, request: Any, exc: BadRequest) -> Any:
        from starlette.responses import JSONResponse

        self.log.warning("chat request refused", path=request.url.path, status=exc.status, param=exc.param,
                         message=exc.message)
        body = {"message": exc.message, "type": _ERROR_TYPES.get(exc.status, "server_error"), "param": exc.param,
                "code": exc.code}
        return JSONResponse({"error": body}, status_code=exc.status)

    def failed(self, exc: BaseException) -> Any:
        from starlette.responses import JSONResponse

        status, body, headers = self.from_exception(exc)
        return JSONResponse({"error": body}, status_code=status, headers=headers)

    # -- the routes -------------------------------------------------------------------------------------------

    def model_card(self) -> dict[str, Any]:
        return {"id": self.model, "object": "model", "created": self.created, "owned_by": "omni"}

    async def models(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        return JSONResponse({"object": "list", "data": [self.model_card()]})

    async def one_model(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        name = request.path_params["model"]
        if name != self.model:
            return self.refused(request, BadRequest(f"the model {name!r} does not exist; this server serves "
                                                    f"{self.model!r}", "model", 404, "model_not_found"))
        return JSONResponse(self.model_card())

    async def chat_completions(self, request: Any) -> Any:
        from omni_core.serve import HTTPError, parse_json

        try:
            try:
                body = parse_json(await request.body())
            except HTTPError as exc:  # not JSON, or nested too deeply
                raise BadRequest(exc.message) from None
            req = parse_request(body, self.model, self.opts)
            req["include_usage"] = include_usage(body.get("stream_options"), req["stream"])
        except BadRequest as exc:
            return self.refused(request, exc)
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        request.scope.setdefault("state", {})["omni_request_id"] = rid
        n = len(req["choices"])
        ids = [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)]
        streams = [self.api.stream(inputs, request_id=request_id, headers=request.headers)
                   for inputs, request_id in zip(req["choices"], ids, strict=True)]
        events = streams[0] if n == 1 else _merged(streams)
        if req["stream"]:
            return await self._streamed(request, rid, req, events, n)
        return await self._collected(request, rid, req, events, ids)

    async def _collected(self, request: Any, rid: str, req: dict[str, Any], events: Any, ids: list[str]) -> Any:
        """The whole answer, once every choice is done."""
        from starlette.responses import JSONResponse

        from omni_core.serve import ClientGone

        n = len(ids)
        choices = [_Choice(req, self.opts) for _ in range(n)]

        async def collect() -> None:
            async for event in events:
                index, event = event if n > 1 else (0, event)
                choices[index].take(event)
                if all(c.done for c in choices):
                    return

        try:
            await self.api.until_disconnect(request.receive, collect())
        except ClientGone:
            return JSONResponse({}, status_code=499)
        except Exception as exc:
            return self.failed(exc)
        finally:
            await events.aclose()
        try:
            out = [choice.answer(index, ids[index]) for index, choice in enumerate(choices)]
        except RuntimeError as exc:
            return self.failed(exc)
        usages = [choice.usage for choice in choices]
        return JSONResponse({"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.model,
                             "choices": out, "usage": _total_usage(usages)})

    async def _streamed(self, request: Any, rid: str, req: dict[str, Any], events: Any, n: int) -> Any:
        """The answer as server-sent chunks; the first event (or the error that prevents it) is
        awaited before the response starts, so overload and unavailability keep their status codes."""
        from starlette.responses import JSONResponse

        from omni_core.serve import ClientGone, EventStream

        def tagged(event: Any) -> tuple[int, Any]:
            return event if n > 1 else (0, event)

        try:
            first = tagged(await self.api.until_disconnect(request.receive, events.__anext__()))
        except ClientGone:
            await events.aclose()
            return JSONResponse({}, status_code=499)
        except StopAsyncIteration:
            first = None
        except Exception as exc:
            await events.aclose()
            return self.failed(exc)
        chunks = _ChunkStream(self, rid, req, n)

        async def body() -> Any:
            item = first
            try:
                for index in range(n):
                    yield chunks.chunk(index, {"role": "assistant", "content": ""})
                while item is not None and not all(chunks.done):
                    for data in chunks.take(*item):
                        yield data
                    if all(chunks.done):
                        break
                    try:
                        item = tagged(await events.__anext__())
                    except StopAsyncIteration:
                        item = None
                if req["include_usage"]:
                    yield chunks.chunk(0, None, usage=_total_usage(chunks.usages))
            except Exception as exc:
                _, err, _ = self.from_exception(exc)
                yield f"data: {json.dumps({'error': err})}\n\n".encode()
            finally:
                await events.aclose()
            yield b"data: [DONE]\n\n"

        return EventStream(body())


def error_body(err: Any) -> dict[str, Any]:
    """The OpenAI shape of an error the server answers before the route runs (the 413 of
    serve.max_request_bytes)."""
    return {"error": {"message": f"{err.type}: {err.message}", "type": _ERROR_TYPES.get(err.status, "server_error"),
                      "param": None, "code": err.type}}


def _total_usage(usages: list[dict[str, int] | None]) -> dict[str, int] | None:
    """The usage of ``n`` choices: one prompt, every choice's completion tokens; None unless every
    choice has counts."""
    if not usages or any(u is None for u in usages):
        return None
    prompt = usages[0]["prompt_tokens"]  # type: ignore[index]
    completion = sum(u["completion_tokens"] for u in usages)  # type: ignore[index]
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class _Choice:
    """What one choice's events brought: text pieces, audio, the result; done at its result, or
    at a stop sequence the adapter applies."""

    def __init__(self, req: dict[str, Any], opts: dict[str, Any]) -> None:
        self.req, self.opts = req, opts
        self.pieces: list[str] = []
        self.pcm = bytearray()
        self.rates: list[int] = []
        self.result: Any = None
        self.done = False
        self.cut = StopText(req["stops"])

    def take(self, event: Any) -> None:
        req, opts = self.req, self.opts
        if self.done:
            return
        if event.is_result:
            self.result, self.done = event.data, True
        elif event.stage == req["text_stage"] and (piece := text_of(event.data, opts)):
            self.pieces.append(piece)
            if req["stops"]:
                self.cut.feed(opts["text_joiner"].join(self.pieces))
                self.done = self.cut.stopped
        elif req["audio"] and event.stage == opts["audio_stage"] and (data := audio_of(event.data, opts)) is not None:
            self.pcm.extend(data)
            self.rates.append(rate_of(event.data, opts))

    @property
    def usage(self) -> dict[str, int] | None:
        return usage_of(self.result, self.opts, self.req["text_stage"])[0]

    def answer(self, index: int, request_id: str) -> dict[str, Any]:
        """The choice of a whole answer; a RuntimeError when its audio chunks differ in rate."""
        req, opts = self.req, self.opts
        text = final_text(self.result, opts, self.pieces, req["text_stage"])
        finish_reason = usage_of(self.result, opts, req["text_stage"])[1]
        cuts = [i for i in (text.find(stop) for stop in req["stops"]) if i >= 0]
        if cuts:
            text, finish_reason = text[:min(cuts)], "stop"
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if req["audio"]:
            rate = self.rates[0] if self.rates else opts["sample_rate"]
            if any(r != rate for r in self.rates):
                raise RuntimeError(f"the {opts['audio_stage']} stage's audio chunks have different sample rates "
                                   f"({sorted(set(self.rates))}); one response holds one rate")
            data = wav_bytes(bytes(self.pcm), rate) if req["format"] == "wav" else bytes(self.pcm)
            message["audio"] = {"id": f"audio-{request_id}", "data": base64.b64encode(data).decode(),
                                "transcript": text, "expires_at": int(time.time()) + 3600, "sample_rate": rate}
        return {"index": index, "message": message, "finish_reason": finish_reason, "logprobs": None}


class _ChunkStream:
    """A streamed answer's chunks, choice by choice: :meth:`take` turns one ``(index, event)`` into
    the chunks it sends; ``done`` and ``usages`` say where each choice stands."""

    def __init__(self, chat: ChatApi, rid: str, req: dict[str, Any], n: int):
        self.model, self.opts, self.rid, self.req = chat.model, chat.opts, rid, req
        self.now = int(time.time())
        self.joined = [""] * n  # each choice's pieces joined
        self.pieces = [0] * n
        self.cuts = [StopText(req["stops"]) for _ in range(n)]  # what was sent of each, cut at a stop sequence
        self.done = [False] * n
        self.usages: list[dict[str, int] | None] = [None] * n
        self.audio_ids = [f"audio-{rid}" if n == 1 else f"audio-{rid}-{i}" for i in range(n)]

    def chunk(self, index: int, delta: dict[str, Any] | None, finish: str | None = None,
              usage: dict | None = None) -> bytes:
        data: dict[str, Any] = {
            "id": self.rid, "object": "chat.completion.chunk", "created": self.now, "model": self.model,
            "choices": [] if delta is None else [
                {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}],
        }
        if self.req["include_usage"]:
            data["usage"] = usage
        return f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()

    def _text(self, index: int, text: str) -> bytes:
        delta: dict[str, Any] = {"content": text}
        if self.req["audio"]:
            delta["audio"] = {"id": self.audio_ids[index], "transcript": text}
        return self.chunk(index, delta)

    def take(self, index: int, event: Any) -> list[bytes]:
        req, opts = self.req, self.opts
        if self.done[index]:
            return []
        if event.is_result:
            return self._result(index, event.data)
        out = []
        if event.stage == req["text_stage"] and (piece := text_of(event.data, opts)):
            self.joined[index] += piece if self.pieces[index] == 0 else opts["text_joiner"] + piece
            self.pieces[index] += 1
            if new := self.cuts[index].feed(self.joined[index]):
                out.append(self._text(index, new))
            if self.cuts[index].stopped:  # the rest of this choice is not wanted
                self.done[index] = True
                out.append(self.chunk(index, {}, "stop"))
        elif req["audio"] and event.stage == opts["audio_stage"] and (data := audio_of(event.data, opts)):
            out.append(self.chunk(index, {"audio": {"id": self.audio_ids[index],
                                                    "data": base64.b64encode(data).decode(), "transcript": "",
                                                    "sample_rate": rate_of(event.data, opts)}}))
        return out

    def _result(self, index: int, result: Any) -> list[bytes]:
        # What the streamed pieces lack of the whole text (the demo's final "."): one more delta,
        # so the deltas join to the non-streamed answer.
        out = []
        part = stage_part(result, self.req["text_stage"])
        whole = part.get(self.opts["result_text_field"]) if isinstance(part, Mapping) else None
        if rest := self.cuts[index].finish(whole if isinstance(whole, str) else self.joined[index]):
            out.append(self._text(index, rest))
        self.usages[index], finish_reason = usage_of(result, self.opts, self.req["text_stage"])
        self.done[index] = True
        out.append(self.chunk(index, {}, "stop" if self.cuts[index].stopped else finish_reason))
        return out


async def _merged(streams: list[Any]) -> Any:
    """The events of several streams as they come, each as ``(index of its stream, event)``;
    closing it closes them all (aborting the requests still running)."""
    import asyncio

    pending = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=pending.__getitem__):
                index = pending.pop(future)
                try:
                    event = future.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(streams[index].__anext__())] = index
                yield index, event
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)  # cancelled, or ended with the request's error
        for stream in streams:
            await stream.aclose()

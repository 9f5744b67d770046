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
          allow_local_files: false    # image_url may name a file on the server (else data URLs only)
          system_messages: true       # with messages_key: pass system / developer messages on
          sampling: {}                # OpenAI sampling parameter -> input key, e.g. {seed: seed}
          max_tokens_limit: null      # the largest max_tokens the pipeline takes
          max_choices: 8              # the largest n

With ``messages_key`` the stage gets the conversation in Qwen's chat format: each message's role
and content, a string or parts ``{"type": "text", "text"}``, ``{"type": "audio", "audio": bytes}``
(from ``input_audio``: base64 ``data`` of a ``wav``, ``mp3`` or ``flac`` file) and ``{"type":
"image", "image": bytes}`` (from ``image_url`` with a ``data:`` URL; a ``file://`` URL or a path
becomes ``"image": path`` only when ``allow_local_files`` is true; other URLs are refused).

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
"""

from __future__ import annotations

import base64
import io
import json
import time
import uuid
import wave
from collections.abc import Mapping
from typing import Any

from omni_core.logs import get_logger
from omni_core.options import parse_options

from .plugin import OPENAI_OPTIONS as OPTIONS

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
    terminals = list(pipeline_config.terminal_stages)
    if opts["text_stage"] is None:
        opts["text_stage"] = terminals[0]
    for key in ("text_stage", "text_only_stage", "audio_stage"):
        if opts[key] is not None and opts[key] not in pipeline_config.stage_names:
            raise ValueError(
                f"serve.options.openai.{key}: no stage {opts[key]!r} in pipeline {pipeline_config.name!r} "
                f"(stages: {', '.join(pipeline_config.stage_names)})"
            )
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
            raise BadRequest(f"{where}.image_url.url: this server reads no local files (serve option "
                             "allow_local_files); send the image as a data URL", f"{where}.image_url.url")
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
        raise BadRequest(
            f"the model {body['model']!r} does not exist; this server serves {model!r}",
            "model",
            404,
            "model_not_found",
        )
    if opts["messages_key"] is None:
        prompts = {opts["prompt_key"]: _prompt(body.get("messages"))}
    else:
        prompts = {opts["messages_key"]: _conversation(body.get("messages"), opts["allow_local_files"],
                                                       opts["system_messages"])}
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false", "stream")
    modalities = body.get("modalities") or ["text"]
    if (
        not isinstance(modalities, list)
        or not all(m in ("text", "audio") for m in modalities)
        or "text" not in modalities
    ):
        raise BadRequest('\'modalities\' must be ["text"] or ["text", "audio"]', "modalities")
    want_audio = "audio" in modalities
    audio = body.get("audio")
    fmt = None
    if want_audio:
        if opts["audio_stage"] is None:
            raise BadRequest(
                'this model has no audio output; ask for modalities ["text"]', "modalities"
            )
        if not isinstance(audio, Mapping):
            raise BadRequest(
                'modalities with \'audio\' need \'audio\': {"voice": ..., "format": "wav" | "pcm16"}',
                "audio",
            )
        fmt = audio.get("format", "pcm16" if stream else "wav")
        if fmt not in AUDIO_FORMATS:
            raise BadRequest(
                f"audio.format must be one of {', '.join(AUDIO_FORMATS)}, got {fmt!r}",
                "audio.format",
            )
        if stream and fmt != "pcm16":
            raise BadRequest("streamed audio must use audio.format 'pcm16'", "audio.format")
        voice = audio.get("voice")
        if not isinstance(voice, str) or not voice:
            raise BadRequest("audio.voice is required (a voice name)", "audio.voice")
        if opts["voices"] is not None and voice not in opts["voices"]:
            raise BadRequest(
                f"unknown voice {voice!r}; voices: {', '.join(opts['voices'])}", "audio.voice"
            )
    inputs = {
        **opts["inputs"],
        **(opts["audio_inputs"] if want_audio else opts["text_inputs"]),
        **prompts,
    }
    if want_audio and opts["voice_key"] is not None:
        inputs[opts["voice_key"]] = voice
    limits = []
    for name in ("max_completion_tokens", "max_tokens"):  # max_completion_tokens wins when both are sent
        limit = body.get(name)
        if limit is None:
            continue
        if not _is_int(limit) or limit < 1:
            raise BadRequest(f"'{name}' must be a positive integer, got {limit!r}", name)
        most = opts.get("max_tokens_limit")
        if most is not None and limit > most:
            raise BadRequest(f"'{name}' is {limit}; this model writes at most {most} tokens per answer", name)
        limits.append(limit)
    if limits and opts["max_tokens_key"] is not None:
        inputs[opts["max_tokens_key"]] = limits[0]
    sampling, n, stops = _parameters(body, opts)
    if stops and want_audio:
        raise BadRequest("'stop' with audio output is not supported: this model does not take stop sequences, and "
                         "the server can cut the text at one but not the speech; leave 'stop' out or ask for "
                         'modalities ["text"]', "stop")
    inputs.update(sampling)
    choices = [inputs]
    seed_key = opts["sampling"].get("seed")
    for index in range(1, n):  # choice i: seed + i (seed i without one), so no two choices share a seed
        if seed_key is None:
            choices.append(dict(inputs))
        else:
            choices.append({**inputs, seed_key: choice_seed(inputs.get(seed_key, 0), index)})
    text_stage = opts["text_stage"] if want_audio else opts.get("text_only_stage") or opts["text_stage"]
    return {"inputs": inputs, "choices": choices, "stops": stops, "stream": stream, "audio": want_audio, "format": fmt,
            "text_stage": text_stage}


def pcm16(audio: Any) -> bytes | None:
    """Mono audio as little-endian 16-bit PCM bytes; None when ``audio`` is not audio (a string,
    a mapping, None ...).

    - bytes, bytearray, memoryview: PCM16 already, returned as bytes (an odd length is an error);
    - a torch tensor or numpy array, 1-D (or ``[1, N]`` / ``[N, 1]``): int16 as is; any float dtype
      (bfloat16 and float16 widened to float32, exactly): NaN → 0, clipped to [-1, 1], × 32767,
      rounded half to even, in float32 (float64 stays float64);
    - a list or tuple: float samples, as a float32 array.
    """
    import numpy as np

    if isinstance(audio, (bytes, bytearray, memoryview)):
        data = bytes(audio)
        if len(data) % 2:
            raise ValueError(f"PCM16 audio needs an even number of bytes, got {len(data)}")
        return data
    if hasattr(audio, "detach") and hasattr(audio, "is_floating_point"):  # a torch tensor
        tensor = audio.detach().cpu()
        array = (tensor.float() if tensor.is_floating_point() else tensor).numpy()
    elif isinstance(audio, np.ndarray):
        array = audio
    elif isinstance(audio, (list, tuple)):
        array = np.asarray(audio, dtype=np.float32)
    else:
        return None
    if array.ndim != 1:
        if array.ndim == 2 and 1 in array.shape:
            array = array.reshape(-1)
        else:
            raise ValueError(f"audio must be mono (1-D samples), got shape {list(array.shape)}")
    if array.dtype.kind == "i" and array.dtype.itemsize == 2:  # int16, either byte order
        return array.astype("<i2", copy=False).tobytes()
    if not np.issubdtype(array.dtype, np.floating):
        raise ValueError(f"audio samples must be float in [-1, 1] or int16, got {array.dtype}")
    if array.dtype.itemsize < 4:
        array = array.astype(np.float32)
    array = np.clip(np.nan_to_num(array, nan=0.0), -1.0, 1.0) * array.dtype.type(32767)
    return np.rint(array).astype("<i2").tobytes()


def wav_bytes(pcm: bytes, sample_rate: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(sample_rate)
        out.writeframes(pcm)
    return buf.getvalue()


def stage_part(result: Any, stage: str) -> Any:
    """``stage``'s part of a pipeline result: ``result[stage]`` when the result is keyed by
    terminal stage (several terminals), else the result itself (one terminal). A one-stage result
    may have a field named like its stage (Qwen's text stage has ``text``): only a mapping under
    that key is taken for the stage's part."""
    if isinstance(result, Mapping) and isinstance(result.get(stage), Mapping):
        return result[stage]
    return result


def _final_text(result: Any, opts: dict[str, Any], pieces: list[str], stage: str) -> str:
    part = stage_part(result, stage)
    if isinstance(part, Mapping) and isinstance(part.get(opts["result_text_field"]), str):
        return part[opts["result_text_field"]]
    return opts["text_joiner"].join(pieces)


def include_usage(options: Any, stream: bool) -> bool:
    """``stream_options.include_usage`` of a request; ``stream_options`` go with ``stream: true``."""
    if options is None:
        return False
    if not stream:
        raise BadRequest("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(options, Mapping) or not isinstance(options.get("include_usage", False), bool):
        raise BadRequest("'stream_options' must be an object like {\"include_usage\": true}", "stream_options")
    return options.get("include_usage", False)


FINISH_REASONS = ("stop", "length")


def usage_of(result: Any, opts: dict[str, Any], stage: str) -> tuple[dict[str, int] | None, str]:
    """``(usage, finish_reason)`` from ``stage``'s part of the result (the result itself with one
    terminal stage): usage None unless both counts are non-negative ints; finish_reason
    ``"stop"`` unless the result says ``"length"``."""
    part = stage_part(result, stage)
    if not isinstance(part, Mapping):
        return None, "stop"
    finish = part.get(opts["finish_reason_field"])
    finish = finish if finish in FINISH_REASONS else "stop"
    counts = (part.get(opts["prompt_tokens_field"]), part.get(opts["completion_tokens_field"]))
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
        return None, finish
    return {"prompt_tokens": counts[0], "completion_tokens": counts[1], "total_tokens": sum(counts)}, finish


def make_routes(api: Any) -> list[Any]:
    """The API factory registered as ``openai``."""
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from omni_core.serve import ClientGone, EventStream, HTTPError, describe, log_error, parse_json

    model = api.pipeline_name
    opts = adapter_options(api.options, api.pipeline.config)
    log = get_logger(component="openai", pipeline=model)
    # An input key the adapter fills, as the client's parameter (a stage's InvalidInput names the key).
    params = {opts["max_tokens_key"]: "max_tokens", opts["voice_key"]: "audio.voice", opts["prompt_key"]: "messages",
              **{key: name for name, key in opts["sampling"].items()}}

    def client_param(field: Any) -> str | None:
        if not isinstance(field, str):
            return None
        if field.startswith("messages["):  # the adapter's labels of parts: the client's indices already
            return field.split(" ")[0]
        return params.get(field)
    created = int(time.time())

    def error(
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> JSONResponse:
        body = {
            "error": {
                "message": message,
                "type": _ERROR_TYPES.get(status, "server_error"),
                "param": param,
                "code": code,
            }
        }
        return JSONResponse(body, status_code=status, headers=headers)

    def from_exception(exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str]]:
        """The OpenAI form of a request's error, logged: a client's mistake (4xx) at warning, a
        failure (5xx) at error with its traceback (the stage's, or this process's)."""
        err = describe(exc)
        where = f" (stage {err.stage!r})" if err.stage else ""
        param = client_param(err.field)
        body = {
            "message": f"{err.type}{where}: {err.message}",
            "type": _ERROR_TYPES.get(err.status, "server_error"),
            "param": param,
            "code": err.type,
        }
        log_error(log, "chat request failed" if err.status >= 500 else "chat request refused", err, exc,
                  **({"param": param} if param else {}))
        return err.status, body, err.headers

    def text_of(chunk: Any) -> str | None:
        if isinstance(chunk, Mapping):
            value = chunk.get(opts["text_field"])
            return value if isinstance(value, str) else None
        return chunk if isinstance(chunk, str) else None

    def audio_of(chunk: Any) -> bytes | None:
        if isinstance(chunk, Mapping) and opts["audio_field"] in chunk:
            return pcm16(chunk[opts["audio_field"]])
        return None

    def rate_of(chunk: Any) -> int:
        rate = (
            chunk.get(opts["sample_rate_field"])
            if isinstance(chunk, Mapping) and opts["sample_rate_field"]
            else None
        )
        return (
            int(rate)
            if isinstance(rate, int) and not isinstance(rate, bool) and rate > 0
            else opts["sample_rate"]
        )

    def model_card() -> dict[str, Any]:
        return {"id": model, "object": "model", "created": created, "owned_by": "omni"}

    async def models(request):
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def one_model(request):
        name = request.path_params["model"]
        if name != model:
            return refused(request, BadRequest(f"the model {name!r} does not exist; this server serves {model!r}",
                                               "model", 404, "model_not_found"))
        return JSONResponse(model_card())

    def refused(request: Any, exc: BadRequest) -> JSONResponse:
        log.warning("chat request refused", path=request.url.path, status=exc.status, param=exc.param,
                    message=exc.message)
        return error(exc.status, exc.message, param=exc.param, code=exc.code)

    def failed(exc: BaseException) -> JSONResponse:
        status, body, headers = from_exception(exc)
        return JSONResponse({"error": body}, status_code=status, headers=headers)

    async def chat_completions(request):
        try:
            try:
                body = parse_json(await request.body())
            except HTTPError as exc:  # not JSON, or nested too deeply
                raise BadRequest(exc.message) from None
            req = parse_request(body, model, opts)
            req["include_usage"] = include_usage(body.get("stream_options"), req["stream"])
        except BadRequest as exc:
            return refused(request, exc)
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        request.scope.setdefault("state", {})["omni_request_id"] = rid
        n = len(req["choices"])
        ids = [rid] if n == 1 else [f"{rid}-{i}" for i in range(n)]
        streams = [api.stream(inputs, request_id=request_id, headers=request.headers)
                   for inputs, request_id in zip(req["choices"], ids, strict=True)]
        events = streams[0] if n == 1 else _merged(streams)
        if req["stream"]:
            return await _streamed(request, rid, req, events, n)
        choices = [_Choice(req["stops"]) for _ in range(n)]

        async def collect():
            async for event in events:
                index, event = event if n > 1 else (0, event)
                choices[index].take(event, req)
                if all(c.done for c in choices):
                    return

        try:
            await api.until_disconnect(request.receive, collect())
        except ClientGone:
            return JSONResponse({}, status_code=499)
        except Exception as exc:
            return failed(exc)
        finally:
            await events.aclose()
        out = []
        usage_total: dict[str, int] | None = None
        for index, choice in enumerate(choices):
            text = _final_text(choice.result, opts, choice.pieces, req["text_stage"])
            usage, finish_reason = usage_of(choice.result, opts, req["text_stage"])
            cuts = [i for i in (text.find(stop) for stop in req["stops"]) if i >= 0]
            if cuts:
                text, finish_reason = text[:min(cuts)], "stop"
            if usage is not None:  # n choices: one prompt, every choice's completion tokens
                usage_total = dict(usage) if usage_total is None else {
                    "prompt_tokens": usage_total["prompt_tokens"],
                    "completion_tokens": usage_total["completion_tokens"] + usage["completion_tokens"],
                    "total_tokens": usage_total["total_tokens"] + usage["completion_tokens"]}
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if req["audio"]:
                rate = choice.rates[0] if choice.rates else opts["sample_rate"]
                if any(r != rate for r in choice.rates):
                    return failed(RuntimeError(
                        f"the {opts['audio_stage']} stage's audio chunks have different sample rates "
                        f"({sorted(set(choice.rates))}); one response holds one rate"))
                data = wav_bytes(bytes(choice.pcm), rate) if req["format"] == "wav" else bytes(choice.pcm)
                message["audio"] = {
                    "id": f"audio-{ids[index]}",
                    "data": base64.b64encode(data).decode(),
                    "transcript": text,
                    "expires_at": int(time.time()) + 3600,
                    "sample_rate": rate,
                }
            out.append({"index": index, "message": message, "finish_reason": finish_reason, "logprobs": None})
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": model,
                "choices": out,
                "usage": None if any(usage_of(c.result, opts, req["text_stage"])[0] is None for c in choices)
                else usage_total,
            }
        )

    class _Choice:
        """What one choice's events brought: text pieces, audio, the result; done at its result,
        or at a stop sequence the adapter applies."""

        def __init__(self, stops: list[str]) -> None:
            self.pieces: list[str] = []
            self.pcm = bytearray()
            self.rates: list[int] = []
            self.result: Any = None
            self.done = False
            self.cut = StopText(stops)

        def take(self, event: Any, req: dict[str, Any]) -> None:
            if self.done:
                return
            if event.is_result:
                self.result, self.done = event.data, True
            elif event.stage == req["text_stage"] and (piece := text_of(event.data)):
                self.pieces.append(piece)
                if req["stops"]:
                    self.cut.feed(opts["text_joiner"].join(self.pieces))
                    self.done = self.cut.stopped
            elif req["audio"] and event.stage == opts["audio_stage"] and (data := audio_of(event.data)) is not None:
                self.pcm.extend(data)
                self.rates.append(rate_of(event.data))

    async def _streamed(request, rid, req, events, n):
        now = int(time.time())

        def chunk(index: int, delta: dict[str, Any] | None, finish: str | None = None,
                  usage: dict | None = None) -> bytes:
            data: dict[str, Any] = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": now,
                "model": model,
                "choices": [] if delta is None else [
                    {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
                ],
            }
            if req["include_usage"]:
                data["usage"] = usage
            return f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()

        def tagged(event: Any) -> tuple[int, Any]:
            return event if n > 1 else (0, event)

        # The first event (or the error that prevents it) before the response starts, so
        # overload and unavailability keep their status codes.
        try:
            first = tagged(await api.until_disconnect(request.receive, events.__anext__()))
        except ClientGone:
            await events.aclose()
            return JSONResponse({}, status_code=499)
        except StopAsyncIteration:
            first = None
        except Exception as exc:
            await events.aclose()
            return failed(exc)

        async def body():
            item = first
            joined = [""] * n  # each choice's pieces joined
            pieces = [0] * n
            cuts = [StopText(req["stops"]) for _ in range(n)]  # what was sent of each, cut at a stop sequence
            done = [False] * n
            usages: list[dict[str, int] | None] = [None] * n
            audio_ids = [f"audio-{rid}" if n == 1 else f"audio-{rid}-{i}" for i in range(n)]

            def text_delta(index: int, text: str) -> bytes:
                delta: dict[str, Any] = {"content": text}
                if req["audio"]:
                    delta["audio"] = {"id": audio_ids[index], "transcript": text}
                return chunk(index, delta)

            try:
                for index in range(n):
                    yield chunk(index, {"role": "assistant", "content": ""})
                while item is not None and not all(done):
                    index, event = item
                    if done[index]:
                        pass
                    elif event.is_result:
                        # What the streamed pieces lack of the whole text (the demo's final "."): one
                        # more delta, so the deltas join to the non-streamed answer.
                        part = stage_part(event.data, req["text_stage"])
                        whole = part.get(opts["result_text_field"]) if isinstance(part, Mapping) else None
                        if rest := cuts[index].finish(whole if isinstance(whole, str) else joined[index]):
                            yield text_delta(index, rest)
                        usages[index], finish_reason = usage_of(event.data, opts, req["text_stage"])
                        done[index] = True
                        yield chunk(index, {}, "stop" if cuts[index].stopped else finish_reason)
                    elif event.stage == req["text_stage"] and (piece := text_of(event.data)):
                        joined[index] += piece if pieces[index] == 0 else opts["text_joiner"] + piece
                        pieces[index] += 1
                        if new := cuts[index].feed(joined[index]):
                            yield text_delta(index, new)
                        if cuts[index].stopped:  # the rest of this choice is not wanted
                            done[index] = True
                            yield chunk(index, {}, "stop")
                    elif (
                        req["audio"]
                        and event.stage == opts["audio_stage"]
                        and (data := audio_of(event.data))
                    ):
                        yield chunk(index, {"audio": {"id": audio_ids[index], "data": base64.b64encode(data).decode(),
                                                      "transcript": "", "sample_rate": rate_of(event.data)}})
                    if all(done):
                        break
                    try:
                        item = tagged(await events.__anext__())
                    except StopAsyncIteration:
                        item = None
                if req["include_usage"]:
                    usage = None
                    if all(u is not None for u in usages):
                        completion = sum(u["completion_tokens"] for u in usages)  # type: ignore[index]
                        prompt = usages[0]["prompt_tokens"]  # type: ignore[index]
                        usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                                 "total_tokens": prompt + completion}
                    yield chunk(0, None, usage=usage)
            except Exception as exc:
                _, err, _ = from_exception(exc)
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

    for endpoint in (models, one_model, chat_completions):
        endpoint.omni_error_body = error_body  # type: ignore[attr-defined]

    return [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", one_model, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]


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

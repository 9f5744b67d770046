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

With ``messages_key`` the stage gets the conversation in Qwen's chat format: each message's role
and content, a string or parts ``{"type": "text", "text"}``, ``{"type": "audio", "audio": bytes}``
(from ``input_audio``: base64 ``data`` of a ``wav``, ``mp3`` or ``flac`` file) and ``{"type":
"image", "image": bytes}`` (from ``image_url`` with a ``data:`` URL; a ``file://`` URL or a path
becomes ``"image": path`` only when ``allow_local_files`` is true; other URLs are refused).

Audio in a chunk is either mono little-endian 16-bit PCM (``bytes``) or samples: a 1-D torch
tensor, numpy array or list, float in [-1, 1] (any float dtype, bfloat16 included: clipped, scaled
by 32767 and rounded half to even, as omni-transformers writes its WAV files) or int16 (as is).

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

from omni_core.options import parse_options

from .plugin import OPENAI_OPTIONS as OPTIONS

#: Adapter options and their defaults (the schema is :data:`.plugin.OPENAI_OPTIONS`).
DEFAULTS: dict[str, Any] = {name: option.default for name, option in OPTIONS.items()}

AUDIO_FORMATS = ("wav", "pcm16")

_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    409: "invalid_request_error",
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
        if not isinstance(message, Mapping) or "role" not in message:
            raise BadRequest(
                f"messages[{i}] must be an object with 'role' and 'content'", f"messages[{i}]"
            )
    if not any(m["role"] == "user" for m in messages):
        raise BadRequest("'messages' needs at least one message with role 'user'", "messages")


def _prompt(messages: Any) -> str:
    _prompt_checks(messages)
    content = [m for m in messages if m["role"] == "user"][-1].get("content")
    if isinstance(content, list):  # content parts: keep the text ones
        content = " ".join(
            p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text"
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
        return {"type": "audio", "audio": _b64(audio.get("data"), f"{where}.input_audio.data")}
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
            return {"type": "image", "image": _b64(data, f"{where}.image_url.url")}
        if "://" in url and not url.startswith("file://"):
            raise BadRequest(f"{where}.image_url.url: this server does not fetch URLs; send the image as a data URL",
                             f"{where}.image_url.url")
        if not allow_local_files:
            raise BadRequest(f"{where}.image_url.url: this server reads no local files (serve option "
                             "allow_local_files); send the image as a data URL", f"{where}.image_url.url")
        return {"type": "image", "image": url.removeprefix("file://")}
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


def parse_request(body: Any, model: str, opts: dict[str, Any]) -> dict[str, Any]:
    """Check a chat completion request; returns what the handler needs."""
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
        or not set(modalities) <= {"text", "audio"}
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
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise BadRequest("max_tokens must be a positive integer", "max_tokens")
        if opts["max_tokens_key"] is not None:
            inputs[opts["max_tokens_key"]] = limit
    text_stage = opts["text_stage"] if want_audio else opts.get("text_only_stage") or opts["text_stage"]
    return {"inputs": inputs, "stream": stream, "audio": want_audio, "format": fmt, "text_stage": text_stage}


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

    from omni_core.serve import ClientGone, EventStream, describe

    model = api.pipeline_name
    opts = adapter_options(api.options, api.pipeline.config)
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
        err = describe(exc)
        where = f" (stage {err.stage!r})" if err.stage else ""
        body = {
            "message": f"{err.type}{where}: {err.message}",
            "type": _ERROR_TYPES.get(err.status, "server_error"),
            "param": None,
            "code": err.type,
        }
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

    async def models(request):
        return JSONResponse(
            {
                "object": "list",
                "data": [{"id": model, "object": "model", "created": created, "owned_by": "omni"}],
            }
        )

    async def chat_completions(request):
        try:
            try:
                body = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise BadRequest(f"the body is not valid JSON: {exc}") from None
            req = parse_request(body, model, opts)
            req["include_usage"] = include_usage(body.get("stream_options"), req["stream"])
        except BadRequest as exc:
            return error(exc.status, exc.message, param=exc.param, code=exc.code)
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        request.scope.setdefault("state", {})["omni_request_id"] = rid
        events = api.stream(req["inputs"], request_id=rid, headers=request.headers)
        if req["stream"]:
            return await _streamed(request, rid, req, events)
        pieces: list[str] = []
        pcm = bytearray()
        rates: list[int] = []

        async def collect():
            async for event in events:
                if event.is_result:
                    return event.data
                if event.stage == req["text_stage"] and (piece := text_of(event.data)):
                    pieces.append(piece)
                elif (
                    req["audio"]
                    and event.stage == opts["audio_stage"]
                    and (data := audio_of(event.data)) is not None
                ):
                    pcm.extend(data)
                    rates.append(rate_of(event.data))
            return None

        try:
            result = await api.until_disconnect(request.receive, collect())
        except ClientGone:
            return JSONResponse({}, status_code=499)
        except Exception as exc:
            status, body, headers = from_exception(exc)
            return JSONResponse({"error": body}, status_code=status, headers=headers)
        finally:
            await events.aclose()
        text = _final_text(result, opts, pieces, req["text_stage"])
        usage, finish_reason = usage_of(result, opts, req["text_stage"])
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if req["audio"]:
            rate = rates[0] if rates else opts["sample_rate"]
            if any(r != rate for r in rates):
                return error(
                    500,
                    f"the {opts['audio_stage']} stage's audio chunks have different sample rates "
                    f"({sorted(set(rates))}); one response holds one rate",
                    code="AudioError",
                )
            data = wav_bytes(bytes(pcm), rate) if req["format"] == "wav" else bytes(pcm)
            message["audio"] = {
                "id": f"audio-{rid}",
                "data": base64.b64encode(data).decode(),
                "transcript": text,
                "expires_at": int(time.time()) + 3600,
                "sample_rate": rate,
            }
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": model,
                "choices": [
                    {"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}
                ],
                "usage": usage,
            }
        )

    async def _streamed(request, rid, req, events):
        now = int(time.time())

        def chunk(delta: dict[str, Any] | None, finish: str | None = None, usage: dict | None = None) -> bytes:
            data: dict[str, Any] = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": now,
                "model": model,
                "choices": [] if delta is None else [
                    {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
                ],
            }
            if req["include_usage"]:
                data["usage"] = usage
            return f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()

        # The first event (or the error that prevents it) before the response starts, so
        # overload and unavailability keep their status codes.
        try:
            first = await api.until_disconnect(request.receive, events.__anext__())
        except ClientGone:
            await events.aclose()
            return JSONResponse({}, status_code=499)
        except StopAsyncIteration:
            first = None
        except Exception as exc:
            await events.aclose()
            status, body, headers = from_exception(exc)
            return JSONResponse({"error": body}, status_code=status, headers=headers)

        async def body():
            event = first
            pieces = 0
            audio_id = f"audio-{rid}"
            try:
                yield chunk({"role": "assistant", "content": ""})
                while event is not None and not event.is_result:
                    if event.stage == req["text_stage"] and (piece := text_of(event.data)):
                        text = piece if pieces == 0 else opts["text_joiner"] + piece
                        pieces += 1
                        delta: dict[str, Any] = {"content": text}
                        if req["audio"]:
                            delta["audio"] = {"id": audio_id, "transcript": text}
                        yield chunk(delta)
                    elif (
                        req["audio"]
                        and event.stage == opts["audio_stage"]
                        and (data := audio_of(event.data))
                    ):
                        yield chunk(
                            {
                                "audio": {
                                    "id": audio_id,
                                    "data": base64.b64encode(data).decode(),
                                    "transcript": "",
                                    "sample_rate": rate_of(event.data),
                                }
                            }
                        )
                    try:
                        event = await events.__anext__()
                    except StopAsyncIteration:
                        event = None
                usage, finish_reason = usage_of(event.data if event is not None else None, opts, req["text_stage"])
                yield chunk({}, finish_reason)
                if req["include_usage"]:
                    yield chunk(None, usage=usage)
            except Exception as exc:
                _, err, _ = from_exception(exc)
                yield f"data: {json.dumps({'error': err})}\n\n".encode()
            finally:
                await events.aclose()
            yield b"data: [DONE]\n\n"

        return EventStream(body())

    return [
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]

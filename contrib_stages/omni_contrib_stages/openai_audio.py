"""OpenAI's audio endpoints for the ``openai`` API of ``omni serve``: ``POST /v1/audio/transcriptions``
(speech in, text out) and ``POST /v1/audio/speech`` (text in, speech out).

A pipeline declares what it is with ``kind`` in its ``openai`` adapter (``chat``, the default,
mounts ``/v1/chat/completions``; ``asr`` mounts the transcriptions route; ``tts`` the speech
route; ``/v1/models`` is always there). The ``audio`` mapping says how a request becomes the
pipeline's inputs and how its result becomes the answer; every key is optional::

    serve:
      apis: [openai]
      options:
        openai:
          kind: asr                   # chat | asr | tts
          text_stage: asr             # the openai adapter's own keys say where text / audio come from:
          text_field: text            #   text_stage, text_field, result_text_field (asr);
          audio_stage: tts            #   audio_stage, audio_field, sample_rate, sample_rate_field,
          voices: ["0", "1"]          #   voices, voice_key, prompt_tokens_field, completion_tokens_field (tts)
          audio:
            # asr
            audio_key: audio            # the file's samples (1-D float32 tensor, mono) go to inputs[audio_key]
            sample_rate_key: sample_rate  # ... and its sample rate to inputs[sample_rate_key] (null: not passed)
            input_sample_rate: null     # resample the file to this rate first, with soxr as a realtime
                                        #   session's turn (null: the file's own rate)
            max_audio_seconds: 600      # a longer file is refused (400)
            language_key: null          # `language` goes to inputs[language_key] (null: refused unless absent)
            prompt_key: null            # `prompt` goes here (null: refused unless absent or empty)
            temperature_key: null       # `temperature` goes here (null: refused unless absent or 0)
            text_joiner: ""             # put between two streamed pieces of text
            timestamps_key: timestamps  # verbose_json, srt, vtt: inputs[timestamps_key] = true, so the stage makes
                                        #   its segments (null: not passed; Whisper's stage reads `timestamps`)
            segments_field: segments    # result[segments_field]: [{start, end, text}] for verbose_json, srt, vtt
            language_field: language    # result[language_field]: the language for verbose_json
            # tts
            input_key: text             # `input` goes to inputs[input_key]
            max_input_chars: 4096       # a longer input is refused (400)
            speed_key: null             # `speed` goes here (null: refused unless absent or 1.0)
            instructions_key: null      # `instructions` go here (null: refused unless absent or empty)
            inputs: {}                  # merged into every request's inputs

Transcriptions take OpenAI's multipart form (``file``, ``model``, ``language``, ``prompt``,
``temperature``, ``response_format`` json | text | srt | vtt | verbose_json, ``stream`` (``"true"``:
``transcript.text.delta`` events, then ``transcript.text.done`` with the whole text and usage),
``timestamp_granularities[]`` (``segment``), ``include[]`` (none supported); the file is WAV,
FLAC, OGG or MP3 (whatever soundfile reads), mono or mixed down to mono. Speech takes OpenAI's JSON
body (``model``, ``input``, ``voice``, ``response_format`` wav | pcm | flac | mp3 | opus,
``speed``, ``instructions``, ``stream_format`` audio | sse) and answers the audio as it is made: a
chunked body (``wav`` with an open-ended header at the pipeline's rate, ``pcm``: raw 16-bit
little-endian mono at 24 kHz as OpenAI documents it, resampled as a stream by
:class:`~omni_contrib_stages.api_common.Resampler` when the pipeline's rate differs; the
``x-sample-rate`` header says the rate), or with
``stream_format: "sse"`` the ``speech.audio.delta`` {audio: base64 PCM16 at 24 kHz} events and a
``speech.audio.done`` {usage}. flac, mp3 and
opus are encoded whole at the end with soundfile when its libsndfile writes them (else 400 naming
the formats it does); aac is refused (400). ``Accept`` is never negotiated on.

Both go through the API context's ``submit``/``stream`` (API keys, network flag, metrics, drain
and timeouts as on the chat route); errors have OpenAI's shape and the same status codes.
"""

from __future__ import annotations

import base64
import io
import json
import math
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from omni_core.options import Option, parse_options

from .api_common import Resampler, resample

#: The options schema of ``serve.options.openai.audio``.
AUDIO_OPTIONS: dict[str, Option] = {
    "audio_key": Option("str", "audio", "asr: the file's mono samples (1-D float32 tensor) go to inputs[audio_key]"),
    "sample_rate_key": Option("str", "sample_rate", "asr: the samples' rate goes to inputs[sample_rate_key] "
                              "(null: not passed)", nullable=True),
    "input_sample_rate": Option("positive_int", None, "asr: resample the file to this rate first (soxr, as a "
                                "realtime session's turn; null: the file's own)", nullable=True),
    "max_audio_seconds": Option("positive_number", 600.0, "asr: a longer file is refused (400)"),
    "language_key": Option("str", None, "asr: `language` goes to inputs[language_key] (null: refused unless "
                           "absent)", nullable=True),
    "prompt_key": Option("str", None, "asr: `prompt` goes to inputs[prompt_key] (null: refused unless absent "
                         "or empty)", nullable=True),
    "temperature_key": Option("str", None, "asr: `temperature` goes to inputs[temperature_key] (null: refused "
                              "unless absent or 0)", nullable=True),
    "text_joiner": Option("str", "", "asr: put between two streamed pieces of text"),
    "timestamps_key": Option("str", "timestamps", "asr: for response_format verbose_json, srt and vtt, true goes "
                             "to inputs[timestamps_key] so the stage makes the result's segments (null: not "
                             "passed; the default is the input Whisper's stage reads)", nullable=True),
    "segments_field": Option("str", "segments", "asr: result[segments_field] is a list of {start, end, text} "
                             "(seconds) for verbose_json, srt and vtt (absent: one segment, the whole file)"),
    "language_field": Option("str", "language", "asr: result[language_field] is the language verbose_json "
                             "reports"),
    "input_key": Option("str", "text", "tts: `input` goes to inputs[input_key]"),
    "max_input_chars": Option("positive_int", 4096, "tts: a longer `input` is refused (400)"),
    "speed_key": Option("str", None, "tts: `speed` goes to inputs[speed_key] (null: refused unless absent or "
                        "1.0)", nullable=True),
    "instructions_key": Option("str", None, "tts: `instructions` go to inputs[instructions_key] (null: refused "
                               "unless absent or empty)", nullable=True),
    "inputs": Option("mapping", {}, "merged into every request's inputs"),
}

KINDS = ("chat", "asr", "tts")

TRANSCRIPTION_FIELDS = ("file", "model", "language", "prompt", "response_format", "temperature", "stream",
                        "timestamp_granularities[]", "include[]", "chunking_strategy")
TRANSCRIPTION_FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
#: The formats that carry segments: for them the stage is asked for timestamps (``timestamps_key``).
TIMESTAMPED_FORMATS = ("srt", "vtt", "verbose_json")
SPEECH_FIELDS = ("model", "input", "voice", "response_format", "speed", "instructions", "stream_format")
#: Speech formats answered as they are made, and those encoded whole with soundfile (when it can).
STREAMED_FORMATS = ("wav", "pcm")
#: OpenAI's raw speech audio (``response_format: pcm``, and the SSE deltas): 16-bit little-endian
#: mono PCM at 24 kHz, whatever rate the pipeline speaks at.
PCM_RATE = 24000
ENCODED_FORMATS = {"flac": ("FLAC", "PCM_16"), "mp3": ("MP3", "MPEG_LAYER_III"), "opus": ("OGG", "OPUS")}
SPEECH_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")

_TYPES = {400: "invalid_request_error", 404: "not_found_error", 409: "invalid_request_error",
          413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable", 504: "timeout"}


class Refused(Exception):
    """A client's mistake, answered in OpenAI's error shape."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def audio_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    """``serve.options.openai.audio`` with defaults (an ``OptionsError`` lists every problem)."""
    return parse_options(AUDIO_OPTIONS, options or {}, "serve.options.openai.audio", owner="API 'openai'")


def writable_formats() -> tuple[str, ...]:
    """The speech formats this server answers: wav and pcm always, the others when soundfile's
    libsndfile writes them."""
    try:
        import soundfile
    except ImportError:  # pragma: no cover - soundfile is a dependency of this package's audio
        return STREAMED_FORMATS
    out = list(STREAMED_FORMATS)
    for name, (fmt, subtype) in ENCODED_FORMATS.items():
        if soundfile.check_format(fmt, subtype):
            out.append(name)
    return tuple(out)


# -- reading an upload ------------------------------------------------------------------------------


def read_audio(data: bytes, filename: str | None, max_seconds: float, rate: int | None) -> tuple[Any, int]:
    """``(mono float32 samples, sample rate)`` of an uploaded file, or :class:`Refused`."""
    import numpy as np
    import soundfile

    name = filename or "the file"
    if not data:
        raise Refused(f"the uploaded file {name!r} is empty; send a WAV, FLAC, OGG or MP3 file", "file")
    try:
        info = soundfile.info(io.BytesIO(data))
    except Exception:  # soundfile raises its own LibsndfileError (a RuntimeError) and others for junk
        raise Refused(f"the uploaded file {name!r} is not audio this server reads: send a WAV, FLAC, OGG or MP3 "
                      "file", "file") from None
    if info.frames <= 0 or info.samplerate <= 0:
        raise Refused(f"the uploaded file {name!r} holds no audio", "file")
    seconds = info.frames / info.samplerate
    if seconds > max_seconds:
        raise Refused(f"the uploaded file {name!r} is {seconds:.1f} s long; this server transcribes at most "
                      f"{max_seconds:g} s (serve.options.openai.audio.max_audio_seconds)", "file")
    try:
        samples, sr = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception:
        raise Refused(f"the uploaded file {name!r} could not be decoded (truncated or corrupt?)", "file") from None
    mono = samples.mean(axis=1, dtype=np.float32)
    if rate is not None and rate != sr:
        mono, sr = resample(mono, sr, rate), rate  # as a realtime session's turn is resampled
    return mono, sr


# -- transcription formats --------------------------------------------------------------------------


def _clock(seconds: float, sep: str) -> str:
    ms = max(0, round(seconds * 1000))
    h, ms = divmod(ms, 3_600_000)
    m, ms = divmod(ms, 60_000)
    s, ms = divmod(ms, 1000)
    return f"{h:02d}:{m:02d}:{s:02d}{sep}{ms:03d}"


def srt(segments: list[dict[str, Any]]) -> str:
    return "".join(f"{i}\n{_clock(s['start'], ',')} --> {_clock(s['end'], ',')}\n{s['text'].strip()}\n\n"
                   for i, s in enumerate(segments, 1))


def vtt(segments: list[dict[str, Any]]) -> str:
    return "WEBVTT\n\n" + "".join(f"{_clock(s['start'], '.')} --> {_clock(s['end'], '.')}\n{s['text'].strip()}\n\n"
                                  for s in segments)


#: A segment's fields that verbose_json passes on when the result's segment has them (none is made up).
SEGMENT_EXTRAS = ("seek", "tokens", "temperature", "avg_logprob", "compression_ratio", "no_speech_prob")


def segments_of(part: Any, field: str, text: str, duration: float) -> list[dict[str, Any]]:
    """The result's segments as ``{id, start, end, text}`` (one segment of the whole file when it
    gives none, or gives them malformed)."""
    raw = part.get(field) if isinstance(part, Mapping) else None
    out = []
    if isinstance(raw, list):
        for i, seg in enumerate(raw):
            if not (isinstance(seg, Mapping) and isinstance(seg.get("text"), str)
                    and all(isinstance(seg.get(k), (int, float)) and not isinstance(seg.get(k), bool)
                            for k in ("start", "end"))):
                out = []
                break
            extra = {k: seg[k] for k in SEGMENT_EXTRAS if k in seg}
            out.append({"id": i, "start": float(seg["start"]), "end": float(seg["end"]), "text": seg["text"], **extra})
    return out or [{"id": 0, "start": 0.0, "end": duration, "text": text}]


def _form_value(form: Any, name: str) -> str | None:
    values = form.getlist(name)
    if not values:
        return None
    if len(values) > 1:
        raise Refused(f"'{name}' was sent {len(values)} times; send it once", name)
    value = values[0]
    if not isinstance(value, str):
        raise Refused(f"'{name}' must be a plain form field, not a file", name)
    return value


def make_routes(api: Any) -> list[Any]:
    """The API factory registered as ``openai``: the chat API's routes
    (:func:`omni_contrib_stages.openai_api.make_routes`) for ``kind: chat``; for ``asr`` and
    ``tts`` its ``/v1/models`` and this module's endpoint instead of ``/v1/chat/completions``.
    A server of several pipelines (``omni serve A B``) gets each pipeline's routes behind one
    route per path that picks the pipeline by the request's ``model`` (:func:`by_model`)."""
    peers = api.peers() if hasattr(api, "peers") else {api.pipeline_name: api}
    if len(peers) == 1:
        return pipeline_routes(api)
    return by_model({name: pipeline_routes(peer) for name, peer in peers.items()})


def pipeline_routes(api: Any) -> list[Any]:
    """One pipeline's ``openai`` routes."""
    from .openai_api import adapter_options
    from .openai_api import make_routes as chat_routes

    routes = chat_routes(api)
    opts = adapter_options(api.options, api.pipeline.config)
    if opts["kind"] == "chat":
        return routes
    kept = [r for r in routes if getattr(r, "path", None) != "/v1/chat/completions"]
    error_body = getattr(kept[0].endpoint, "omni_error_body", None) if kept else None
    return kept + audio_routes(api, opts, opts["kind"], error_body)


#: How a request to each path names its model: in the JSON body, the multipart form, the path.
_MODEL_IN = {"/v1/chat/completions": "json", "/v1/audio/speech": "json", "/v1/audio/transcriptions": "form",
             "/v1/models/{model:path}": "path"}


def by_model(served: dict[str, list[Any]]) -> list[Any]:
    """One route per (path, method) over the routes of several pipelines (``served``: each
    pipeline's, by name, in the server's order): ``GET /v1/models`` lists every pipeline; the
    others hand the request to the routes of the pipeline its ``model`` names (a model that does
    not exist is a 404 naming those served, one served that has no such route a 400 naming the
    ones that have it; without a model the first pipeline that has the route answers, saying what
    is missing)."""
    from starlette.exceptions import HTTPException
    from starlette.formparsers import MultiPartException
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from omni_core.serve import HTTPError, parse_json

    def error(status: int, message: str, param: str | None = "model", code: str | None = None) -> Any:
        return JSONResponse({"error": {"message": message, "type": _TYPES.get(status, "server_error"),
                                       "param": param, "code": code}}, status_code=status)

    table: dict[tuple[str, str], dict[str, Any]] = {}
    for name, routes in served.items():
        for route in routes:
            for method in sorted(route.methods or ()):
                if method != "HEAD":
                    table.setdefault((route.path, method), {})[name] = route.endpoint
    names = list(served)
    listed = ", ".join(repr(n) for n in names)

    async def model_of(request: Any, path: str) -> Any:
        where = _MODEL_IN.get(path)
        if where == "path":
            return request.path_params.get("model")
        if where == "json":
            try:
                body = parse_json(await request.body())
            except HTTPError:
                return None  # the pipeline's own route says what is wrong with the body
            return body.get("model") if isinstance(body, dict) else None
        if where == "form":
            # Read once (with the limits of the transcription route, which reads the same form).
            form = await request.form(max_files=1, max_fields=len(TRANSCRIPTION_FIELDS) + 8, max_part_size=64 * 1024)
            value = form.get("model")
            return value if isinstance(value, str) else None
        return None

    def dispatcher(path: str, method: str, endpoints: dict[str, Any]) -> Any:
        first = next(iter(endpoints.values()))

        async def dispatch(request: Any) -> Any:
            ctype = request.headers.get("content-type", "").lower()
            try:
                if _MODEL_IN.get(path) == "form" and not ctype.startswith("multipart/form-data"):
                    return await first(request)  # refused there, naming the content type
                model = await model_of(request, path)
            except (HTTPException, MultiPartException) as exc:
                return error(400, f"the multipart form could not be read: {getattr(exc, 'detail', None) or exc}", None)
            if model is None or model == "":
                return await first(request)  # "'model' is required", or what else is wrong
            endpoint = endpoints.get(model)
            if endpoint is not None:
                return await endpoint(request)
            if model not in served:
                return error(404, f"the model {model!r} does not exist; this server serves {listed}",
                             code="model_not_found")
            having = ", ".join(repr(n) for n in endpoints)
            return error(400, f"the model {model!r} does not serve {method} {path.split('{')[0].rstrip('/')}; "
                              f"the models that do: {having}")

        dispatch.omni_error_body = getattr(first, "omni_error_body", None)  # type: ignore[attr-defined]
        return dispatch

    async def models(request: Any) -> Any:
        cards = []
        for name, endpoints in ((n, table.get(("/v1/models", "GET"), {})) for n in names):
            if name in endpoints:
                response = await endpoints[name](request)
                cards += json.loads(response.body)["data"]
        return JSONResponse({"object": "list", "data": cards})

    out = []
    for (path, method), endpoints in table.items():
        if (path, method) == ("/v1/models", "GET"):
            endpoint = models
            models.omni_error_body = getattr(next(iter(endpoints.values())), "omni_error_body", None)  # type: ignore[attr-defined]
        else:
            endpoint = dispatcher(path, method, endpoints)
        out.append(Route(path, endpoint, methods=[method]))
    return out


async def following(first: Any, events: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A request's events from ``first`` (read before the response started; None: the stream had
    ended) through the rest of ``events``, up to the result: that is the last one yielded (a
    caller reading on after it gets nothing). What ``events`` raises passes through; closing
    ``events`` stays the caller's (in its ``finally``), however its loop ends."""
    event = first
    while event is not None:
        yield event
        if event.is_result:
            return
        try:
            event = await events.__anext__()
        except StopAsyncIteration:
            return


def audio_routes(api: Any, opts: dict[str, Any], kind: str, error_body: Any) -> list[Any]:
    """The routes of ``kind`` (``asr``: transcriptions; ``tts``: speech) for the ``openai`` API,
    whose adapter options are ``opts`` (``opts["audio"]``: this module's mapping)."""
    from starlette.exceptions import HTTPException
    from starlette.formparsers import MultiPartException
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route

    from omni_core.logs import get_logger
    from omni_core.serve import ClientGone, EventStream, HTTPError, describe, log_error, parse_json

    from .openai_api import pcm16, stage_part

    model = api.pipeline_name
    audio = audio_options(opts.get("audio"))
    if kind == "tts" and opts["audio_stage"] is None:
        raise ValueError("serve.options.openai.audio_stage: kind tts needs the stage whose chunks carry the speech "
                         f"(stages: {', '.join(api.pipeline.config.stage_names)})")
    log = get_logger(component="openai", pipeline=model)
    params = {audio["audio_key"]: "file", audio["language_key"]: "language", audio["prompt_key"]: "prompt",
              audio["temperature_key"]: "temperature", audio["input_key"]: "input", opts["voice_key"]: "voice",
              audio["speed_key"]: "speed", audio["instructions_key"]: "instructions",
              audio["timestamps_key"]: "response_format"}

    def error(status: int, message: str, param: str | None = None, code: str | None = None,
              headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": _TYPES.get(status, "server_error"),
                                       "param": param, "code": code}}, status_code=status, headers=headers)

    def refused(request: Any, exc: Refused) -> JSONResponse:
        log.warning("audio request refused", path=request.url.path, status=exc.status, param=exc.param,
                    message=exc.message)
        return error(exc.status, exc.message, exc.param, exc.code)

    def err_of(exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str]]:
        err = describe(exc)
        where = f" (stage {err.stage!r})" if err.stage else ""
        param = params.get(err.field) if isinstance(err.field, str) else None
        log_error(log, "audio request failed" if err.status >= 500 else "audio request refused", err, exc,
                  **({"param": param} if param else {}))
        return err.status, {"message": f"{err.type}{where}: {err.message}",
                            "type": _TYPES.get(err.status, "server_error"), "param": param, "code": err.type}, err.headers

    def failed(exc: BaseException) -> JSONResponse:
        status, body, headers = err_of(exc)
        return JSONResponse({"error": body}, status_code=status, headers=headers)

    def check_model(value: Any) -> None:
        if value is None or value == "":
            raise Refused("'model' is required", "model")
        if value != model:
            raise Refused(f"the model {value!r} does not exist; this server serves {model!r}", "model", 404,
                          "model_not_found")

    def counts(part: Any) -> tuple[int, int] | None:
        if not isinstance(part, Mapping):
            return None
        found = (part.get(opts["prompt_tokens_field"]), part.get(opts["completion_tokens_field"]))
        if all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in found):
            return found  # type: ignore[return-value]
        return None

    async def first_event(request: Any, events: Any) -> Any:
        """The first event, before the response starts (so overload and unavailability keep their
        status codes); None at the end of the stream. Raises what the request raised."""
        try:
            return await api.until_disconnect(request.receive, events.__anext__())
        except StopAsyncIteration:
            return None

    # -- POST /v1/audio/transcriptions ------------------------------------------------------------

    async def parse_transcription(request: Any) -> dict[str, Any]:
        ctype = request.headers.get("content-type", "")
        if not ctype.lower().startswith("multipart/form-data"):
            raise Refused("a transcription request is multipart/form-data (the 'file' and 'model' fields and "
                          f"the options), got content-type {ctype or 'none'!r}")
        try:
            form = await request.form(max_files=1, max_fields=len(TRANSCRIPTION_FIELDS) + 8,
                                      max_part_size=64 * 1024)
        except (HTTPException, MultiPartException) as exc:
            raise Refused(f"the multipart form could not be read: {getattr(exc, 'detail', None) or exc}") from None
        request.state.omni_form = form
        unknown = sorted({k for k in form if k not in TRANSCRIPTION_FIELDS})
        if unknown:
            raise Refused(f"unknown field(s) {', '.join(map(repr, unknown))}; a transcription takes "
                          f"{', '.join(TRANSCRIPTION_FIELDS)}", unknown[0])
        check_model(_form_value(form, "model"))
        files = form.getlist("file")
        if not files:
            raise Refused("'file' is required: the audio file to transcribe (WAV, FLAC, OGG or MP3), sent as a "
                          "file part", "file")
        if len(files) > 1 or isinstance(files[0], str):
            raise Refused("'file' must be one file part (the audio file), not a plain field", "file")
        upload = files[0]
        fmt = _form_value(form, "response_format") or "json"
        if fmt not in TRANSCRIPTION_FORMATS:
            raise Refused(f"'response_format' must be one of {', '.join(TRANSCRIPTION_FORMATS)}, got {fmt!r}",
                          "response_format")
        stream_value = (_form_value(form, "stream") or "false").lower()
        if stream_value not in ("true", "false"):
            raise Refused(f"'stream' must be true or false, got {stream_value!r}", "stream")
        stream = stream_value == "true"
        if stream and fmt not in ("json", "text"):
            raise Refused(f"'stream' is only available with response_format json or text, got {fmt!r}", "stream")
        grains = form.getlist("timestamp_granularities[]")
        for grain in grains:
            if grain not in ("segment", "word"):
                raise Refused(f"'timestamp_granularities[]' takes 'segment' (and 'word'), got {grain!r}",
                              "timestamp_granularities[]")
            if grain == "word":
                raise Refused("word timestamps are not available from this model; ask for 'segment'",
                              "timestamp_granularities[]")
            if fmt != "verbose_json":
                raise Refused("'timestamp_granularities[]' needs response_format verbose_json",
                              "timestamp_granularities[]")
        for item in form.getlist("include[]"):
            raise Refused(f"'include[]' {item!r} is not available from this model (it gives no logprobs)",
                          "include[]")
        strategy = _form_value(form, "chunking_strategy")
        if strategy not in (None, "", "auto"):
            raise Refused(f"'chunking_strategy' takes only 'auto' here, got {strategy!r}", "chunking_strategy")
        inputs: dict[str, Any] = dict(audio["inputs"])
        for name, key, default_ok in (("language", "language_key", ("",)), ("prompt", "prompt_key", ("",)),
                                      ("temperature", "temperature_key", ("", "0", "0.0"))):
            value = _form_value(form, name)
            if value is None:
                continue
            if name == "temperature":
                try:
                    number = float(value)
                except ValueError:
                    raise Refused(f"'temperature' must be a number between 0 and 1, got {value!r}",
                                  "temperature") from None
                if not 0 <= number <= 1:
                    raise Refused(f"'temperature' must be between 0 and 1, got {value!r}", "temperature")
            if audio[key] is None:
                if value in default_ok or (name == "temperature" and float(value) == 0):
                    continue
                raise Refused(f"'{name}' is not supported by this model (serve.options.openai.audio.{key} is "
                              "not set); leave it out", name)
            inputs[audio[key]] = float(value) if name == "temperature" else value
        if fmt in TIMESTAMPED_FORMATS and audio["timestamps_key"] is not None:
            inputs[audio["timestamps_key"]] = True  # the stage's own segments, where it makes them
        data = await upload.read()
        samples, rate = read_audio(data, upload.filename, audio["max_audio_seconds"], audio["input_sample_rate"])
        import torch

        inputs[audio["audio_key"]] = torch.from_numpy(samples)
        if audio["sample_rate_key"] is not None:
            inputs[audio["sample_rate_key"]] = rate
        return {"inputs": inputs, "format": fmt, "stream": stream, "duration": len(samples) / rate}

    def whole_text(result: Any, pieces: list[str]) -> tuple[Any, str]:
        part = stage_part(result, opts["text_stage"])
        text = part.get(opts["result_text_field"]) if isinstance(part, Mapping) else None
        return part, text if isinstance(text, str) else audio["text_joiner"].join(pieces)

    def transcription_usage(part: Any, duration: float) -> dict[str, Any]:
        found = counts(part)
        if found is None:
            return {"type": "duration", "seconds": max(1, math.ceil(duration))}
        return {"type": "tokens", "input_tokens": found[0], "output_tokens": found[1],
                "total_tokens": found[0] + found[1]}

    def piece_of(event: Any) -> str | None:
        if event.is_result or event.stage != opts["text_stage"]:
            return None
        chunk = event.data
        value = chunk.get(opts["text_field"]) if isinstance(chunk, Mapping) else chunk
        return value if isinstance(value, str) and value else None

    async def transcriptions(request: Any) -> Any:
        try:
            req = await parse_transcription(request)
        except Refused as exc:
            return refused(request, exc)
        finally:
            form = getattr(request.state, "omni_form", None)
            if form is not None:
                await form.close()
        rid = f"transcript-{uuid.uuid4().hex[:24]}"
        request.scope.setdefault("state", {})["omni_request_id"] = rid
        events = api.stream(req["inputs"], request_id=rid, headers=request.headers)  # runs at its first step
        if req["stream"]:
            try:
                first = await first_event(request, events)
            except ClientGone:
                await events.aclose()
                return JSONResponse({}, status_code=499)
            except Exception as exc:
                await events.aclose()
                return failed(exc)
            return EventStream(streamed_transcript(first, events, req))
        pieces: list[str] = []
        result: Any = None

        async def collect() -> None:
            nonlocal result
            async for event in events:
                if event.is_result:
                    result = event.data
                    return
                if (piece := piece_of(event)) is not None:
                    pieces.append(piece)

        try:
            await api.until_disconnect(request.receive, collect())
        except ClientGone:
            return JSONResponse({}, status_code=499)
        except Exception as exc:
            return failed(exc)
        finally:
            await events.aclose()
        part, text = whole_text(result, pieces)
        fmt = req["format"]
        usage = transcription_usage(part, req["duration"])
        if fmt == "text":
            return PlainTextResponse(text)
        if fmt == "json":
            return JSONResponse({"text": text, "usage": usage})
        segments = segments_of(part, audio["segments_field"], text, req["duration"])
        if fmt == "srt":
            return PlainTextResponse(srt(segments))
        if fmt == "vtt":
            return Response(vtt(segments), media_type="text/vtt")
        language = part.get(audio["language_field"]) if isinstance(part, Mapping) else None
        return JSONResponse({"task": "transcribe", "language": language if isinstance(language, str) else None,
                             "duration": req["duration"], "text": text, "segments": segments, "usage": usage})

    async def streamed_transcript(first: Any, events: Any, req: dict[str, Any]) -> Any:
        def sse(data: dict[str, Any]) -> bytes:
            return f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()

        pieces: list[str] = []
        sent = ""
        try:
            async for event in following(first, events):
                if event.is_result:
                    part, text = whole_text(event.data, pieces)
                    if text.startswith(sent) and text != sent:  # what the pieces lacked: one more delta
                        yield sse({"type": "transcript.text.delta", "delta": text[len(sent):]})
                    yield sse({"type": "transcript.text.done", "text": text,
                               "usage": transcription_usage(part, req["duration"])})
                    return
                if (piece := piece_of(event)) is not None:
                    delta = piece if not pieces else audio["text_joiner"] + piece
                    pieces.append(piece)
                    sent += delta
                    yield sse({"type": "transcript.text.delta", "delta": delta})
        except Exception as exc:
            _, body, _ = err_of(exc)
            yield sse({"type": "error", "error": body})
        finally:
            await events.aclose()

    # -- POST /v1/audio/speech ----------------------------------------------------------------------

    def parse_speech(body: Any) -> dict[str, Any]:
        if not isinstance(body, Mapping):
            raise Refused("the body must be a JSON object with 'model', 'input' and 'voice'")
        unknown = sorted(k for k in body if k not in SPEECH_FIELDS)
        if unknown:
            raise Refused(f"unknown field(s) {', '.join(map(repr, unknown))}; speech takes "
                          f"{', '.join(SPEECH_FIELDS)}", unknown[0])
        check_model(body.get("model"))
        text = body.get("input")
        if not isinstance(text, str) or not text.strip():
            raise Refused("'input' is required: the text to speak (a non-empty string)", "input")
        if len(text) > audio["max_input_chars"]:
            raise Refused(f"'input' is {len(text)} characters; at most {audio['max_input_chars']} "
                          "(serve.options.openai.audio.max_input_chars)", "input")
        inputs: dict[str, Any] = {**audio["inputs"], audio["input_key"]: text}
        voice = body.get("voice")
        if isinstance(voice, Mapping) and isinstance(voice.get("id"), str):
            voice = voice["id"]
        if not isinstance(voice, str) or not voice:
            raise Refused("'voice' is required: a voice name" + (
                f" (one of {', '.join(opts['voices'])})" if opts["voices"] else ""), "voice")
        if opts["voices"] is not None and voice not in opts["voices"]:
            raise Refused(f"the voice {voice!r} is not one of this model's: {', '.join(opts['voices'])}", "voice")
        if opts["voice_key"] is not None:
            inputs[opts["voice_key"]] = voice
        fmt = body.get("response_format", "mp3")
        formats = writable_formats()
        if fmt not in formats:
            what = "not a speech format" if fmt not in SPEECH_FORMATS else "not available on this server"
            raise Refused(f"'response_format' {fmt!r} is {what}; use one of {', '.join(formats)}",
                          "response_format")
        speed = body.get("speed", 1.0)
        if speed is not None:
            if not isinstance(speed, (int, float)) or isinstance(speed, bool) or not 0.25 <= speed <= 4.0:
                raise Refused(f"'speed' must be a number from 0.25 to 4.0, got {speed!r}", "speed")
            if audio["speed_key"] is not None:
                inputs[audio["speed_key"]] = float(speed)
            elif speed != 1.0:
                raise Refused("'speed' is not supported by this model (serve.options.openai.audio.speed_key is not "
                              "set); leave it out or send 1.0", "speed")
        instructions = body.get("instructions")
        if instructions is not None:
            if not isinstance(instructions, str):
                raise Refused("'instructions' must be a string", "instructions")
            if audio["instructions_key"] is not None:
                inputs[audio["instructions_key"]] = instructions
            elif instructions:
                raise Refused("'instructions' are not supported by this model (serve.options.openai.audio."
                              "instructions_key is not set); leave them out", "instructions")
        stream_format = body.get("stream_format", "audio")
        if stream_format not in ("audio", "sse"):
            raise Refused(f"'stream_format' must be 'audio' or 'sse', got {stream_format!r}", "stream_format")
        return {"inputs": inputs, "format": fmt, "sse": stream_format == "sse", "input": text}

    def audio_chunk(event: Any) -> tuple[bytes, int] | None:
        if event.is_result or event.stage != opts["audio_stage"] or not isinstance(event.data, Mapping):
            return None
        if opts["audio_field"] not in event.data:
            return None
        data = pcm16(event.data[opts["audio_field"]])
        if not data:
            return None
        field = opts["sample_rate_field"]
        rate = event.data.get(field) if field else None
        ok = isinstance(rate, int) and not isinstance(rate, bool) and rate > 0
        return data, rate if ok else opts["sample_rate"]

    def wav_header(rate: int) -> bytes:
        """A WAV header whose sizes say 'unknown' (0xFFFFFFFF), as streamed WAV is sent."""
        import struct

        return (b"RIFF" + struct.pack("<I", 0xFFFFFFFF) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate,
                rate * 2, 2, 16) + b"data" + struct.pack("<I", 0xFFFFFFFF))

    def speech_usage(result: Any, req: dict[str, Any], chunks: int) -> dict[str, int]:
        found = counts(stage_part(result, opts["audio_stage"]))
        if found is None:
            found = (len(req["input"]), chunks)
        return {"input_tokens": found[0], "output_tokens": found[1], "total_tokens": found[0] + found[1]}

    async def speech(request: Any) -> Any:
        try:
            try:
                body = parse_json(await request.body())
            except HTTPError as exc:
                raise Refused(exc.message) from None
            req = parse_speech(body)
        except Refused as exc:
            return refused(request, exc)
        rid = f"speech-{uuid.uuid4().hex[:24]}"
        request.scope.setdefault("state", {})["omni_request_id"] = rid
        events = api.stream(req["inputs"], request_id=rid, headers=request.headers)  # runs at its first step
        try:
            first = await first_event(request, events)
        except ClientGone:
            await events.aclose()
            return JSONResponse({}, status_code=499)
        except Exception as exc:
            await events.aclose()
            return failed(exc)
        if req["sse"]:
            return EventStream(speech_events(first, events, req))
        if req["format"] in STREAMED_FORMATS:
            return StreamingResponse(speech_bytes(first, events, req), media_type=(
                "audio/wav" if req["format"] == "wav" else "audio/pcm"),
                headers={"x-sample-rate": str(opts["sample_rate"] if req["format"] == "wav" else PCM_RATE)})
        # flac, mp3, opus: encoded whole once the audio is all there
        pcm = bytearray()
        rates: set[int] = set()

        async def collect() -> None:
            async for event in following(first, events):
                if (found := audio_chunk(event)) is not None:
                    pcm.extend(found[0])
                    rates.add(found[1])

        try:
            await api.until_disconnect(request.receive, collect())
        except ClientGone:
            return JSONResponse({}, status_code=499)
        except Exception as exc:
            return failed(exc)
        finally:
            await events.aclose()
        if len(rates) > 1:
            return failed(RuntimeError(f"the {opts['audio_stage']} stage's audio chunks have different sample "
                                       f"rates ({sorted(rates)}); one response holds one rate"))
        rate = rates.pop() if rates else opts["sample_rate"]
        return Response(encode(bytes(pcm), rate, req["format"]), media_type=_MEDIA[req["format"]])

    async def speech_bytes(first: Any, events: Any, req: dict[str, Any]) -> Any:
        started = False
        rate = None
        pcm = Resampler(PCM_RATE) if req["format"] == "pcm" else None  # raw PCM is 24 kHz, as OpenAI's
        try:
            async for event in following(first, events):
                if (found := audio_chunk(event)) is not None:
                    data, chunk_rate = found
                    if rate is not None and chunk_rate != rate:
                        log.error("speech audio changed sample rate mid-stream", first=rate, then=chunk_rate)
                        return
                    rate = chunk_rate
                    if not started and req["format"] == "wav":
                        yield wav_header(rate)
                    started = True
                    if pcm is not None:
                        data = pcm.push(data, chunk_rate)
                    if data:
                        yield data
            if pcm is not None and (rest := pcm.flush()):
                yield rest
        except Exception as exc:  # the response has started: logged, the body ends short
            err_of(exc)
            return
        finally:
            await events.aclose()
        if not started and req["format"] == "wav":
            yield wav_header(opts["sample_rate"])

    async def speech_events(first: Any, events: Any, req: dict[str, Any]) -> Any:
        def sse(data: dict[str, Any]) -> bytes:
            return f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode()

        chunks = 0
        pcm = Resampler(PCM_RATE)  # the deltas are raw PCM: 24 kHz, as OpenAI's
        try:
            async for event in following(first, events):
                if event.is_result:
                    if rest := pcm.flush():
                        yield sse({"type": "speech.audio.delta", "audio": base64.b64encode(rest).decode()})
                    yield sse({"type": "speech.audio.done", "usage": speech_usage(event.data, req, chunks)})
                    return
                if (found := audio_chunk(event)) is not None:
                    chunks += 1
                    if data := pcm.push(*found):
                        yield sse({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()})
        except Exception as exc:
            _, body, _ = err_of(exc)
            yield sse({"type": "error", "error": body})
        finally:
            await events.aclose()

    if kind == "asr":
        endpoint, route = transcriptions, Route("/v1/audio/transcriptions", transcriptions, methods=["POST"])
    elif kind == "tts":
        endpoint, route = speech, Route("/v1/audio/speech", speech, methods=["POST"])
    else:
        raise ValueError(f"serve.options.openai.kind: one of {', '.join(KINDS)}, got {kind!r}")
    if error_body is not None:
        endpoint.omni_error_body = error_body  # type: ignore[attr-defined]
    return [route]


_MEDIA = {"flac": "audio/flac", "mp3": "audio/mpeg", "opus": "audio/ogg", "wav": "audio/wav", "pcm": "audio/pcm"}


def encode(pcm: bytes, rate: int, fmt: str) -> bytes:
    """PCM16 mono audio as a ``fmt`` file (flac, mp3 or opus) with soundfile."""
    import numpy as np
    import soundfile

    container, subtype = ENCODED_FORMATS[fmt]
    out = io.BytesIO()
    samples = np.frombuffer(pcm, dtype="<i2")
    if fmt == "opus" and rate not in (8000, 12000, 16000, 24000, 48000):
        raise ValueError(f"opus needs a rate of 8, 12, 16, 24 or 48 kHz, the pipeline's audio is {rate} Hz")
    soundfile.write(out, samples, rate, format=container, subtype=subtype)
    return out.getvalue()

"""Running a session's responses: each one pipeline request (``ApiContext.stream``) whose text and
audio chunks become ``response.*`` events; cancelling it (``response.cancel``, a barge-in, the
client leaving) aborts that request."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections.abc import Mapping
from typing import Any

from .. import api_common
from . import protocol
from .audio import RATE, ms_of
from .conversation import Item
from .protocol import AUDIO_TEXT, ClientError, new_id


class Response:
    def __init__(self, response_id: str, item: Item, modalities: list[str], started: float):
        self.id, self.item, self.modalities, self.started = response_id, item, modalities, started
        self.task: asyncio.Task | None = None
        self.reason = "client_cancelled"
        self.pieces = 0
        self.first_audio: float | None = None
        self.conversation = "auto"
        self.metadata: Any = None
        # the pipeline's audio to the client's 24 kHz as one stream (no clicks at chunk edges)
        self.resampler = api_common.Resampler(RATE)

    @property
    def audio(self) -> bool:
        return self.modalities == ["audio"]


def pipeline_inputs(opts: Mapping[str, Any], items: list[Item], instructions: str, want_audio: bool) -> dict[str, Any]:
    """The pipeline's inputs for a response to the conversation ``items`` (before the voice and
    max tokens): with ``messages_key`` the conversation in Qwen's chat format, else as lines of
    text to ``prompt_key`` (and the latest user audio to ``audio_key``)."""
    import torch

    items = [i for i in items if i.role != "assistant" or i.text.strip()]
    if opts["messages_key"] is not None:
        messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
        for item in items:
            if item.role == "assistant":
                messages.append({"role": "assistant", "content": item.parts[0].get("text", "") if len(item.parts) == 1
                                 else " ".join(p.get("text", "") for p in item.parts)})
                continue
            content = [{"type": "audio", "audio": torch.from_numpy(part["samples"].copy()),
                        "sample_rate": opts["input_sample_rate"]} if part["type"] == "audio"
                       else {"type": "text", "text": part["text"]} for part in item.parts]
            messages.append({"role": item.role, "content": content})
        prompt = {opts["messages_key"]: messages}
    else:
        lines = [f"system: {instructions}"] if instructions else []
        lines += [f"{item.role}: {item.text}" for item in items]
        prompt = {opts["prompt_key"]: "\n".join(lines) or f"user: {AUDIO_TEXT}"}
        if opts["audio_key"] is not None:
            audio = [p["samples"] for i in items if i.role == "user" for p in i.parts if p["type"] == "audio"]
            if audio:
                prompt[opts["audio_key"]] = torch.from_numpy(audio[-1].copy())
    return {**opts["inputs"], **(opts["audio_inputs"] if want_audio else opts["text_inputs"]), **prompt}


class Responses:
    """The responses of one session (one at a time: ``current``)."""

    def __init__(self, session: Any):
        self.session = session
        self.opts = session.opts
        self.send = session.send
        self.current: Response | None = None

    # -- the client's events ----------------------------------------------------------------------------------

    async def on_response_create(self, event: Mapping[str, Any]) -> None:
        params = event.get("response") or {}
        if not isinstance(params, Mapping):
            raise ClientError("response must be an object", "invalid_value", "response")
        await self.create(params, time.perf_counter())

    async def on_response_cancel(self, event: Mapping[str, Any]) -> None:
        wanted = event.get("response_id")
        if self.current is None or (wanted is not None and wanted != self.current.id):
            what = f"response {wanted!r} is not running" if wanted is not None else "no response is running"
            raise ClientError(f"nothing to cancel: {what}", "response_cancel_not_active", "response_id")
        await self.cancel("client_cancelled")

    # -- running one ------------------------------------------------------------------------------------------

    async def cancel(self, reason: str) -> None:
        """Abort the running response (its pipeline request) and wait until it ended; it sends
        response.done (cancelled) unless ``reason`` is client_disconnected."""
        response = self.current
        if response is None or response.task is None:
            return
        response.reason = reason
        response.task.cancel()
        with contextlib.suppress(BaseException):
            await response.task

    async def create(self, params: Mapping[str, Any], started: float) -> None:
        """Start a response with ``params`` (``response.create``'s, or none at the end of a turn)."""
        if self.current is not None:
            raise ClientError(f"the conversation already has an active response ({self.current.id}); wait for its "
                              "response.done or send response.cancel", "conversation_already_has_active_response")
        config = self.session.config
        modalities = config["output_modalities"]
        if "output_modalities" in params:
            modalities = protocol.modalities(params["output_modalities"], "response.output_modalities",
                                             self.opts["audio_stage"] is not None, self.session.api.pipeline_name)
        instructions = protocol.instructions(params.get("instructions", config["instructions"]),
                                             "response.instructions")
        max_tokens = protocol.max_tokens(params.get("max_output_tokens", config["max_output_tokens"]),
                                         "response.max_output_tokens")
        if params.get("conversation", "auto") not in ("auto", "none"):
            raise ClientError("response.conversation must be 'auto' or 'none'", "invalid_value",
                              "response.conversation")
        if params.get("input") is not None:
            raise ClientError("response.input is not available; add items with conversation.item.create",
                              "unsupported", "response.input")
        want_audio = modalities == ["audio"]
        inputs = self._inputs(instructions, want_audio, max_tokens)
        item = Item(new_id("item"), "assistant", [{"type": "audio" if want_audio else "text", "text": ""}],
                    status="in_progress")
        response = Response(new_id("resp"), item, modalities, started)
        response.conversation = params.get("conversation", "auto")
        response.metadata = params.get("metadata")
        self.current = response
        await self.send("response.created", response=self._json(response, "in_progress", []))
        response.task = asyncio.create_task(self._run(response, inputs))

    def _inputs(self, instructions: str, want_audio: bool, max_tokens: int | str) -> dict[str, Any]:
        opts = self.opts
        inputs = pipeline_inputs(opts, self.session.conversation.items, instructions, want_audio)
        if want_audio and opts["voice_key"] is not None:
            inputs[opts["voice_key"]] = self.session.config["audio"]["output"]["voice"]
        if max_tokens != "inf" and opts["max_tokens_key"] is not None:
            inputs[opts["max_tokens_key"]] = max_tokens
        return inputs

    def _json(self, response: Response, status: str, output: list[dict[str, Any]],
              details: dict[str, Any] | None = None, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        config = self.session.config
        return {"id": response.id, "object": "realtime.response", "status": status, "status_details": details,
                "output": output, "output_modalities": response.modalities, "usage": usage,
                "conversation_id": None if response.conversation == "none" else f"conv_{self.session.id[5:]}",
                "metadata": response.metadata,
                "audio": {"output": {"format": {"type": "audio/pcm", "rate": RATE},
                                     "voice": config["audio"]["output"]["voice"]}},
                "max_output_tokens": config["max_output_tokens"]}

    async def _run(self, response: Response, inputs: dict[str, Any]) -> None:
        """The response's pipeline request, its events sent as they come; then its end."""
        ids = {"response_id": response.id, "item_id": response.item.id, "output_index": 0, "content_index": 0}
        status, details, usage = "completed", None, None
        events = None
        try:
            await self._start(response, ids)
            events = self.session.api.stream(inputs, request_id=f"rt-{response.id}")
            usage = await self._stream(response, ids, events)
        except asyncio.CancelledError:
            status, details = "cancelled", {"type": "cancelled", "reason": response.reason}
        except Exception as exc:
            status, details = "failed", self._failure(response, exc)
        finally:
            if events is not None:
                with contextlib.suppress(BaseException):
                    await events.aclose()
        if usage is None:
            usage = {"total_tokens": response.pieces, "input_tokens": None, "output_tokens": response.pieces}
        self.current = None
        self.session.hub.response_ended(status)
        response.item.status = "completed" if status == "completed" else "incomplete"
        if response.reason == "client_disconnected" and status == "cancelled":
            return
        with contextlib.suppress(Exception):
            await self._finish(response, ids, status, details, usage)

    async def _start(self, response: Response, ids: dict[str, Any]) -> None:
        await self.send("response.output_item.added", response_id=response.id, output_index=0,
                        item=response.item.to_json())
        conversation = self.session.conversation
        if response.conversation != "none":
            await conversation.add(response.item, conversation.last_id)
        part = {"type": "audio", "transcript": ""} if response.audio else {"type": "text", "text": ""}
        await self.send("response.content_part.added", part=part, **ids)

    async def _stream(self, response: Response, ids: dict[str, Any], events: Any) -> dict[str, Any] | None:
        """Send the request's text and audio as deltas; returns the usage its result gives."""
        item, want_audio, opts = response.item, response.audio, self.opts
        text_stage = api_common.text_stage_for(opts, want_audio)
        result = None
        async for event in events:
            if event.is_result:
                result = event.data
                break
            if event.stage == text_stage and (piece := api_common.text_of(event.data, opts)):
                delta = piece if response.pieces == 0 else opts["text_joiner"] + piece
                response.pieces += 1
                item.parts[0]["text"] += delta
                kind = "response.output_audio_transcript.delta" if want_audio else "response.output_text.delta"
                await self.send(kind, delta=delta, **ids)
            elif want_audio and event.stage == opts["audio_stage"]:
                await self._audio(response, ids, event.data)
        if want_audio and (rest := response.resampler.flush()):  # what the resampler's filter still held
            await self._send_audio(response, ids, rest)
        counts, _ = api_common.usage_of(result, opts, text_stage)
        if counts is None:
            return None
        return {"total_tokens": counts["total_tokens"], "input_tokens": counts["prompt_tokens"],
                "output_tokens": counts["completion_tokens"]}

    async def _audio(self, response: Response, ids: dict[str, Any], chunk: Any) -> None:
        pcm = api_common.audio_of(chunk, self.opts)
        if not pcm:
            return
        pcm = response.resampler.push(pcm, api_common.rate_of(chunk, self.opts))
        if pcm:  # empty while the resampler fills its first block
            await self._send_audio(response, ids, pcm)

    async def _send_audio(self, response: Response, ids: dict[str, Any], pcm: bytes) -> None:
        await self.send("response.output_audio.delta", delta=base64.b64encode(pcm).decode(), **ids)
        response.item.audio_ms += ms_of(len(pcm))
        if response.first_audio is None:
            response.first_audio = time.perf_counter() - response.started
            self.session.hub.first_audio(response.first_audio)

    def _failure(self, response: Response, exc: Exception) -> dict[str, Any]:
        from omni_core.serve import describe

        err = describe(exc)
        where = f" (stage {err.stage!r})" if err.stage else ""
        self.session.log.warning("realtime response failed", response=response.id, error=err.type, stage=err.stage,
                                 message=err.message)
        return {"type": "failed", "error": {"type": "server_error", "code": err.type,
                                            "message": f"{err.type}{where}: {err.message}"}}

    async def _finish(self, response: Response, ids: dict[str, Any], status: str, details: Any, usage: Any) -> None:
        item = response.item
        text = item.parts[0]["text"]
        if response.audio:
            await self.send("response.output_audio.done", **ids)
            await self.send("response.output_audio_transcript.done", transcript=text, **ids)
            part = {"type": "audio", "transcript": text}
        else:
            await self.send("response.output_text.done", text=text, **ids)
            part = {"type": "text", "text": text}
        await self.send("response.content_part.done", part=part, **ids)
        await self.send("response.output_item.done", response_id=response.id, output_index=0, item=item.to_json())
        items = self.session.conversation.items
        if response.conversation != "none" and item in items:
            index = items.index(item)
            await self.send("conversation.item.done", item=item.to_json(),
                            previous_item_id=items[index - 1].id if index else None)
        await self.send("response.done", response=self._json(response, status, [item.to_json()], details, usage))

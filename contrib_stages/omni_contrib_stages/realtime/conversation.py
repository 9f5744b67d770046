"""A session's conversation: its items in order, bounded, and the ``conversation.item.*`` client
events."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from .audio import RATE, decode_audio, resample, to_float
from .protocol import AUDIO_TEXT, ClientError, new_id


class Item:
    """One conversation item: a message of ``role`` with parts ``{"type": "text", "text"}`` or
    ``{"type": "audio", "samples": float32 at input_sample_rate, "ms", "transcript"}``."""

    def __init__(self, item_id: str, role: str, parts: list[dict[str, Any]], status: str = "completed"):
        self.id, self.role, self.parts, self.status = item_id, role, parts, status
        self.audio_ms = 0  # assistant: audio sent for it

    @property
    def text(self) -> str:
        return " ".join(p.get("text") or p.get("transcript") or AUDIO_TEXT for p in self.parts)

    def to_json(self) -> dict[str, Any]:
        content = []
        for part in self.parts:
            if self.role == "assistant":
                kind = "output_audio" if part["type"] == "audio" else "output_text"
                content.append({"type": kind, "transcript": part.get("text", "")} if kind == "output_audio"
                               else {"type": kind, "text": part.get("text", "")})
            elif part["type"] == "audio":
                content.append({"type": "input_audio", "transcript": part.get("transcript")})
            else:
                content.append({"type": "input_text", "text": part["text"]})
        return {"id": self.id, "object": "realtime.item", "type": "message", "role": self.role,
                "status": self.status, "content": content}


class Conversation:
    """The items of one session. ``send`` sends a server event; ``running`` gives the item the
    running response is writing (never dropped, deleted or truncated), or None."""

    def __init__(self, opts: Mapping[str, Any], send: Callable[..., Awaitable[None]],
                 running: Callable[[], Item | None]):
        self.opts, self.send, self.running = opts, send, running
        self.items: list[Item] = []

    @property
    def last_id(self) -> str | None:
        return self.items[-1].id if self.items else None

    async def add(self, item: Item, previous: str | None) -> None:
        """Insert ``item`` after ``previous`` (None: at the end) and say so."""
        index = len(self.items) if previous is None else self.index(previous, "previous_item_id") + 1
        self.items.insert(index, item)
        self.bound()
        await self.send("conversation.item.added", item=item.to_json(), previous_item_id=previous)
        if item.status == "completed":
            await self.send("conversation.item.done", item=item.to_json(), previous_item_id=previous)

    def bound(self) -> None:
        """Drop the oldest items (never the running response's) while there are more than
        ``max_items`` or their user audio is longer than ``max_history_seconds``."""
        keep = self.running()
        rate = self.opts["input_sample_rate"]

        def audio_seconds() -> float:
            return sum(p["samples"].size for i in self.items for p in i.parts if "samples" in p) / rate

        while len(self.items) > 1 and (len(self.items) > self.opts["max_items"]
                                       or audio_seconds() > self.opts["max_history_seconds"]):
            oldest = next((i for i in self.items if i is not keep), None)
            if oldest is None or oldest is self.items[-1]:
                return  # the newest item stays, however long
            self.items.remove(oldest)

    def index(self, item_id: Any, param: str) -> int:
        for i, item in enumerate(self.items):
            if item.id == item_id:
                return i
        raise ClientError(f"{param}: no item {item_id!r} in the conversation", "item_not_found", param)

    def user_audio(self, pcm: bytes, item_id: str) -> Item:
        """A user item of the client's PCM16 audio, at the pipeline's ``input_sample_rate``."""
        samples = resample(to_float(pcm), RATE, self.opts["input_sample_rate"])
        return Item(item_id, "user", [{"type": "audio", "samples": samples, "transcript": None}])

    # -- the client's events ----------------------------------------------------------------------------------

    async def on_conversation_item_create(self, event: Mapping[str, Any]) -> None:
        raw = event.get("item")
        if not isinstance(raw, Mapping) or raw.get("type", "message") != "message":
            raise ClientError("item must be a message: {\"type\": \"message\", \"role\": ..., \"content\": [...]} "
                              "(function calls are not available)", "invalid_value", "item")
        role = raw.get("role")
        if role not in ("user", "assistant", "system"):
            raise ClientError(f"item.role must be user, assistant or system, got {role!r}", "invalid_value", "item.role")
        content = raw.get("content")
        if not isinstance(content, list) or not content:
            raise ClientError("item.content must be a non-empty list of parts", "invalid_value", "item.content")
        parts = [self._part(p, role, f"item.content[{i}]") for i, p in enumerate(content)]
        item_id = raw.get("id") if isinstance(raw.get("id"), str) and raw.get("id") else new_id("item")
        if any(i.id == item_id for i in self.items):
            raise ClientError(f"item.id {item_id!r} is already in the conversation", "invalid_value", "item.id")
        previous = event.get("previous_item_id")
        item = Item(item_id, role, parts)
        if previous == "root":
            self.items.insert(0, item)
            self.bound()
            await self.send("conversation.item.added", item=item.to_json(), previous_item_id=None)
            await self.send("conversation.item.done", item=item.to_json(), previous_item_id=None)
            return
        previous = previous if previous is not None else self.last_id
        if previous is not None:
            self.index(previous, "previous_item_id")
        await self.add(item, previous)

    def _part(self, part: Any, role: str, where: str) -> dict[str, Any]:
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in ("input_text", "output_text", "text"):
            if not isinstance(part.get("text"), str):
                raise ClientError(f"{where}.text must be a string", "invalid_value", f"{where}.text")
            return {"type": "text", "text": part["text"]}
        if kind == "output_audio" and role == "assistant":
            return {"type": "text", "text": part.get("transcript") or ""}
        if kind == "input_audio" and role == "user":
            pcm = decode_audio(part.get("audio"), f"{where}.audio")
            if len(pcm) > int(self.opts["max_buffer_seconds"] * RATE) * 2:
                raise ClientError(f"{where}.audio is longer than {self.opts['max_buffer_seconds']:g} s (serve option "
                                  "max_buffer_seconds)", "invalid_value", f"{where}.audio")
            transcript = part.get("transcript") if isinstance(part.get("transcript"), str) else None
            return {"type": "audio", "samples": resample(to_float(pcm), RATE, self.opts["input_sample_rate"]),
                    "transcript": transcript}
        raise ClientError(f"{where}.type {kind!r} is not available for a {role} item (input_text, input_audio for "
                          "user; output_text, output_audio for assistant; input_text for system)", "invalid_value",
                          f"{where}.type")

    async def on_conversation_item_truncate(self, event: Mapping[str, Any]) -> None:
        item = self.items[self.index(event.get("item_id"), "item_id")]
        if item.role != "assistant":
            raise ClientError(f"item {item.id!r} is a {item.role} item; only assistant audio can be truncated",
                              "invalid_value", "item_id")
        if self.running() is item:
            raise ClientError(f"item {item.id!r} is still being generated; cancel its response first",
                              "invalid_value", "item_id")
        if event.get("content_index", 0) != 0:
            raise ClientError("content_index must be 0 (an assistant item has one part)", "invalid_value",
                              "content_index")
        end = event.get("audio_end_ms")
        if isinstance(end, bool) or not isinstance(end, int) or not 0 <= end <= item.audio_ms:
            raise ClientError(f"audio_end_ms must be an integer from 0 to the item's {item.audio_ms} ms of audio, "
                              f"got {end!r}", "invalid_value", "audio_end_ms")
        if item.audio_ms:  # keep the share of the transcript the client heard
            words = item.parts[0]["text"].split(" ") if item.parts else []
            item.parts = [{"type": "audio", "text": " ".join(words[: round(len(words) * end / item.audio_ms)])}]
            item.audio_ms = end
        await self.send("conversation.item.truncated", item_id=item.id, content_index=0, audio_end_ms=end)

    async def on_conversation_item_delete(self, event: Mapping[str, Any]) -> None:
        index = self.index(event.get("item_id"), "item_id")
        if self.running() is self.items[index]:
            raise ClientError("the item is still being generated; cancel its response first", "invalid_value",
                              "item_id")
        item = self.items.pop(index)
        await self.send("conversation.item.deleted", item_id=item.id)

    async def on_conversation_item_retrieve(self, event: Mapping[str, Any]) -> None:
        item = self.items[self.index(event.get("item_id"), "item_id")]
        await self.send("conversation.item.retrieved", item=item.to_json())

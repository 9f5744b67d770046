"""Qwen3-Omni's processor stage: a request's chat messages (or the ``text`` shorthand, or ``input_ids``) as the
thinker's ``input_ids``, rendered with the checkpoint's chat template. Audio and image parts are refused (an
``InvalidInput`` naming the part) until the family's encoder stages exist."""

from __future__ import annotations

from omni_core.errors import InvalidInput

from ..qwen2_5_omni.processor import Processor as QwenProcessor
from .thinker import DEFAULT_SPEAKER


class Processor(QwenProcessor):
    """As the Qwen2.5-Omni processor (same request keys and checks), with no default system prompt (Qwen3-Omni
    needs none) and text parts only."""

    def __init__(self, model: str | None = None, system_prompt: str | None = None, chat_template: bool = True):
        super().__init__(model, system_prompt=system_prompt, chat_template=chat_template)

    def __call__(self, payload, ctx) -> dict:
        out = super().__call__(payload, ctx)
        if payload.get("speaker") is None:  # generate's default voice (Qwen2.5-Omni's is another)
            out["speaker"] = DEFAULT_SPEAKER
        return out

    def media_of(self, messages: list[dict], origin=None, inserted: int = 0) -> tuple[list[dict], list, list]:
        for k, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            for j, part in enumerate(content if isinstance(content, list) else []):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in ("audio", "image"):
                    where = part.get("where") or f"messages[{k - inserted}].content[{j}] ({kind})"
                    raise InvalidInput(f"{where}: the qwen3_omni pipeline takes text parts only so far (audio and "
                                       "image inputs are not served yet); send text", field=where)
        return super().media_of(messages, origin, inserted)

"""A one-stage pipeline for the ``openai`` API's tests: ``Echo`` answers with the inputs it got.

It streams the JSON of its inputs (keys sorted) in pieces of ``piece`` characters and returns it
whole as ``text`` with usage counts. A prompt of ``"invalid"`` makes it refuse its ``temp`` input
(an :class:`~omni_core.errors.InvalidInput` naming that field); ``"crash"`` makes it raise a bug.
"""

from __future__ import annotations

import json
from typing import Any

from omni_core.errors import InvalidInput


class Echo:
    def __init__(self, piece: int = 7):
        self.piece = piece

    async def __call__(self, inputs: dict[str, Any], ctx: Any) -> dict[str, Any]:
        if inputs.get("text") == "invalid":
            raise InvalidInput(f"temp must be below 1.5, got {inputs.get('temp')!r}", field="temp")
        if inputs.get("text") == "crash":
            raise RuntimeError("the echo stage crashed on purpose")
        text = json.dumps(inputs, sort_keys=True)
        for start in range(0, len(text), self.piece):
            await ctx.emit({"text": text[start:start + self.piece]})
        return {"text": text, "prompt_tokens": 3, "completion_tokens": len(text) // self.piece + 1,
                "finish_reason": "stop"}

"""What the Qwen2.5-Omni stages share: defaults, the checkpoint's metadata, a request's seed."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from omni_core.errors import InvalidInput

DEFAULT_SPEAKER = "Chelsie"
#: What the thinker's result says of the request, in the OpenAI API's terms; token2wav's result
#: carries them too (the talker passes them on): prompt tokens, generated tokens, "stop" | "length".
USAGE_KEYS = ("prompt_tokens", "completion_tokens", "finish_reason")
# The system prompt Qwen2.5-Omni needs to answer with speech (from its model card).
DEFAULT_SYSTEM_PROMPT = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of perceiving auditory and "
    "visual inputs, as well as generating text and speech."
)


def sample_rate_of(path: Path, default: int = 24000) -> int:
    meta = path / "omni_transformers.json"
    if meta.is_file():
        return int(json.loads(meta.read_text()).get("sample_rate", default))
    return default


def omni_config(path: Path):
    """The whole checkpoint's config, or None for a folder holding one part."""
    import transformers

    if json.loads((path / "config.json").read_text()).get("model_type") != "qwen2_5_omni":
        return None
    return transformers.Qwen2_5OmniConfig.from_pretrained(path, local_files_only=True)


def request_seed(payload: dict) -> int:
    seed = payload.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise InvalidInput(f"seed must be an integer, got {seed!r}", field="seed")
    return seed



class StreamProgress:
    """What a task reading a stage's incoming stream tells the stage's call: ``error`` (what ended
    the read), ``ended``, and ``wait(ready)``, which returns once ``ready()`` holds or the read ended
    (and raises what ended it badly). A subclass reads in ``_read`` and sets ``changed`` after each
    chunk it took in; ``read()`` runs it and records how it ended, then calls ``_on_end()``."""

    def __init__(self, source: str):
        self.source = source
        self.error: BaseException | None = None
        self.ended = False
        self.changed = asyncio.Event()

    async def read(self) -> None:
        try:
            await self._read()
        except BaseException as exc:
            self.error = exc
            raise
        finally:
            self.ended = True
            self.changed.set()
            self._on_end()

    async def _read(self) -> None:
        raise NotImplementedError

    def _on_end(self) -> None:
        """Called once the read ended, however it ended."""

    async def wait(self, ready) -> None:
        while not ready():
            if self.error is not None:
                raise RuntimeError(f"reading the {self.source} stream failed: {self.error!r}") from self.error
            if self.ended:
                return
            self.changed.clear()
            await self.changed.wait()

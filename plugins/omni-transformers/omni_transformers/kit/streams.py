"""What every family's stages share about a request and its streams: the seed, the usage counts,
and the progress of reading an incoming stream."""

from __future__ import annotations

import asyncio

from omni_core.errors import InvalidInput

#: What a thinker's result says of the request, in the OpenAI API's terms (the terminal stage's
#: result carries them too): prompt tokens, generated tokens, "stop" | "length".
USAGE_KEYS = ("prompt_tokens", "completion_tokens", "finish_reason")


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

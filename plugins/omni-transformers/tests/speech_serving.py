"""What the speech tests share: ``omni serve`` on a checkpoint folder and the official SDK client of a server."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import openai
from omni_core.testing.serve import ServerProcess


@contextlib.contextmanager
def serving(*configs: str, cwd, args: tuple[str, ...] = ()) -> Iterator[ServerProcess]:
    """``omni serve CONFIG... ARGS`` in ``cwd`` until the block ends; then it must stop cleanly, leaving nothing."""
    srv = ServerProcess(*configs, *args, cwd=str(cwd), ready_timeout=300)
    with srv.serving(stop_timeout=120):
        yield srv


def sdk(server: ServerProcess) -> openai.OpenAI:
    """The official SDK's client of ``server`` (no retries: a failure shows as it is)."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)

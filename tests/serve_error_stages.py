"""Stages for the tests of how omni serve answers a stage's errors and knows a request's origin
(tests/test_serve_errors.py), imported by dotted path in the stage processes."""

from __future__ import annotations

import os

from omni_core import InvalidInput
from omni_core.files import local_path


class Judge:
    """Passes its payload on, adding whether the request came over the network (``seen``, one
    entry per stage it passed). Per request: ``invalid`` (a field name) raises InvalidInput naming
    it, ``bug`` raises a KeyError, ``die`` (this stage's name) exits the process, ``path`` is
    resolved with the local-file rule; ``emit_first`` streams a chunk before any of that."""

    def __init__(self, name: str):
        self.name = name

    async def __call__(self, payload, ctx):
        if payload.get("emit_first") and self.name == payload.get("where", self.name):
            await ctx.emit({"stage": self.name})
        if payload.get("where", self.name) == self.name:
            if payload.get("invalid"):
                raise InvalidInput(f"{payload['invalid']} is wrong here", field=payload["invalid"])
            if payload.get("bug"):
                raise KeyError("a bug in the stage")
            if payload.get("die"):
                os._exit(7)
            if "path" in payload:
                payload = {**payload, "path": str(local_path(ctx, payload["path"], "path"))}
        return {**payload, "seen": [*payload.get("seen", []), ctx.from_network]}

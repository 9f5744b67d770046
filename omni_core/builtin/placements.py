"""Built-in placement strategies: ``explicit``, ``pack`` and ``spread`` (see docs/placement.md)."""

from __future__ import annotations

from ..plugins import hookimpl


@hookimpl
def omni_register_placements(register):
    register("explicit", "omni_core.plan.placement:explicit",
             description="each stage on its 'gpu:' field; CPU when absent")
    register("pack", "omni_core.plan.placement:pack",
             description="fill each GPU up to its memory budget before the next")
    register("spread", "omni_core.plan.placement:spread",
             description="balance stages over the GPUs, least loaded first")

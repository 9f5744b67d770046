"""Built-in placement strategies: ``explicit``, ``pack`` and ``spread`` (see docs/placement.md)."""

from __future__ import annotations

from ..options import Option, positive_number
from ..plugins import hookimpl

_DEFAULT_MEMORY = positive_number(
    None, "the share of a GPU (at most 1) or the bytes (more than 1) a stage without 'memory' counts as (default 0.1)")
_CPU = Option("str_list", None, "stage name(s) whose process groups stay on the CPU")

EXPLICIT_OPTIONS = {"default_memory": _DEFAULT_MEMORY}
GREEDY_OPTIONS = {"default_memory": _DEFAULT_MEMORY, "cpu": _CPU}


@hookimpl
def omni_register_placements(register):
    register("explicit", "omni_core.plan.placement:explicit",
             description="each stage on its 'gpu:' field; CPU when absent", options=EXPLICIT_OPTIONS)
    register("pack", "omni_core.plan.placement:pack",
             description="fill each GPU up to its memory budget before the next", options=GREEDY_OPTIONS)
    register("spread", "omni_core.plan.placement:spread",
             description="balance stages over the GPUs, least loaded first", options=GREEDY_OPTIONS)

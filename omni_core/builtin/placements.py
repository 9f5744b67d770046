"""Built-in placement strategies."""

from __future__ import annotations

from ..plan.placement import explicit
from ..plugins import hookimpl


@hookimpl
def omni_register_placements(register):
    register("explicit", explicit, description="each stage on its 'gpu:' field; CPU when absent")

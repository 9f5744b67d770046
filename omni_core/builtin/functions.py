"""Generic wiring functions every pipeline can use by name."""

from __future__ import annotations

from typing import Any

from ..plugins import hookimpl

#: What a route or stream_done function returns to mean "every target" (every ``next`` stage,
#: or every ``stream_to`` stage).
ALL_TARGETS = "*"


def route_all(request_id: str, payload: Any) -> str:
    """Route to every stage in ``next`` (the same as having no route function)."""
    return ALL_TARGETS


def route_by_key(request_id: str, payload: Any) -> Any:
    """Route to the stage(s) named by the payload's ``"route"`` key (a name or a list)."""
    if not isinstance(payload, dict) or "route" not in payload:
        raise KeyError("omni.route_by_key needs a dict payload with a 'route' key naming the target stage(s)")
    return payload["route"]


def merge_dicts(payloads: dict[str, Any]) -> dict[str, Any]:
    """Union of dict payloads in arrival order; a key present in two sources is an error."""
    merged: dict[str, Any] = {}
    owner: dict[str, str] = {}
    for source, payload in payloads.items():
        if not isinstance(payload, dict):
            raise TypeError(f"omni.merge_dicts needs dict payloads; stage {source!r} sent {type(payload).__name__}")
        for key, value in payload.items():
            if key in merged and merged[key] is not value:
                raise ValueError(
                    f"omni.merge_dicts: key {key!r} comes from both {owner[key]!r} and {source!r}; "
                    "rename it in one stage or use merge_fn: omni.by_source"
                )
            merged[key] = value
            owner[key] = source
    return merged


def by_source(payloads: dict[str, Any]) -> dict[str, Any]:
    """Merge into ``{source_stage: payload}``, keeping every source apart."""
    return dict(payloads)


def terminal_stages_from_inputs(inputs: Any) -> Any:
    """Terminal stages named by the inputs' ``"terminal_stages"`` key; all of them when absent."""
    if isinstance(inputs, dict):
        return inputs.get("terminal_stages")
    return None


@hookimpl
def omni_register_functions(register):
    register("omni.route_all", route_all, kind="route", description=route_all.__doc__)
    register("omni.route_by_key", route_by_key, kind="route", description=route_by_key.__doc__)
    register("omni.merge_dicts", merge_dicts, kind="merge", description=merge_dicts.__doc__)
    register("omni.by_source", by_source, kind="merge", description=by_source.__doc__)
    register(
        "omni.terminal_stages_from_inputs",
        terminal_stages_from_inputs,
        kind="terminal_stages",
        description=terminal_stages_from_inputs.__doc__,
    )

"""Wiring functions: merges for fan-in stages, payload projections, route functions.

omni calls wiring functions with fixed arguments (no settings from the config), so this module
offers two things for each kind:

- ready-made functions, registered under ``contrib.*`` names (see :data:`REGISTERED`);
- *builders* that make a function from settings (``keep_keys("a", "b")``, ``split("audio")``,
  ``route_by_field("task", {...})``), for your own plugin to register under a name of its own::

      import omni_core
      from omni_contrib_stages.functions import keep_keys, route_by_field

      @omni_core.hookimpl
      def omni_register_functions(register):
          register("acme.ids_only", keep_keys("ids", "mask"), kind="project_payload")
          register("acme.by_task", route_by_field("task", {"asr": "decoder", "tts": "talker"}),
                   kind="route")

  or expose the built function as a module attribute and name it by dotted path in the config
  (``project_payload: {decoder: "acme.wiring:ids_only"}``): stage processes import it by name.

Conventions shared by these functions: payloads are dicts; keys starting with ``_`` are control
fields (such as ``_to``) that :func:`drop_private` removes before a payload goes on; a *split*
payload holds one sub-dict per branch plus a ``"shared"`` sub-dict every branch receives
(``{"audio": {...}, "image": {...}, "shared": {...}}``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

import torch

#: What a route function returns to mean "every stage in next" (as omni_core's route functions).
ALL_TARGETS = "*"

#: Keys of a split payload that ``contrib.split.<part>`` functions are registered for.
SPLIT_PARTS = ("audio", "image", "video", "text", "speech")

#: The key of a split payload whose entries every part receives.
SHARED = "shared"


def _need_dict(payload: Any, who: str) -> dict:
    if not isinstance(payload, Mapping):
        raise TypeError(f"{who} needs a dict payload, got {type(payload).__name__}")
    return dict(payload)


# -- merge -------------------------------------------------------------------------------------


def _combine(payloads: dict[str, Any], join: Callable[[list[torch.Tensor]], torch.Tensor], who: str) -> dict[str, Any]:
    sources = list(payloads)
    values: dict[str, list[tuple[str, Any]]] = {}
    for source, payload in payloads.items():
        if not isinstance(payload, Mapping):
            raise TypeError(f"{who} needs dict payloads; stage {source!r} sent {type(payload).__name__}")
        for key, value in payload.items():
            values.setdefault(key, []).append((source, value))
    merged: dict[str, Any] = {}
    for key, found in values.items():
        tensors = [v for _, v in found if isinstance(v, torch.Tensor)]
        if len(found) == 1:
            merged[key] = found[0][1]
        elif len(tensors) == len(found):
            try:
                merged[key] = join(tensors)
            except RuntimeError as exc:
                shapes = ", ".join(f"{s}: {tuple(v.shape)} {v.dtype}" for s, v in found)
                raise ValueError(f"{who}: cannot join the tensors under key {key!r} ({shapes}): {exc}") from None
        elif tensors:
            kinds = ", ".join(f"{s}: {type(v).__name__}" for s, v in found)
            raise TypeError(f"{who}: key {key!r} holds tensors in some sources and not in others ({kinds})")
        else:
            first_source, first = found[0]
            for source, value in found[1:]:
                if value != first:
                    raise ValueError(
                        f"{who}: key {key!r} differs between {first_source!r} ({first!r}) and "
                        f"{source!r} ({value!r}); only tensors are joined, other values must agree"
                    )
            merged[key] = first
    if not sources:
        raise ValueError(f"{who}: nothing to merge")
    return merged


def concat_tensors(payloads: dict[str, Any]) -> dict[str, Any]:
    """Merge dict payloads: tensors under the same key are concatenated along dim 0 in
    ``wait_for`` order; keys only one source has are kept; other values present in several sources
    must be equal and are kept once."""
    return _combine(payloads, lambda ts: torch.cat(ts, dim=0), "contrib.concat_tensors")


def stack_tensors(payloads: dict[str, Any]) -> dict[str, Any]:
    """Like ``contrib.concat_tensors`` but stacks tensors along a new dim 0 (they must have the
    same shape): ``n`` sources give a ``[n, ...]`` tensor, in ``wait_for`` order."""
    return _combine(payloads, lambda ts: torch.stack(ts, dim=0), "contrib.stack_tensors")


# -- project_payload -----------------------------------------------------------------------------


def tensors_only(payload: Any) -> dict[str, Any]:
    """Keep only the top-level keys that hold tensors."""
    return {k: v for k, v in _need_dict(payload, "contrib.tensors_only").items() if isinstance(v, torch.Tensor)}


def drop_tensors(payload: Any) -> dict[str, Any]:
    """Keep only the top-level keys that do not hold tensors (the metadata)."""
    return {k: v for k, v in _need_dict(payload, "contrib.drop_tensors").items() if not isinstance(v, torch.Tensor)}


def drop_private(payload: Any) -> dict[str, Any]:
    """Drop the control keys (top-level keys starting with ``_``)."""
    return {k: v for k, v in _need_dict(payload, "contrib.drop_private").items() if not str(k).startswith("_")}


def keep_keys(*keys: str, name: str | None = None) -> Callable[[Any], dict[str, Any]]:
    """Builder: a projection keeping only ``keys`` (each must be present)."""
    if not keys:
        raise ValueError("keep_keys needs at least one key")
    who = name or f"keep_keys({', '.join(map(repr, keys))})"

    def project(payload: Any) -> dict[str, Any]:
        data = _need_dict(payload, who)
        missing = [k for k in keys if k not in data]
        if missing:
            raise KeyError(f"{who}: the payload has no key(s) {missing}; it has {sorted(map(str, data))}")
        return {k: data[k] for k in keys}

    project.__name__ = project.__qualname__ = who
    project.__doc__ = f"Keep only the keys {list(keys)}."
    return project


def drop_keys(*keys: str, name: str | None = None) -> Callable[[Any], dict[str, Any]]:
    """Builder: a projection removing ``keys`` (absent ones are ignored)."""
    if not keys:
        raise ValueError("drop_keys needs at least one key")
    who = name or f"drop_keys({', '.join(map(repr, keys))})"
    dropped = set(keys)

    def project(payload: Any) -> dict[str, Any]:
        return {k: v for k, v in _need_dict(payload, who).items() if k not in dropped}

    project.__name__ = project.__qualname__ = who
    project.__doc__ = f"Remove the keys {list(keys)}."
    return project


def split(part: str, *, shared: str | None = SHARED, name: str | None = None) -> Callable[[Any], dict[str, Any]]:
    """Builder: the projection giving one branch its part of a split payload:
    ``payload[part]`` updated over ``payload[shared]`` (the part wins on a clash)."""
    who = name or f"contrib.split.{part}"

    def project(payload: Any) -> dict[str, Any]:
        data = _need_dict(payload, who)
        if part not in data:
            raise KeyError(f"{who}: the payload has no part {part!r}; it has {sorted(map(str, data))}")
        own = data[part]
        if not isinstance(own, Mapping):
            raise TypeError(f"{who}: part {part!r} must be a dict, got {type(own).__name__}")
        common = data.get(shared, {}) if shared else {}
        if not isinstance(common, Mapping):
            raise TypeError(f"{who}: {shared!r} must be a dict, got {type(common).__name__}")
        return {**common, **own}

    project.__name__ = project.__qualname__ = who.rsplit(".", 1)[-1]
    project.__doc__ = f"The {part!r} part of a split payload, with the {shared!r} entries."
    return project


split_audio = split("audio")
split_image = split("image")
split_video = split("video")
split_text = split("text")
split_speech = split("speech")


# -- route ---------------------------------------------------------------------------------------


def _names(value: Any, who: str, field: str) -> list[str]:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"{who}: {field!r} must be a stage name or a list of names, got {value!r}")
    return list(names)


def route_to(request_id: str, payload: Any) -> Any:
    """Route to the stage(s) named by the payload's ``_to`` key; to every ``next`` stage when
    the key is absent or null."""
    if not isinstance(payload, Mapping) or payload.get("_to") is None:
        return ALL_TARGETS
    return _names(payload["_to"], "contrib.route.to", "_to")


def route_by_field(field: str, table: Mapping[Hashable, str | Iterable[str]] | None = None, *,
                   default: str | Iterable[str] | None = None, name: str | None = None) -> Callable[[str, Any], Any]:
    """Builder: a route function reading ``payload[field]``.

    Without ``table`` the field's value names the target stage(s). With ``table`` the value is
    looked up in it (``{"tts": "talker", "asr": ["decoder", "logger"]}``). ``default`` is used
    when the field is absent or the value is not in the table (``"*"``: every ``next`` stage);
    without a default that is an error naming the field and the known values."""
    who = name or f"route_by_field({field!r})"
    table = dict(table) if table is not None else None

    def route(request_id: str, payload: Any) -> Any:
        if isinstance(payload, Mapping) and field in payload:
            value = payload[field]
            if table is None:
                return _names(value, who, field)
            if isinstance(value, Hashable) and value in table:
                return _names(table[value], who, f"table[{value!r}]")
            if default is None:
                known = ", ".join(repr(k) for k in table)
                raise ValueError(f"{who}: {field}={value!r} is not one of {known} (and the route has no default)")
        elif default is None:
            raise KeyError(f"{who}: the payload has no {field!r} key (and the route has no default)")
        return default if isinstance(default, str) else list(default)

    route.__name__ = route.__qualname__ = who
    return route

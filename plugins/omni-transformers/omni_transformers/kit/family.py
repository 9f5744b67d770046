"""What a model family is, as the kit sees it, and how a checkpoint folder finds its family.

A family is a :class:`Family` descriptor registered with omni's ``omni_register_families`` hook
(``register(name, "pkg.mod:FAMILY", model_types=[...], pipeline="NAME")``), plus its stages,
which subclass the kit's skeletons and fill their hooks:

- its parts and how to load each: ``ThinkerEngine.load_model`` (``kit.thinker``),
  ``Encoder.load_tower`` (``kit.encoders``), and its talker's and vocoder's own loading;
- its processor: a stage turning a request's inputs into ``input_ids`` (+ media features);
- its speakers: ``Thinker.setup_speech`` / ``speech_head`` (a bad name is an ``InvalidInput``
  naming the field and the names there are);
- the thinker's hooks (prompt, positions, the talker's conditioning), the typed chunks of
  ``kit.chunks`` between its stages (a talker step yields a *frame* of ``codebooks`` codes);
- its pipelines (registered as any omni pipeline) and ``default_pipeline``, served on a checkpoint
  folder whose ``config.json`` says one of ``model_types``;
- ``write_tiny``: ``"pkg.mod:function"``, ``function(path, *, seed=0) -> Path``, a tiny random
  checkpoint for tests (``python -m omni_transformers.tiny DIR --family NAME``).

Nothing here imports torch or transformers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs


@attrs.frozen
class Family:
    """One model family: its name, the ``model_type`` values it serves, its default pipeline, its
    tiny checkpoint writer and the stage factories of its roles (``{"thinker": "family.thinker", ...}``)."""

    name: str
    model_types: tuple[str, ...] = attrs.field(converter=tuple)
    default_pipeline: str
    write_tiny: str | None = None
    stages: Mapping[str, str] = attrs.field(factory=dict)
    description: str = ""


def model_type_of(path: str | Path) -> str | None:
    """The ``model_type`` of a checkpoint folder's ``config.json`` (None when it has none)."""
    config = Path(path) / "config.json"
    try:
        value = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def installed_families(registry: Any = None) -> dict[str, Family]:
    """Every family registered through omni's plugins (``omni_register_families``), by name."""
    if registry is None:
        from omni_core.plugins import load_plugins

        registry = load_plugins().registry
    found = {}
    for name in registry.names("family"):
        family = registry.get("family", name).load()
        if isinstance(family, Family):
            found[name] = family
    return found


def family_for(path: str | Path, registry: Any = None) -> Family:
    """The family serving the checkpoint folder ``path`` (by its ``config.json``'s ``model_type``);
    a folder no family knows is a ``ValueError`` naming its model type and the families installed."""
    model_type = model_type_of(path)
    families = installed_families(registry)
    for family in families.values():
        if model_type in family.model_types:
            return family
    installed = ", ".join(f"{f.name} ({', '.join(f.model_types)})" for f in families.values()) or "none"
    raise ValueError(f"{path}: no installed model family serves model_type {model_type!r}; "
                     f"installed families: {installed}")

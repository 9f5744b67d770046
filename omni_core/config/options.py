"""The options a config gives relays, placement strategies, launchers and serve APIs, checked
against the schemas those plugins declared when they registered (see :mod:`omni_core.options`).

Nothing a plugin registered lazily is imported: a schema is registration metadata. A name whose
plugin declared no schema is not checked here (its own code checks its options when it runs).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..errors import ConfigIssue, PluginError
from ..options import option_issues
from ..registry import Registry, is_dotted_path
from .schema import PipelineConfig, RelayConfig


def _schema(registry: Registry, kind: str, name: str) -> Any:
    """The declared schema of ``name`` (None: unknown name, dotted path, or no schema)."""
    if is_dotted_path(name):
        return None
    try:
        return registry.get(kind, name).options
    except PluginError:  # unknown or ambiguous: reported by the name checks
        return None


def _relay_sections(cfg: PipelineConfig) -> Iterator[tuple[str, RelayConfig]]:
    yield "relay", cfg.relay
    for i, stage in enumerate(cfg.stages):
        if stage.relay is not None:
            yield f"stages[{i}].relay", stage.relay


def options_issues(cfg: PipelineConfig, registry: Registry) -> list[ConfigIssue]:
    """Every problem of ``relay.options`` (and each stage's), ``placement.options``,
    ``launcher.options`` and ``serve.options.<api>``, with its config path: ``relay.options.slots: expected a positive
    integer, got '8'``. Under ``relay: auto`` the options are keyed by relay name
    (``{shm: {slots: 8}}``) and each mapping is checked against that relay's schema."""
    issues: list[ConfigIssue] = []
    for path, relay in _relay_sections(cfg):
        if relay.backend == "auto":
            for name, options in relay.options.items():
                schema = _schema(registry, "relay", name)
                if schema is not None and isinstance(options, dict):
                    issues += option_issues(schema, options, f"{path}.options.{name}", owner=f"relay {name!r}")
            continue
        schema = _schema(registry, "relay", relay.backend)
        if schema is not None:
            issues += option_issues(schema, relay.options, f"{path}.options", owner=f"relay {relay.backend!r}")
    for kind, path, name, options in (
        ("placement", "placement.options", cfg.placement.strategy, cfg.placement.options),
        ("launcher", "launcher.options", cfg.launcher.name, cfg.launcher.options),
    ):
        schema = _schema(registry, kind, name)
        if schema is not None:
            owner = f"placement strategy {name!r}" if kind == "placement" else f"launcher {name!r}"
            issues += option_issues(schema, options, path, owner=owner)
    for name, options in cfg.serve.options.items():  # serve.options is keyed by API name
        schema = _schema(registry, "api", name)
        if schema is not None:
            issues += option_issues(schema, options, f"serve.options.{name}", owner=f"API {name!r}")
    return issues

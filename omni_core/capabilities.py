"""What a relay can move (:class:`RelayCapabilities`), parsed from what a plugin declared when
it registered the relay, and the one reading of it (:func:`relay_capabilities`).

A leaf below the plugin loader and the relays: the loader checks ``capabilities=`` of a relay's
registration without importing anything of the relays (nor torch); ``auto``, ``omni plan`` and
the runtime's edges read them through :func:`relay_capabilities`. ``omni_core.relay`` re-exports
:class:`RelayCapabilities` for plugins.
"""

from __future__ import annotations

from typing import Any

import attrs

from .registry import Registry, is_dotted_path


@attrs.frozen
class RelayCapabilities:
    """What a relay can move, so the ``auto`` backend can choose per edge.

    ``devices``: tensor devices it accepts (``"cpu"``, ``"cuda"``). ``scopes``: where the two ends
    may be: ``"node"`` (different processes, same machine) and/or ``"cluster"`` (different
    machines). ``priority``: among relays able to serve an edge, ``auto`` takes the highest.
    ``ms_per_mib``: for a relay with the ``cluster`` scope, the milliseconds one MiB is expected to
    take between two nodes, as its benchmark measured it (``omni plan`` shows it for edges that
    cross nodes); None when not measured.
    """

    devices: frozenset[str] = frozenset({"cpu"})
    scopes: frozenset[str] = frozenset({"node"})
    priority: int = 0
    ms_per_mib: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"devices": sorted(self.devices), "scopes": sorted(self.scopes), "priority": self.priority}
        if self.ms_per_mib is not None:
            out["ms_per_mib"] = self.ms_per_mib
        return out


#: The values :class:`RelayCapabilities` fields may hold.
DEVICES = ("cpu", "cuda")
SCOPES = ("node", "cluster")


def as_capabilities(value: Any) -> RelayCapabilities:
    """:class:`RelayCapabilities` from what a plugin passed as ``capabilities=``: an instance,
    or a mapping ``{"devices": [...], "scopes": [...], "priority": n}``. ValueError otherwise."""
    if isinstance(value, RelayCapabilities):
        caps = value
    elif isinstance(value, dict):
        unknown = set(value) - {"devices", "scopes", "priority", "ms_per_mib"}
        if unknown:
            raise ValueError(f"capabilities: unknown key(s) {', '.join(sorted(unknown))}; keys: devices, scopes, "
                             "priority, ms_per_mib")
        fields: dict[str, Any] = {}
        for key in ("devices", "scopes"):
            if key in value:
                items = value[key]
                if isinstance(items, str) or not all(isinstance(x, str) for x in items):
                    raise ValueError(f"capabilities: {key} must be a list of strings, got {items!r}")
                fields[key] = frozenset(items)
        for key in ("priority", "ms_per_mib"):
            if key in value:
                fields[key] = value[key]
        caps = RelayCapabilities(**fields)
    else:
        raise ValueError("capabilities= must be omni_core.relay.RelayCapabilities or a mapping "
                         f"with devices, scopes and priority, got {type(value).__name__}")
    bad = [d for d in caps.devices if d not in DEVICES] + [s for s in caps.scopes if s not in SCOPES]
    if bad:
        raise ValueError(f"capabilities: unknown value(s) {', '.join(map(repr, sorted(bad)))}; devices are "
                         f"{', '.join(DEVICES)}, scopes are {', '.join(SCOPES)}")
    if not caps.devices or not caps.scopes:
        raise ValueError("capabilities: devices and scopes must not be empty")
    if isinstance(caps.priority, bool) or not isinstance(caps.priority, int):
        raise ValueError(f"capabilities: priority must be an integer, got {caps.priority!r}")
    cost = caps.ms_per_mib
    if cost is not None and (isinstance(cost, bool) or not isinstance(cost, (int, float)) or not cost > 0):
        raise ValueError(f"capabilities: ms_per_mib must be a positive number or None, got {cost!r}")
    return caps


def relay_capabilities(registry: Registry | None, name: str, relay: Any = None) -> RelayCapabilities | None:
    """What relay ``name`` can move: the capabilities its registration declared (read without
    importing the relay), else its class's ``capabilities`` (``relay``, the class or an instance,
    when given; else the class ``registry`` resolves, which imports it). None when neither says.
    ``registry`` None: the class's word alone."""
    if registry is not None and not is_dotted_path(name):
        declared = registry.get("relay", name).capabilities
        if declared is not None:
            return declared
    if relay is None and registry is not None:
        relay = registry.resolve("relay", name)
    caps = getattr(relay, "capabilities", None)
    return caps if isinstance(caps, RelayCapabilities) else None

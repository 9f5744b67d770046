"""Relays move tensors between stage processes; see :mod:`omni_core.relay.base` for the protocol.

Importing this package imports no torch (plugin modules import ``RelayCapabilities`` from here
to register a relay, and planning must stay free of torch); the tensor-lifetime helpers load on
first use."""

from .base import InvalidHandle, Relay, RelayCapabilities, RelayContext, RelayError, Transfer

_LAZY = {"detach", "lent_storages", "storage_key"}  # from .lifetime, which imports torch


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'omni_core.relay' has no attribute {name!r}")
    from . import lifetime

    value = getattr(lifetime, name)
    globals()[name] = value
    return value


__all__ = [
    "InvalidHandle", "Relay", "RelayCapabilities", "RelayContext", "RelayError", "Transfer",
    "detach", "lent_storages", "storage_key",
]

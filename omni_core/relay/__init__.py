"""Relays move tensors between stage processes; see :mod:`omni_core.relay.base` for the protocol."""

from .base import InvalidHandle, Relay, RelayCapabilities, RelayContext, RelayError, Transfer
from .lifetime import detach, lent_storages, storage_key

__all__ = [
    "InvalidHandle", "Relay", "RelayCapabilities", "RelayContext", "RelayError", "Transfer",
    "detach", "lent_storages", "storage_key",
]

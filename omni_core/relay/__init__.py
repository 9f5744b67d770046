"""Relays move tensors between stage processes; see :mod:`omni_core.relay.base` for the protocol."""

from .base import Relay, RelayCapabilities, RelayContext, Transfer

__all__ = ["Relay", "RelayCapabilities", "RelayContext", "Transfer"]

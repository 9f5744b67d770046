"""omni_core.capabilities.relay_capabilities: the one reading of what a relay can move (its
registration's word, else its class's)."""

from __future__ import annotations

from omni_core.capabilities import RelayCapabilities, relay_capabilities
from omni_core.relay.specs import INLINE_CAPABILITIES, SHM_CAPABILITIES


def test_the_registration_says_without_importing_the_relay(registry):
    assert relay_capabilities(registry, "shm") == SHM_CAPABILITIES
    assert relay_capabilities(registry, "inline") == INLINE_CAPABILITIES


def test_without_a_registration_the_class_says():
    class Mover:
        capabilities = RelayCapabilities(devices=frozenset({"cuda"}), priority=3)

    assert relay_capabilities(None, "mover", Mover).devices == frozenset({"cuda"})
    assert relay_capabilities(None, "mover", object()) is None


def test_a_dotted_path_is_read_from_its_class(registry):
    caps = relay_capabilities(registry, "omni_core.relay.inline:InlineRelay")
    assert caps == INLINE_CAPABILITIES

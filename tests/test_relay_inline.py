"""The inline relay against the relay conformance kit."""

from omni_core.testing.relay_conformance import RelayConformance


class TestInlineRelay(RelayConformance):
    relay_name = "inline"
    credits = None  # tensors ride in the control message: nothing to run out of

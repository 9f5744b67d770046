"""The relay conformance kit against ``nccl``, on CPU tensors over gloo (the path that runs without
a GPU), resolved by name through the installed plugin."""

from __future__ import annotations

from omni_core.testing.relay_conformance import RelayConformance


class TestNcclRelay(RelayConformance):
    relay_name = "nccl"
    relay_options = {"credits": 4, "timeout": 1.0, "link_timeout": 30.0}
    credits = 4
    unread_release_gap = ("a release without a get frees nothing: the receiver joins the sender's link at its first "
                          "get (the sender's cleanup frees the credit when the request ends)")
    put_timeout = 1.0
    large_bytes = 8 << 20

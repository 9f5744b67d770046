"""The relay conformance kit against ``tcp`` on one node (receiver in a spawned process, handles
over a pipe), resolved by name through the installed plugin; once in the clear and once
encrypted. Every transfer goes over the data connection (``inline_below: 0``), so the credit
cases hold credits."""

from __future__ import annotations

from omni_core.testing.relay_conformance import RelayConformance

OPTIONS = {"credits": 4, "timeout": 1.0, "inline_below": 0, "host": "127.0.0.1", "chunk_bytes": 1 << 16}


class TestTcpRelay(RelayConformance):
    relay_name = "tcp"
    relay_options = OPTIONS
    credits = 4
    unread_release_gap = ("a release without a get frees nothing: the receiver holds no link to the sender "
                          "before its first get (the sender's cleanup frees the credit when the request ends)")
    put_timeout = 1.0
    large_bytes = 8 << 20


class TestTcpRelayEncrypted(TestTcpRelay):
    relay_options = {**OPTIONS, "encrypt": True}

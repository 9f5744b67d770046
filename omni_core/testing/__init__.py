"""What plugin authors test with.

- :mod:`omni_core.testing.relay_conformance`: ``RelayConformance``, the relay protocol's contracts
  as pytest tests a relay package subclasses to run against its backend.
- :mod:`omni_core.testing.peer`: ``RelayPeer``, a relay in a spawned process for cross-process
  tests of one's own.

Importing this package does not import pytest; the conformance module does.
"""

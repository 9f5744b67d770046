"""What plugin authors test with.

- :mod:`omni_core.testing.relay_conformance`: ``RelayConformance``, the relay protocol's contracts
  as pytest tests a relay package subclasses to run against its backend.
- :mod:`omni_core.testing.peer`: ``RelayPeer``, a relay in a spawned process for cross-process
  tests of one's own.
- :mod:`omni_core.testing.leaks`: the ``no_leaks`` fixture and helpers that check a test left no
  stage process, runtime directory or /dev/shm segment behind.
- :mod:`omni_core.testing.cuda`: the ``cuda`` marker (``@pytest.mark.cuda(devices=2)``): GPU tests
  skip without CUDA and fail instead under ``OMNI_REQUIRE_CUDA=1``.

Importing this package does not import pytest; the conformance module does.
"""

"""What plugin authors test with.

- :func:`assert_plugin_registers` and :func:`run_pipeline` (:mod:`omni_core.testing.plugins`):
  check what an installed distribution registers; run a pipeline config in real processes and
  get each request's result, streamed chunks or error.
- :mod:`omni_core.testing.relay_conformance`: ``RelayConformance``, the relay protocol's contracts
  as pytest tests a relay package subclasses to run against its backend (leak checks included:
  /dev/shm, files in the runtime dir, file descriptors, threads).
- :mod:`omni_core.testing.peer`: ``RelayPeer``, a relay in a spawned process for cross-process
  tests of one's own.
- :mod:`omni_core.testing.leaks`: the ``no_leaks`` fixture and helpers that check a test left no
  stage process, runtime directory or /dev/shm segment behind.
- :mod:`omni_core.testing.serve` and :mod:`omni_core.testing.fuzz`: ``ServerProcess``, a real
  ``omni serve`` for a test (``ServerProcess.of_config``: of a config the test writes, with its own
  stage modules importable); ``openai_client``, the official SDK on it counting the POSTs it sends;
  ``fuzz_server``, hypothesis over its ``GET /openapi.json``.
- :mod:`omni_core.testing.waiting`: ``until`` (poll a predicate with a deadline, the way to wait
  for another task, thread or process instead of sleeping), ``holds_within`` (its synchronous
  twin, a bool to assert), ``suspended`` (until tasks started and wait, instead of counting turns
  of the event loop) and ``events_until`` (a realtime connection's events up to the first of a
  type, with a timeout).
- :mod:`omni_core.testing.cuda`: the ``cuda`` marker (``@pytest.mark.cuda(devices=2)``): GPU tests
  skip without CUDA and fail instead under ``OMNI_REQUIRE_CUDA=1``.

Importing this package imports neither pytest nor torch; the conformance module imports both.
"""

from .plugins import Outcome, assert_plugin_registers, run_pipeline

__all__ = ["Outcome", "assert_plugin_registers", "run_pipeline"]

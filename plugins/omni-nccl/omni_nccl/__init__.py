"""omni-nccl: the ``nccl`` relay, torch.distributed point-to-point between two stage processes.

Install it beside omni-core and name it in a pipeline config::

    pip install -c constraints.txt ./plugins/omni-nccl          # from a checkout of omni

    relay:
      backend: nccl
      options: {credits: 16, timeout: 30, link_timeout: 60}

Every ordered pair of processes that exchanges tensors gets its own 2-rank process group (a
*link*), created on first use on both ends, rendezvous through a file in the run's private
runtime dir, never the global default group. CPU tensors travel over gloo, CUDA tensors over NCCL;
the same code serves both, and the CPU path is what the tests exercise without a GPU.

- ``put`` copies once into a staging buffer, takes a credit and sends without blocking; the
  handle carries the link and a per-link sequence number.
- The receiving process takes transfers off the link in sequence order in a thread of its own,
  so an aborted request whose ``get`` never comes cannot put the pair out of step.
- ``release`` and credits travel back through the link's ledger file; a dead or closed receiver
  makes ``put`` fail with :class:`~omni_core.relay.base.RelayTimeout` (no hang) once its credits
  run out, and the next link generation serves a restarted receiver.

Options (``relay.options``): ``credits`` (default 16), ``timeout`` (seconds a put waits for a
credit, default 30), ``link_timeout`` (seconds to connect a link or to complete one send or
receive, default 60). See :mod:`omni_nccl.relay` for the design and ``docs/relays.md`` for when to
choose it over ``shm``.
"""

__version__ = "0.1.0"

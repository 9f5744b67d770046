"""omni-cuda-ipc: the ``cuda_ipc`` relay, CUDA tensors between GPU stages of one node.

Install it beside omni-core and name it in a pipeline config (or let ``auto`` pick it for GPU
edges once the runtime considers CUDA edges)::

    pip install -c constraints.txt ./plugins/omni-cuda-ipc      # from a checkout of omni

    relay:
      backend: cuda_ipc
      options: {credits: 32, timeout: 30}

- Same GPU: zero copy. The receiver opens the sender's CUDA allocation through an IPC handle and
  reads it in place; the sender keeps the tensors alive until the receiver releases them.
- Different GPUs: the receiver peer-copies into a pool of reused buffers on its own GPU.
- An interprocess CUDA event per credit slot orders the receiver's reads after the sender's
  writes without blocking either host.
- Releases reach the sender through a small ledger file in the run's runtime dir (the relay
  protocol has no back-channel); a receiver that dies or never releases makes ``put`` fail with
  :class:`~omni_core.relay.base.RelayTimeout` once its credits run out.

CUDA tensors only: the runtime sends a payload's CPU tensors through ``inline`` beside them, and a
process without CUDA gets a clear error when it builds the relay. See :mod:`omni_cuda_ipc.relay`
for the design and ``docs/relays.md`` for when to choose it.
"""

__version__ = "0.1.0"

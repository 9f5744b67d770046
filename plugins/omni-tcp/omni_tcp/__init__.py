"""omni-tcp: the ``tcp`` relay, tensors between stage processes on different machines over an
authenticated tcp data connection per process pair.

Install it beside omni-core (on the driver and on every node); ``relay: auto`` then takes it for
every edge whose ends run on different nodes::

    pip install -c constraints.txt ./plugins/omni-tcp          # from a checkout of omni
    pip install -c constraints.txt './plugins/omni-tcp[encrypt]'   # with relay.options.encrypt

    relay:
      backend: auto
      options: {tcp: {credits: 16, chunk_bytes: 1048576, encrypt: false}}

See :mod:`omni_tcp.relay` for how it works, :mod:`omni_tcp.wire` for the connection and its
handshake, and ``docs/relays.md`` for its options and measured cost.
"""

__version__ = "0.1.0"

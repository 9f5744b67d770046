"""tcp endpoints of the control plane: bound ahead with bind_inbox (a port chosen by binding,
within endpoints.port_range), CurveZMQ for every tcp socket, nothing read from a client without
the run's keys."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from omni_core.runtime import wire
from omni_core.runtime.channel import (
    CurveKeys,
    Inbox,
    Outbox,
    bind_inbox,
    forget_trust,
    release_inboxes,
)

pytestmark = pytest.mark.timeout(60)


def _refused(sock: zmq.Socket, monitor: zmq.Socket, timeout: float = 20.0) -> int:
    """The first handshake failure the monitor (attached before ``sock`` connected, so no event
    is missed) reports for ``sock``."""
    failed = {zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
              zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_DISCONNECTED}
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if monitor.poll(100):
                event = recv_monitor_message(monitor)["event"]
                assert event != zmq.EVENT_HANDSHAKE_SUCCEEDED
                if event in failed:
                    return event
        raise AssertionError("no handshake failure seen")
    finally:
        sock.disable_monitor()
        monitor.close(0)


def test_a_run_key_holder_is_heard_and_a_stranger_is_refused(tmp_path):
    keys = CurveKeys.generate()
    address = bind_inbox(f"ipc://{tmp_path}/in", keys=keys, host="127.0.0.1", port_range=(20000, 60000))
    port = int(address.rsplit(":", 1)[1])
    assert address.startswith("tcp://127.0.0.1:") and 20000 <= port <= 60000
    assert keys.server_secret.decode() not in repr(keys) and keys.client_secret.decode() not in repr(keys)
    got: list = []

    async def body():
        ctx = zmq.Context()
        inbox = Inbox(ctx, address, lambda msg, frames: got.append(msg))  # adopts the bound socket
        inbox.start()
        outbox = Outbox(ctx)
        stranger = ctx.socket(zmq.PUSH)
        stranger.setsockopt(zmq.LINGER, 0)
        public, secret = zmq.curve_keypair()
        stranger.curve_serverkey, stranger.curve_publickey, stranger.curve_secretkey = keys.server_public, public, secret
        stranger_events = stranger.get_monitor_socket()
        stranger.connect(address)
        stranger.send(wire.encode(wire.Shutdown()), zmq.NOBLOCK)
        plain = ctx.socket(zmq.PUSH)
        plain.setsockopt(zmq.LINGER, 0)
        plain_events = plain.get_monitor_socket()
        plain.connect(address)
        plain.send(wire.encode(wire.Shutdown()), zmq.NOBLOCK)
        await asyncio.to_thread(_refused, stranger, stranger_events)
        await asyncio.to_thread(_refused, plain, plain_events)
        await outbox.send(address, wire.Bye("insider"))
        deadline = time.monotonic() + 20
        while not got and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert [type(m).__name__ for m in got] == ["Bye"]
        for s in (stranger, plain):
            s.close(0)
        outbox.close(0)
        inbox.close()
        ctx.term()

    asyncio.run(body())
    forget_trust(keys)


def test_a_tcp_inbox_must_be_bound_with_keys_and_unadopted_ones_are_released(tmp_path):
    ctx = zmq.Context()
    with pytest.raises(ValueError, match="bind_inbox"):
        Inbox(ctx, "tcp://127.0.0.1:5", lambda m, f: None)
    with pytest.raises(ValueError, match="no CurveZMQ keys"):
        Outbox(ctx).post("tcp://127.0.0.1:6", {"kind": "hello"})
    keys = CurveKeys.generate()
    address = bind_inbox(None, keys=keys, host="127.0.0.1")
    release_inboxes([address])
    again = bind_inbox(None, keys=keys, host="127.0.0.1", tcp=address)  # the port is free again
    assert again == address
    release_inboxes([address])
    forget_trust(keys)
    ctx.term()


def _plain_bind(sock: zmq.Socket, address: str, timeout: float = 0) -> None:
    sock.bind(address)


def test_a_released_port_is_closed_when_release_returns(monkeypatch):
    """``close(linger=0)`` returns before zmq's I/O thread lets go of the listening socket: a
    rebind right after it failed with EADDRINUSE in 11 runs of 20. Release waits for the port."""
    from omni_core.runtime import channel

    monkeypatch.setattr(channel, "bind_when_free", _plain_bind)  # no waiting on the bind side
    keys = CurveKeys.generate()
    ctx = zmq.Context()
    try:
        for _ in range(150):
            address = bind_inbox(None, keys=keys, host="127.0.0.1")
            release_inboxes([address])
            assert bind_inbox(None, keys=keys, host="127.0.0.1", tcp=address) == address
            # an adopted inbox closes the same way
            inbox = Inbox(ctx, address, lambda m, f: None)
            inbox.close()
            assert bind_inbox(None, keys=keys, host="127.0.0.1", tcp=address) == address
            release_inboxes([address])
    finally:
        forget_trust(keys)
        ctx.term()


def test_an_exact_tcp_bind_waits_for_a_port_another_socket_still_holds():
    """A restarted process keeps its address while its predecessor may still hold the port: the
    bind waits for it (bounded), whichever of the two comes first."""
    import socket
    import threading

    keys = CurveKeys.generate()
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    address = f"tcp://127.0.0.1:{holder.getsockname()[1]}"
    result: list = []
    binder = threading.Thread(target=lambda: result.append(bind_inbox(None, keys=keys, host="127.0.0.1",
                                                                      tcp=address)))
    binder.start()
    holder.close()
    binder.join(30)
    assert result == [address]
    release_inboxes([address])

    from omni_core.runtime import channel

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    address = f"tcp://127.0.0.1:{holder.getsockname()[1]}"
    sock = zmq.Context.instance().socket(zmq.PULL)
    try:
        with pytest.raises(zmq.ZMQError, match="still in use after"):
            channel.bind_when_free(sock, address, timeout=0.2)
    finally:
        sock.close(linger=0)
        holder.close()
        forget_trust(keys)

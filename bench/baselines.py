"""Baseline chains of the same shape as an omni chain, without omni.

- :class:`ZmqChain`: the floor. One process per stage, blocking pyzmq PUSH/PULL sockets over ipc,
  msgpack decode + encode at every stage (msgspec's msgpack, the codec omni itself uses, so the
  difference is omni's own work); the driver sends and receives with blocking calls.
- :class:`QueueChain`: the naive alternative. One process per stage, ``multiprocessing.Queue``
  between neighbours (pickle, a feeder thread per queue).
- :class:`ZmqStream`: the floor for a stage→stage stream. A source process sends each stream's
  chunks (a msgpack header and the raw bytes of a small tensor) to a sink process, which checks
  and times them and answers the driver once per stream.

Both run a request through ``n`` stages and back to the driver (``n + 1`` hops), one at a time
(:meth:`request`) or with a fixed number in flight (:meth:`pipelined`). Their workers import
neither torch nor omni: they start as bare Python processes.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
from typing import Any

from omni_core._compat import without_main_module

STOP = b"\x00stop"
START_TIMEOUT = 60.0


def _spawn() -> Any:
    return mp.get_context("spawn")


def _start(procs: list) -> None:
    with without_main_module():  # workers import only what their target needs
        for p in procs:
            p.start()


# -- raw pyzmq --------------------------------------------------------------------------------


def _codec() -> tuple[Any, Any]:
    import msgspec

    return msgspec.msgpack.Encoder().encode, msgspec.msgpack.Decoder().decode


def _zmq_stage(in_addr: str, out_addr: str) -> None:
    import zmq

    ctx = zmq.Context(io_threads=1)
    pull = ctx.socket(zmq.PULL)
    pull.bind(in_addr)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(out_addr)
    packb, unpackb = _codec()
    while True:
        msg = pull.recv()
        if msg == STOP:
            push.send(STOP)
            break
        push.send(packb(unpackb(msg)))
    pull.close(0)
    push.close()
    ctx.term()


class ZmqChain:
    """``n`` processes in a line: driver → s0 → … → s(n-1) → driver, PUSH/PULL over ipc."""

    label = "raw pyzmq"

    def __init__(self, n: int):
        import zmq

        self.n = n
        self.dir = tempfile.mkdtemp(prefix="omni-bench-zmq-")
        addrs = [f"ipc://{self.dir}/s{i}" for i in range(n)] + [f"ipc://{self.dir}/sink"]
        self.ctx = zmq.Context(io_threads=1)
        self.sink = self.ctx.socket(zmq.PULL)
        self.sink.bind(addrs[-1])
        self.procs = [_spawn().Process(target=_zmq_stage, args=(addrs[i], addrs[i + 1]), daemon=True) for i in range(n)]
        _start(self.procs)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(addrs[0])
        self._packb, self._unpackb = _codec()
        self._zmq = zmq
        # The chain is ready once a message went all the way round.
        self.push.send(self._packb({"ping": 1}))
        deadline = time.monotonic() + START_TIMEOUT
        while not self.sink.poll(100):
            dead = [p.exitcode for p in self.procs if not p.is_alive()]
            if dead or time.monotonic() > deadline:
                self.close()
                why = f"a stage process exited (exit codes {dead})" if dead else f"not within {START_TIMEOUT:g} s"
                raise RuntimeError(f"raw pyzmq chain of {n} did not come up: {why}")
        self.sink.recv()

    def pids(self) -> dict[str, int | None]:
        return {f"s{i}": p.pid for i, p in enumerate(self.procs)}

    def request(self, payload: Any) -> Any:
        self.push.send(self._packb(payload))
        return self._unpackb(self.sink.recv())

    def pipelined(self, payload: Any, concurrency: int, duration: float) -> tuple[int, float]:
        """Keep ``concurrency`` requests in flight for ``duration`` seconds, then drain. Returns
        (completed, elapsed seconds)."""
        packb, unpackb, push, sink = self._packb, self._unpackb, self.push, self.sink
        t0 = time.perf_counter()
        end = t0 + duration
        for _ in range(concurrency):
            push.send(packb(payload))
        inflight, done = concurrency, 0
        while inflight:
            unpackb(sink.recv())
            done += 1
            inflight -= 1
            if time.perf_counter() < end:
                push.send(packb(payload))
                inflight += 1
        return done, time.perf_counter() - t0

    def close(self) -> None:
        try:
            if all(p.is_alive() for p in self.procs):
                self.push.send(STOP)
                self.sink.poll(5000)
        finally:
            _join(self.procs)
            self.push.close(0)
            self.sink.close(0)
            self.ctx.term()
            shutil.rmtree(self.dir, ignore_errors=True)


# -- multiprocessing.Queue --------------------------------------------------------------------


def _queue_stage(qin: Any, qout: Any) -> None:
    while True:
        obj = qin.get()
        qout.put(obj)
        if obj is None:
            break


class QueueChain:
    """``n`` processes in a line joined by ``multiprocessing.Queue``s (pickle)."""

    label = "mp.Queue"

    def __init__(self, n: int):
        ctx = _spawn()
        self.n = n
        self.queues = [ctx.Queue() for _ in range(n + 1)]
        self.procs = [ctx.Process(target=_queue_stage, args=(self.queues[i], self.queues[i + 1]), daemon=True) for i in range(n)]
        _start(self.procs)
        self.queues[0].put({"ping": 1})
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                self.queues[-1].get(timeout=0.1)
                break
            except queue.Empty:
                dead = [p.exitcode for p in self.procs if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close()
                    why = f"a stage process exited (exit codes {dead})" if dead else f"not within {START_TIMEOUT:g} s"
                    raise RuntimeError(f"mp.Queue chain of {n} did not come up: {why}") from None

    def pids(self) -> dict[str, int | None]:
        return {f"s{i}": p.pid for i, p in enumerate(self.procs)}

    def request(self, payload: Any) -> Any:
        self.queues[0].put(payload)
        return self.queues[-1].get()

    def pipelined(self, payload: Any, concurrency: int, duration: float) -> tuple[int, float]:
        qin, qout = self.queues[0], self.queues[-1]
        t0 = time.perf_counter()
        end = t0 + duration
        for _ in range(concurrency):
            qin.put(payload)
        inflight, done = concurrency, 0
        while inflight:
            qout.get()
            done += 1
            inflight -= 1
            if time.perf_counter() < end:
                qin.put(payload)
                inflight += 1
        return done, time.perf_counter() - t0

    def close(self) -> None:
        try:
            if all(p.is_alive() for p in self.procs):
                self.queues[0].put(None)
                self.queues[-1].get(timeout=5)
        except Exception:
            pass
        finally:
            _join(self.procs)
            for q in self.queues:
                q.close()
                q.join_thread()


def _join(procs: list) -> None:
    deadline = time.monotonic() + 5
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2)
        if p.is_alive():
            p.kill()
            p.join(2)


def bare_torch_processes(n: int, timeout: float = 120.0) -> float:
    """Seconds until ``n`` Python processes started at once have each imported torch."""
    import subprocess
    import sys

    code = "import torch, sys; sys.stdout.write('ready\\n'); sys.stdout.flush()"
    env = {**os.environ, "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env) for _ in range(n)]
    try:
        for p in procs:
            line = p.stdout.readline()
            if line.strip() != b"ready":
                raise RuntimeError(f"a bare torch process failed (exit code {p.wait(timeout)})")
        elapsed = time.perf_counter() - t0
    finally:
        for p in procs:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stdout.close()
    return elapsed


# -- raw pyzmq stream -------------------------------------------------------------------------


def chunk_bytes(value: int, elements: int) -> bytes:
    """``elements`` bfloat16 values equal to ``value`` (< 256, exact in bfloat16), as raw bytes:
    what a ``torch.full((1, 1, elements), value, dtype=torch.bfloat16)`` tensor holds."""
    import struct

    return struct.pack("<f", float(value))[2:4] * elements


def _zmq_stream_source(in_addr: str, out_addr: str, elements: int) -> None:
    """Per request ``{"rid", "chunks"}``: ``chunks`` messages ``[header, hidden]`` to the sink
    (header = msgpack ``[rid, token, sent_ns]``, hidden = 2 × ``elements`` bytes), then an end
    message ``[rid, -1, chunks]``."""
    import zmq

    ctx = zmq.Context(io_threads=1)
    pull = ctx.socket(zmq.PULL)
    pull.bind(in_addr)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(out_addr)
    packb, unpackb = _codec()
    bank = [chunk_bytes(v, elements) for v in range(256)]
    clock = time.monotonic_ns
    while True:
        msg = pull.recv()
        if msg == STOP:
            push.send(STOP)
            break
        req = unpackb(msg)
        rid, n = req["rid"], req["chunks"]
        for tok in range(n):
            push.send_multipart([packb([rid, tok, clock()]), bank[tok & 255]])
        push.send_multipart([packb([rid, -1, n])])
    pull.close(0)
    push.close()
    ctx.term()


def _zmq_stream_sink(in_addr: str, out_addr: str, elements: int) -> None:
    """Reads every stream's chunks, checks their order and content, and sends the driver one
    result per stream: ``{"rid", "n", "bad", "lat_us"}`` (latency of each chunk, µs)."""
    import zmq

    ctx = zmq.Context(io_threads=1)
    pull = ctx.socket(zmq.PULL)
    pull.bind(in_addr)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(out_addr)
    packb, unpackb = _codec()
    heads = [chunk_bytes(v, 1) for v in range(256)]
    nbytes = 2 * elements
    clock = time.monotonic_ns
    streams: dict[int, list] = {}  # rid -> [next token, bad, latencies]
    while True:
        frames = pull.recv_multipart()
        if frames[0] == STOP:
            push.send(STOP)
            break
        now = clock()
        rid, tok, value = unpackb(frames[0])
        state = streams.get(rid)
        if state is None:
            state = streams[rid] = [0, 0, []]
        if tok < 0:
            del streams[rid]
            bad = state[1] + (state[0] != value)
            push.send(packb({"rid": rid, "n": state[0], "bad": bad, "lat_us": state[2]}))
            continue
        hidden = frames[1]
        if tok != state[0] or len(hidden) != nbytes or hidden[:2] != heads[tok & 255]:
            state[1] += 1
        state[0] += 1
        state[2].append((now - value) / 1e3)
    pull.close(0)
    push.close()
    ctx.term()


class ZmqStream:
    """A raw pyzmq stream of the same bytes as omni's stream scenario: driver → source process
    (one request per stream), source → sink (``chunks`` two-frame messages, then an end
    message), sink → driver (one result per stream). Blocking PUSH/PULL over ipc, msgspec's
    msgpack for the headers."""

    label = "raw pyzmq"

    def __init__(self, elements: int):
        import zmq

        self.dir = tempfile.mkdtemp(prefix="omni-bench-zmqstream-")
        src, sink, back = (f"ipc://{self.dir}/{name}" for name in ("src", "sink", "back"))
        self.ctx = zmq.Context(io_threads=1)
        self.back = self.ctx.socket(zmq.PULL)
        self.back.bind(back)
        ctx = _spawn()
        self.procs = [ctx.Process(target=_zmq_stream_source, args=(src, sink, elements), daemon=True, name="zmq-stream-src"),
                      ctx.Process(target=_zmq_stream_sink, args=(sink, back, elements), daemon=True, name="zmq-stream-sink")]
        _start(self.procs)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(src)
        self._packb, self._unpackb = _codec()
        self._rid = 0
        self.send(1)
        deadline = time.monotonic() + START_TIMEOUT
        while not self.back.poll(100):
            dead = [p.exitcode for p in self.procs if not p.is_alive()]
            if dead or time.monotonic() > deadline:
                self.close()
                why = f"a process exited (exit codes {dead})" if dead else f"not within {START_TIMEOUT:g} s"
                raise RuntimeError(f"raw pyzmq stream did not come up: {why}")
        self.back.recv()

    def pids(self) -> dict[str, int | None]:
        return {"src": self.procs[0].pid, "sink": self.procs[1].pid}

    def send(self, chunks: int) -> None:
        self._rid += 1
        self.push.send(self._packb({"rid": self._rid, "chunks": chunks}))

    def streams(self, chunks: int, concurrency: int, duration: float, deadline: float,
                results: list[dict] | None) -> tuple[int, float]:
        """Keep ``concurrency`` streams of ``chunks`` chunks in flight for ``duration`` seconds,
        then drain; each stream's result is appended to ``results``. Returns (streams completed,
        elapsed seconds). Raises TimeoutError past ``deadline`` (``time.monotonic()``)."""
        t0 = time.perf_counter()
        end = t0 + duration
        for _ in range(concurrency):
            self.send(chunks)
        inflight, done = concurrency, 0
        back, unpackb = self.back, self._unpackb
        while inflight:
            if not back.poll(100):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"raw pyzmq stream: {inflight} streams still in flight at the deadline")
                continue
            got = unpackb(back.recv())
            if results is not None:
                results.append(got)
            done += 1
            inflight -= 1
            if time.perf_counter() < end:
                self.send(chunks)
                inflight += 1
        return done, time.perf_counter() - t0

    def close(self) -> None:
        try:
            if all(p.is_alive() for p in self.procs):
                self.push.send(STOP)
                self.back.poll(5000)
        finally:
            _join(self.procs)
            self.push.close(0)
            self.back.close(0)
            self.ctx.term()
            shutil.rmtree(self.dir, ignore_errors=True)

"""Quick check of the shm relay's throughput against its baseline, in one run.

Moves one tensor (64 MiB by default) from a sender process to a receiver process through the
``shm`` relay, request after request (the receiver gets, checks, releases; handles travel on a zmq
PAIR socket, as in the runtime's control plane), and times single-threaded memcpy of the same size
(torch ``copy_`` into a warm buffer with ``torch.set_num_threads(1)``) in the same run: rounds of
each, back to back, so that a change of load on the machine hits both. Prints the medians and the
median ratio; the target is shm >= 0.7 x memcpy. Results also go to
``bench/results/relay_shm_quick.json``.

    python bench/relay_shm_quick.py [--mib 64] [--requests 20] [--rounds 7] [--read]

``--read`` makes the receiver sum every element it gets (a reader that touches all the data).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import pathlib
import shutil
import statistics
import tempfile
import time
import uuid

import torch
import zmq

from omni_core.relay.base import RelayContext
from omni_core.relay.shm import ShmRelay

WARMUP = 5


def memcpy_gbps(nbytes: int, repeats: int) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    started = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    return nbytes * repeats / (time.perf_counter() - started) / 1e9


def receiver_main(address: str, run_id: str, runtime_dir: str, read: bool) -> None:
    torch.set_num_threads(1)
    relay = ShmRelay(RelayContext(run_id, "receiver", runtime_dir, {}))
    sock = zmq.Context.instance().socket(zmq.PAIR)
    sock.connect(address)
    loop = asyncio.new_event_loop()
    try:
        while (handle := sock.recv()) != b"stop":
            [tensor] = loop.run_until_complete(relay.get(handle))
            # int64 view: summing uint8 would first widen the whole tensor into new memory
            check = int(tensor.view(torch.int64).sum()) if read else int(tensor[0]) + int(tensor[-1])
            relay.release(handle)
            sock.send(check.to_bytes(8, "little", signed=True))
    finally:
        relay.close()
        sock.close(linger=0)
        loop.close()


async def send_round(relay: ShmRelay, sock, tensor: torch.Tensor, requests: int) -> float:
    """Seconds from the first put of ``requests`` to the last acknowledgement; the receiver
    releases as it goes and credits bound how far the sender runs ahead."""
    acked = 0
    started = time.perf_counter()
    for i in range(requests):
        sock.send((await relay.put(i, [tensor], "receiver")).handle)
        while sock.poll(0):  # collect acknowledgements without waiting
            sock.recv()
            acked += 1
    while acked < requests:
        if not sock.poll(30_000):
            raise RuntimeError("the receiver stopped answering (did it crash? see its traceback)")
        sock.recv()
        acked += 1
    return time.perf_counter() - started


async def measure(relay: ShmRelay, sock, nbytes: int, requests: int, rounds: int):
    """Per round: memcpy GB/s and shm GB/s, measured back to back so load changes hit both."""
    tensor = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    await send_round(relay, sock, tensor, WARMUP)  # creates and maps the pool
    pairs = []
    for _ in range(rounds):
        memcpy = memcpy_gbps(nbytes, requests)
        shm = nbytes * requests / await send_round(relay, sock, tensor, requests) / 1e9
        pairs.append((memcpy, shm))
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--requests", type=int, default=20, help="requests per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--read", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    nbytes = args.mib << 20
    run_id, runtime_dir = f"bench{uuid.uuid4().hex[:8]}", tempfile.mkdtemp(prefix="omni-bench-")
    address = f"ipc://{runtime_dir}/bench.sock"
    sock = zmq.Context.instance().socket(zmq.PAIR)
    sock.bind(address)
    proc = multiprocessing.get_context("spawn").Process(
        target=receiver_main, args=(address, run_id, runtime_dir, args.read), daemon=True)
    proc.start()
    relay = ShmRelay(RelayContext(run_id, "sender", runtime_dir, {}))
    try:
        pairs = asyncio.run(measure(relay, sock, nbytes, args.requests, args.rounds))
        sock.send(b"stop")
    finally:
        proc.join(30)
        relay.close()
        sock.close(linger=0)
        shutil.rmtree(runtime_dir, ignore_errors=True)
    memcpy = statistics.median(m for m, _ in pairs)
    shm = statistics.median(s for _, s in pairs)
    ratio = statistics.median(s / m for m, s in pairs)
    result = {
        "bench": "relay_shm_quick", "bytes": nbytes, "requests_per_round": args.requests,
        "rounds": args.rounds, "read": args.read, "memcpy_1thread_gbps": round(memcpy, 2),
        "shm_gbps": round(shm, 2), "ratio": round(ratio, 3),
        "rounds_gbps": [[round(m, 2), round(s, 2)] for m, s in pairs],
        "receiver_exitcode": proc.exitcode,
    }
    print(f"{args.mib} MiB, {args.rounds} rounds x {args.requests} requests, receiver "
          f"{'reads all' if args.read else 'views'}; medians over rounds:")
    print(f"  memcpy (1 thread, warm buffer): {memcpy:6.2f} GB/s")
    print(f"  shm relay, process to process:  {shm:6.2f} GB/s  ({nbytes / shm / 1e6:.2f} ms/request)")
    print(f"  ratio shm / memcpy:             {ratio:6.2f}  (target >= 0.70)")
    out = pathlib.Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / "relay_shm_quick.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

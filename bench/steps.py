"""steps: messages per decode step and runtime CPU per streamed token, at 1, 16 and 64 rows.

``python -m bench --scenario steps`` (the scenario; ``--quick`` for a small size), or
``python -m bench.steps [--rows 1 16 64] [--tokens 32] [--rounds 5] [--compare]`` (the same
measurement, one JSON line per row count), runs
``bench.stages.steps_pipeline``: ``stepper``, a :class:`~omni_core.kits.DecodeLoop` of ``rows``
rows whose step is a trivial loop (so what its process spends is the runtime's), streams every
token with a ``[1, 1, 256]`` bfloat16 hidden state to ``reader`` (another process) and the token
alone to the caller (``stream_to: [reader, caller]``, as Qwen's thinker does). Each round
streams ``rows`` requests of ``tokens`` tokens at once (they join the loop together, so every
step has every row). It reports, per row count, the zmq messages the stepper's process sent per
step to each destination (the reader's process, the caller) and the CPU µs per streamed token of
the stepper's process, the reader's and the caller's (this process), read from their CPU clocks
around the measured rounds. ``--compare`` runs every row count twice, the one-message-per-step
send on and off (the runtime before it), alternating rounds in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from typing import Any

from . import common
from .cpu import _clock_ns

NAME = "steps"
SIZES = {
    "quick": {"rows": [1, 16, 64], "tokens": 8, "rounds": 2, "compare": True},
    "full": {"rows": [1, 16, 64], "tokens": 32, "rounds": 5, "compare": True},
}


async def _one(rows: int, tokens: int, rounds: int, together: bool) -> dict:
    from omni_core import Pipeline

    from .stages import steps_pipeline

    async def request(p) -> None:
        n = 0
        async for event in p.stream({"tokens": tokens}):
            if event.is_result:
                assert event.data["n"] == tokens and not event.data["bad"], event.data
            else:
                assert event.data["tok"] == n
                n += 1
        assert n == tokens

    async with Pipeline(steps_pipeline(rows, together=together)) as p:
        await asyncio.gather(*(request(p) for _ in range(rows)))  # warm-up
        pids = dict(p.pids())
        before = await p.submit({"report": True, "tokens": 0})
        cpu0 = {role: _clock_ns(pid) for role, pid in pids.items()}
        me0, t0 = time.process_time_ns(), time.perf_counter()
        for _ in range(rounds):
            await asyncio.gather(*(request(p) for _ in range(rows)))
        wall, me = time.perf_counter() - t0, time.process_time_ns() - me0
        cpu = {role: _clock_ns(pid) - cpu0[role] for role, pid in pids.items()}
        after = await p.submit({"report": True, "tokens": 0})
    streamed = rows * tokens * rounds
    steps = after["steps"] - before["steps"]
    addresses = {a.rsplit("/", 1)[-1]: a for a in after["sent"]}
    # Less the first report's own end (its result and stream ends: one message to each).
    per_step = {"caller" if name == "coordinator" else "reader":
                round((after["sent"][a] - before["sent"].get(a, 0) - 1) / steps, 2) for name, a in addresses.items()}
    return {
        "rows": rows, "together": together, "steps": steps, "tokens/s": round(streamed / wall),
        "messages per step": per_step,
        "cpu us per token": {"stepper": round(cpu["stepper"] / 1e3 / streamed, 2),
                             "reader": round(cpu["reader"] / 1e3 / streamed, 2),
                             "caller": round(me / 1e3 / streamed, 2)},
    }


def run(params: dict[str, Any], *, quick: bool, ray: bool) -> dict[str, Any]:
    """The scenario: every row count with the one-message-per-step send on (and off, with
    ``compare``), each in a pipeline of its own."""
    doc = common.result(NAME, quick=quick, parameters=params)
    modes = (True, False) if params.get("compare") else (True,)
    for rows in params["rows"]:
        for together in modes:
            common.log(f"steps: {rows} rows, one message per step {'on' if together else 'off'}")
            doc["rows"].append(asyncio.run(_one(rows, params["tokens"], params["rounds"], together)))
    for r in doc["rows"]:
        if r["together"]:
            worst = max(r["messages per step"].values())
            doc["ratios"][str(r["rows"])] = {"messages per step per destination": worst}
            doc["checks"][f"{r['rows']} rows: one message per step per destination"] = worst <= 1.0
    return doc


def summary(doc: dict[str, Any]) -> str:
    headers = ["rows", "one message per step", "messages/step to reader", "to caller", "tokens/s",
               "stepper CPU µs/token", "reader", "caller"]
    rows = [[r["rows"], "on" if r["together"] else "off", r["messages per step"].get("reader"),
             r["messages per step"].get("caller"), r["tokens/s"], r["cpu us per token"]["stepper"],
             r["cpu us per token"]["reader"], r["cpu us per token"]["caller"]] for r in doc["rows"]]
    return "messages per decode step and CPU per streamed token\n" + common.table(headers, rows)


def plot(doc: dict[str, Any], path: str, plt: Any) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for together, style in ((True, "o-"), (False, "s--")):
        pts = [(r["rows"], max(r["messages per step"].values())) for r in doc["rows"] if r["together"] is together]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style,
                    label="one message per step" if together else "before (turn's early sends)")
    ax.set_xlabel("rows per decode step")
    ax.set_ylabel("zmq messages per step per destination")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=1, help="run everything this many times")
    ap.add_argument("--compare", action="store_true", help="also with the one-message-per-step send off")
    args = ap.parse_args()
    modes = (True, False) if args.compare else (True,)
    for _ in range(args.repeat):
        for rows in args.rows:
            for together in modes:
                print(json.dumps(asyncio.run(_one(rows, args.tokens, args.rounds, together))), flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMNI_LOG_LEVEL", "warning")
    main()

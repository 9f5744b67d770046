"""Two versions of omni in one run: the hop and throughput scenarios, old and new alternating.

``python -m bench.versus COMMIT [--pairs 3] [--scenario hop throughput]`` unpacks ``COMMIT``
(``git archive``) into a temporary folder and runs, ``--pairs`` times, each scenario once with
that tree first on ``PYTHONPATH`` (its ``omni_core`` and ``bench``) and once with this checkout's,
each in a fresh process, which goes first alternating from pair to pair: a 4-stage hop (one request in flight, 300 requests × 3 rounds, beside
the raw pyzmq and ``multiprocessing.Queue`` chains) and a 3-stage chain at 64 in flight (1.5 s
× 3 rounds). One JSON line per run: the omni / baseline ratios and omni's CPU µs per message.
On a machine shared with other work, compare the pairs, not runs far apart.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = """
import json, os, sys
from bench import common, hop, throughput
if sys.argv[1] == "hop":
    with common.Loop() as loop:
        rows = hop.measure({"ns": [4], "warmup": 100, "requests": 300, "rounds": 3}, loop)
    m = {r["impl"]: r for r in rows}
    out = {"omni hop us": m["omni"]["hop_us"]["median"], "omni/zmq": m["omni"]["hop_us"]["median"] / m["zmq"]["hop_us"]["median"],
           "omni/mpq": m["omni"]["hop_us"]["median"] / m["mpq"]["hop_us"]["median"],
           "omni cpu us/msg/stage": m["omni"]["cpu"]["stage_us_per_message"], "zmq cpu us/msg/stage": m["zmq"]["cpu"]["stage_us_per_message"]}
else:
    with common.Loop() as loop:
        rows = throughput.measure({"stages": 3, "concurrency": [64], "warmup_s": 0.3, "duration_s": 1.5, "rounds": 3}, loop)
    m = {r["impl"]: r for r in rows}
    out = {"omni req/s": m["omni"]["rps"]["median"], "omni/mpq": m["omni"]["rps"]["median"] / m["mpq"]["rps"]["median"],
           "omni/zmq": m["omni"]["rps"]["median"] / m["zmq"]["rps"]["median"],
           "omni cpu us/msg/stage": m["omni"]["cpu"]["stage_us_per_message"], "mpq cpu us/msg/stage": m["mpq"]["cpu"]["stage_us_per_message"],
           "omni caller us/req": m["omni"]["cpu"]["roles"]["caller"]["us_per_message"]}
print("RESULT " + json.dumps({k: round(v, 3) for k, v in out.items()}))
"""


def _run(tree: Path, scenario: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMNI_LOG_LEVEL": "warning"}
    proc = subprocess.run([sys.executable, "-c", _CHILD, scenario], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=600)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    return {"error": (proc.stderr or proc.stdout)[-400:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("commit", help="the other version: a commit of this repository")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--scenario", nargs="+", default=["hop", "throughput"], choices=["hop", "throughput"])
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="omni-versus-") as tmp:
        old = Path(tmp)
        archive = subprocess.run(["git", "archive", args.commit], cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
        for i in range(args.pairs):
            for scenario in args.scenario:
                order = ((args.commit, old), ("this checkout", ROOT))
                for label, tree in order if i % 2 == 0 else order[::-1]:  # ABBA: neither always goes first
                    print(json.dumps({"pair": i + 1, "scenario": scenario, "version": label, **_run(tree, scenario)}),
                          flush=True)


if __name__ == "__main__":
    main()

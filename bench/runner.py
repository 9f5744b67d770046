"""The ``python -m bench`` driver: pick scenarios and sizes, run them, write JSON, tables, plots."""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from . import common

SCENARIOS = ("hop", "throughput", "stream", "steps", "relay", "startup", "scale", "serve", "ray")
#: Scenarios whose module is not named after them (``bench.ray`` would read as the ray package).
MODULES = {"ray": "ray_launcher"}


def scenario_module(name: str) -> Any:
    if name not in SCENARIOS:
        raise SystemExit(f"unknown scenario {name!r}; known: {', '.join(SCENARIOS)}")
    return importlib.import_module(f"bench.{MODULES.get(name, name)}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="omni benchmarks, each side by side with its baselines; JSON results and ratios.",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes: every scenario in under a minute")
    parser.add_argument("--scenario", action="append", choices=SCENARIOS, metavar="NAME",
                        help=f"run only this scenario (repeatable): {', '.join(SCENARIOS)}")
    parser.add_argument("--out", type=Path, default=common.RESULTS, help="directory for the JSON results (default: bench/results)")
    parser.add_argument("--plots", type=Path, default=None,
                        help="directory for one PNG per scenario (default: the --out directory; docs use docs/img)")
    parser.add_argument("--no-plots", action="store_true", help="do not draw plots")
    ray = parser.add_mutually_exclusive_group()
    ray.add_argument("--ray", dest="ray", action="store_true", default=None,
                     help="run the Ray Compiled Graph peer (default: on for full runs when ray is installed)")
    ray.add_argument("--no-ray", dest="ray", action="store_false", help="never run the Ray peer")
    parser.add_argument("--replot", action="store_true", help="redraw plots and tables from the JSON in --out; measure nothing")
    parser.add_argument("--doc", type=Path, default=None,
                        help="rewrite the <!-- bench:NAME --> blocks of this page, or of every page in this folder (docs/performance), with the tables of the scenarios run or replotted")
    return parser.parse_args(argv)


def run_scenario(name: str, *, quick: bool, out: Path, plots: Path | None, ray: bool,
                 params: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run one scenario, write its JSON (and plot), print its table; returns the result."""
    module = scenario_module(name)
    params = dict(params if params is not None else module.SIZES["quick" if quick else "full"])
    import os

    mine = f"omni-{os.getpid()}-"  # segments of the pipelines this process runs
    before_shm = common.shm_entries(mine)
    t0 = time.perf_counter()
    doc = module.run(params, quick=quick, ray=ray)
    doc["wall_s"] = time.perf_counter() - t0
    leaked = sorted(common.shm_entries(mine) - before_shm)
    if leaked:
        doc["notes"].append(f"/dev/shm entries left after the run: {leaked}")
    doc = common.clean_nans(doc)
    path = common.write_result(doc, out)
    if plots is not None:
        draw(module, doc, plots)
    print(f"\n## {name}{' (quick)' if quick else ''}: {path}")
    print(module.summary(doc))
    for note in doc["notes"]:
        print(f"note: {note}")
    failed = [k for k, ok in doc["checks"].items() if not ok]
    print(f"checks: {len(doc['checks']) - len(failed)}/{len(doc['checks'])} met" + "".join(f"\n  not met: {k}" for k in failed))
    sys.stdout.flush()
    return doc


def draw(module: Any, doc: dict[str, Any], plots: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        common.log("matplotlib is not installed: no plot (pip install -e '.[bench]')")
        return None
    plots.mkdir(parents=True, exist_ok=True)
    path = plots / f"bench-{doc['scenario']}{'-quick' if doc['quick'] else ''}.png"
    module.plot(doc, str(path), plt)
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = args.scenario or list(SCENARIOS)
    plots = None if args.no_plots else (args.plots or args.out)
    done: dict[str, dict[str, Any]] = {}
    if args.replot:
        for name in names:
            module = scenario_module(name)
            path = args.out / f"{name}{'-quick' if args.quick else ''}.json"
            if not path.exists():
                common.log(f"{path} does not exist: run the scenario first")
                continue
            doc = done[name] = json.loads(path.read_text())
            if plots is not None:
                draw(module, doc, plots)
            print(f"\n## {name}: {path}\n{module.summary(doc)}")
        _write_doc(args.doc, done)
        return 0
    ray = args.ray if args.ray is not None else not args.quick
    failed = []
    for name in names:
        try:
            done[name] = run_scenario(name, quick=args.quick, out=args.out, plots=plots, ray=ray)
        except KeyboardInterrupt:
            raise
        except Exception as exc:
            import traceback

            traceback.print_exc()
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
    _write_doc(args.doc, done)
    for line in failed:
        print(f"scenario failed: {line}", file=sys.stderr)
    return 1 if failed else 0


def _write_doc(path: Path | None, docs: dict[str, dict[str, Any]]) -> None:
    if path is None or not docs:
        return
    from . import report

    report.update(path, docs, {name: scenario_module(name) for name in docs})
    common.log(f"{path}: tables of {', '.join(docs)} rewritten")

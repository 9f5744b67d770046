"""Smoke test of the benchmark harness (bench/): every scenario runs at a tiny size and writes a
result file of the documented shape. Nothing here asserts on speed: numbers are checked for
presence and sanity only (speed is reported by ``python -m bench``, never tested)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from runtime_helpers import no_leaks  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # bench/ is not part of the installed distribution

from bench import common, runner  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20

TINY = {
    "hop": {"ns": [1, 2], "warmup": 3, "requests": 5, "rounds": 2},
    "throughput": {"stages": 2, "concurrency": [1, 4], "warmup_s": 0.05, "duration_s": 0.1, "rounds": 1},
    "relay": {"sizes": [4 * KiB, 16 * MiB], "target_s": 0.01, "min_reps": 2, "max_reps": 4, "rounds": 2},
    "startup": {"processes": [1], "rounds": 1, "cold": False},
    "scale": {"points": [[1, 4 * KiB], [70, 1 * MiB]], "duration_s": 0.1, "warmup_s": 0.05, "settle_s": 0.05},
}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_stats(stats: dict) -> None:
    assert set(stats) >= {"n", "median", "p50", "p99", "mean", "min", "max"}
    assert stats["n"] > 0
    assert stats["min"] <= stats["median"] <= stats["p99"] <= stats["max"]
    assert stats["median"] == stats["p50"]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, tuple[dict, Path]]:
    out = tmp_path_factory.mktemp("bench")
    docs = {}
    for name, params in TINY.items():
        doc = runner.run_scenario(name, quick=True, out=out, plots=None, ray=False, params=params)
        docs[name] = (doc, out / f"{name}-quick.json")
    return docs


def test_every_scenario_writes_its_result_file(results, capsys):
    for name, (_, path) in results.items():
        assert path.exists(), name
        stored = json.loads(path.read_text())
        assert stored["scenario"] == name and stored["quick"] is True
        assert stored["schema"] == common.SCHEMA
        assert stored["parameters"]["rounds" if "rounds" in TINY[name] else "points"] is not None
        machine = stored["machine"]
        assert machine["cpus"] >= 1 and machine["python"] and machine["versions"]["torch"]
        assert stored["rows"], f"{name}: no rows"
        assert isinstance(stored["ratios"], dict) and stored["ratios"], name
        assert all(isinstance(ok, bool) for ok in stored["checks"].values()), name
        assert isinstance(stored["notes"], list)
        assert stored["wall_s"] > 0
        assert not [n for n in stored["notes"] if "/dev/shm" in n], stored["notes"]


def test_hop_measures_omni_and_both_baselines(results):
    doc, _ = results["hop"]
    impls = {(r["n"], r["impl"]) for r in doc["rows"]}
    assert impls == {(n, impl) for n in (1, 2) for impl in ("omni", "zmq", "mpq")}
    for r in doc["rows"]:
        _check_stats(r["rtt_us"])
        _check_stats(r["hop_us"])
        assert r["rtt_us"]["n"] == 2 * 5
        assert math.isclose(r["hop_us"]["median"] * (r["n"] + 1), r["rtt_us"]["median"], rel_tol=1e-9)
    assert set(doc["ratios"]["2"]) >= {"omni/zmq median", "omni/zmq p99", "omni/mpq median"}
    assert "Ray peer not run" in " ".join(doc["notes"])


def test_throughput_rates_and_ratios(results):
    doc, _ = results["throughput"]
    for r in doc["rows"]:
        _check_stats(r["rps"])
        assert r["rps"]["median"] > 0
    assert {r["impl"] for r in doc["rows"]} == {"omni", "zmq", "mpq"}
    for c in ("1", "4"):
        assert _number(doc["ratios"][c]["omni/zmq"]) and _number(doc["ratios"][c]["omni/mpq"])


def test_relay_covers_every_installed_relay_against_memcpy(results):
    doc, _ = results["relay"]
    labels = {r["relay"] for r in doc["rows"]}
    assert {"inline", "shm"} <= labels
    assert any(label.startswith("shm (") for label in labels)  # the big-pool variant
    for r in doc["rows"]:
        _check_stats(r["request_us"])
        _check_stats(r["memcpy_us"])
        assert _number(r["gbps"]) and _number(r["memcpy_gbps"])
        assert math.isclose(r["ratio"], r["gbps"] / r["memcpy_gbps"], rel_tol=1e-9)
    assert any(key.startswith("shm 16 MiB") for key in doc["checks"])


def test_startup_against_bare_processes(results):
    doc, _ = results["startup"]
    assert {r["impl"] for r in doc["rows"]} == {"warm", "bare"}
    for r in doc["rows"]:
        _check_stats(r["ready_s"])
    assert _number(doc["ratios"]["1"]["omni warm/bare"])


def test_scale_reports_latency_and_memory(results):
    doc, _ = results["scale"]
    assert [(r["inflight"], r["bytes"]) for r in doc["rows"]] == [tuple(p) for p in TINY["scale"]["points"]]
    for r in doc["rows"]:
        _check_stats(r["latency_ms"])
        assert r["peak"]["rss"] > 0 and r["peak"]["pss"] > 0 and r["idle"]["processes"] >= 3
        assert r["unbounded_bytes"] == r["inflight"] * r["bytes"]
    assert "retained_pss" in doc["memory"]
    assert len(doc["checks"]) == 1  # the 70 x 1 MiB point is past max_concurrency


def test_summary_tables_render(results):
    for name, (doc, _) in results.items():
        text = runner.scenario_module(name).summary(doc)
        assert text.count("\n") >= 3 and "|" in text, name


def test_nothing_left_behind(results, no_leaks):  # noqa: F811
    """The module's runs are over; the no_leaks fixture checks processes, dirs and /dev/shm."""


def test_cli_rejects_an_unknown_scenario():
    with pytest.raises(SystemExit):
        runner.parse_args(["--scenario", "nope"])

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

from bench import common, cpu, runner  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20

TINY = {
    "hop": {"ns": [1, 2], "warmup": 3, "requests": 5, "rounds": 2},
    "throughput": {"stages": 2, "concurrency": [1, 4], "warmup_s": 0.05, "duration_s": 0.1, "rounds": 1},
    # 4 x 4 chunks: within what today's shm relay holds at once (32 slots), so omni completes
    "stream": {"relays": ["auto"], "concurrency": [1, 4], "chunks": 4, "warmup_s": 0.05, "duration_s": 0.2,
               "rounds": 1, "deadline_s": 30.0},
    "steps": {"rows": [1, 4], "tokens": 3, "rounds": 1, "compare": True},
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
    assert set(doc["ratios"]["2"]) >= {"omni/zmq median", "omni/zmq p99", "omni/mpq median",
                                       "omni/zmq cpu per message per stage"}
    assert "Ray peer not run" in " ".join(doc["notes"])
    for r in doc["rows"]:
        _check_cpu(r["cpu"], {"caller", *(f"s{i}" for i in range(r["n"]))}, messages=2 * 5, stages=r["n"])


def test_throughput_rates_and_ratios(results):
    doc, _ = results["throughput"]
    for r in doc["rows"]:
        _check_stats(r["rps"])
        assert r["rps"]["median"] > 0
    assert {r["impl"] for r in doc["rows"]} == {"omni", "zmq", "mpq"}
    for c in ("1", "4"):
        assert _number(doc["ratios"][c]["omni/zmq"]) and _number(doc["ratios"][c]["omni/mpq"])
        assert _number(doc["ratios"][c]["omni/zmq cpu per message per stage"])
    for r in doc["rows"]:
        _check_cpu(r["cpu"], None, messages=None, stages=2)


def test_stream_measures_omni_and_the_raw_stream_with_cpu_per_chunk(results):
    doc, _ = results["stream"]
    params = TINY["stream"]
    assert doc["parameters"]["hidden"] == [1, 1, 2048] and doc["parameters"]["chunk_bytes"] == 4096
    keys = {(r["relay"], r["concurrency"], r["impl"]) for r in doc["rows"]}
    assert keys == {("auto", c, impl) for c in params["concurrency"] for impl in ("omni", "zmq")}
    for r in doc["rows"]:
        assert r["status"] in ("ok", "timeout", "error")
        assert r["chunks_per_stream"] == params["chunks"]
        assert isinstance(r["bad_chunks"], int) and isinstance(r["short_streams"], int)
        if r["impl"] == "zmq":  # the baseline never fails
            assert r["status"] == "ok" and r["bad_chunks"] == 0 and r["short_streams"] == 0, r
    for r in doc["rows"]:
        if r["status"] != "ok":
            assert r["error"], r
            continue
        assert r["streams"] >= r["concurrency"] and r["chunks_sent"] == r["streams"] * params["chunks"]
        assert 0 < r["chunks"] <= r["chunks_sent"]
        _check_stats(r["chunks_per_s"])
        _check_stats(r["latency_us"])
        assert r["latency_us"]["n"] == r["chunks"] and r["latency_us"]["min"] > 0
        roles = {"caller", "src", "sink"} | ({"head"} if r["impl"] == "omni" else set())
        _check_cpu(r["cpu"], roles, messages=None, stages=2)
        assert r["cpu"]["roles"]["src"]["messages"] == r["chunks_sent"]
        assert r["cpu"]["roles"]["sink"]["messages"] == r["chunks"]
        assert r["cpu"]["roles"]["caller"]["messages"] == r["streams"]
        assert math.isclose(r["cpu_us_per_chunk"], r["cpu"]["total_cpu_s"] / r["chunks"] * 1e6, rel_tol=1e-9)
    # Today's runtime completes this small load (4 x 4 chunks fit the shm pool).
    assert all(r["status"] == "ok" for r in doc["rows"]), [r["error"] for r in doc["rows"]]
    for c in params["concurrency"]:
        ratios = doc["ratios"][f"auto {c}"]
        assert _number(ratios["omni/zmq chunks/s"]) and _number(ratios["omni/zmq cpu per chunk sink"])
        assert f"relay auto, {c} streams: omni chunks complete, in order and intact" in doc["checks"]


def _check_cpu(report: dict, roles: set[str] | None, *, messages: int | None, stages: int) -> None:
    """A CpuAccount report: every role with its pid, CPU split and messages."""
    assert report and report["windows"] >= 1 and report["wall_s"] > 0
    if roles is not None:
        assert set(report["roles"]) == roles
    assert "caller" in report["roles"] and len(report["stage_roles"]) == stages
    for role, entry in report["roles"].items():
        assert entry["pid"] > 0 and entry["missing_windows"] == 0, role
        assert entry["cpu_s"] > 0 and entry["user_s"] >= 0 and entry["sys_s"] >= 0, role
        assert entry["messages"] > 0 and (messages is None or entry["messages"] == messages), role
        assert math.isclose(entry["us_per_message"], entry["cpu_s"] / entry["messages"] * 1e6, rel_tol=1e-9)
    per_stage = [report["roles"][r]["us_per_message"] for r in report["stage_roles"]]
    assert math.isclose(report["stage_us_per_message"], sum(per_stage) / len(per_stage), rel_tol=1e-9)
    assert _number(report["cores"]) and report["cores"] > 0


def test_steps_counts_messages_per_step_with_the_send_on_and_off(results):
    doc, _ = results["steps"]
    assert {(r["rows"], r["together"]) for r in doc["rows"]} == {(n, on) for n in (1, 4) for on in (True, False)}
    for r in doc["rows"]:
        assert r["steps"] >= 3 and set(r["messages per step"]) == {"reader", "caller"}
        assert all(_number(v) and v > 0 for v in r["cpu us per token"].values()), r
        if r["together"]:
            assert r["messages per step"] == {"reader": 1.0, "caller": 1.0}, r  # a count, not a time
    assert doc["checks"] == {"1 rows: one message per step per destination": True,
                             "4 rows: one message per step per destination": True}


def test_cpu_window_reads_what_the_process_spent():
    """The CPU clock read from outside agrees with the process's own account of its CPU time."""
    import os
    import time

    with cpu.CpuWindow({"caller": os.getpid()}) as window:
        t0 = time.process_time()
        while time.process_time() - t0 < 0.05:
            pass
        spent = time.process_time() - t0
    got = window.cpu["caller"]
    assert got["source"] == "clock"
    assert abs(got["cpu_s"] - spent) < 0.005, (got, spent)
    assert got["user_s"] + got["sys_s"] >= 0
    account = cpu.CpuAccount()
    account.add(window, 10)
    report = account.report()
    assert math.isclose(report["roles"]["caller"]["us_per_message"], got["cpu_s"] / 10 * 1e6)
    assert report["stage_us_per_message"] is None  # no stage roles


def test_cpu_window_tolerates_a_process_that_is_gone():
    with cpu.CpuWindow({"gone": 2**22 + 12345}) as window:  # above the default pid_max
        pass
    assert window.cpu["gone"] is None
    account = cpu.CpuAccount()
    account.add(window, 1)
    assert account.report()["roles"]["gone"]["missing_windows"] == 1


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


def test_doc_blocks_are_rewritten_and_the_prose_kept(results, tmp_path):
    from bench import report

    page = tmp_path / "performance.md"
    page.write_text("# title\n\nprose before\n\n<!-- bench:stream -->\nold table\n<!-- /bench:stream -->\n\nprose after\n")
    docs = {name: results[name][0] for name in ("stream", "hop")}
    missing = report.update(page, docs, {name: runner.scenario_module(name) for name in docs})
    assert missing == ["hop"]  # the page has no hop block: left alone, reported
    text = page.read_text()
    assert text.startswith("# title\n\nprose before\n\n<!-- bench:stream -->\n_Measured by a `--quick` run")
    assert text.endswith("<!-- /bench:stream -->\n\nprose after\n")
    assert "old table" not in text and "| relay " in text and "Checks met:" in text
    assert "\n\n\n" not in text


def test_doc_blocks_are_rewritten_on_whichever_page_of_a_folder_holds_them(results, tmp_path):
    from bench import report

    (tmp_path / "chains.md").write_text("# chains\n\n<!-- bench:stream -->\nold\n<!-- /bench:stream -->\n")
    (tmp_path / "notes.md").write_text("# notes, no block\n")
    docs = {name: results[name][0] for name in ("stream", "hop")}
    missing = report.update(tmp_path, docs, {name: runner.scenario_module(name) for name in docs})
    assert missing == ["hop"]
    assert "old" not in (tmp_path / "chains.md").read_text()
    assert (tmp_path / "notes.md").read_text() == "# notes, no block\n"

"""`omni run`: one request, streamed chunks, a JSON-lines batch with a summary, and errors."""

from __future__ import annotations

import json

import pytest
import yaml
from runtime_helpers import no_leaks, pipeline, stage  # noqa: F401
from typer.testing import CliRunner

from omni_core.cli import app

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_leaks")]


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "p.yaml"
    cfg = pipeline(stage("up", "Upper", next="tok"), stage("tok", "Tokens", terminal=True), name="cli")
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def omni(*args):
    return CliRunner().invoke(app, list(args))


def test_run_prints_the_result_as_json(config):
    result = omni("run", config, "--input", '{"text": "hi"}')
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == {"text": "HI"}


def test_run_stream_prints_chunks_then_the_result(config):
    result = omni("run", config, "--input", '{"text": "ab"}', "--stream")
    assert result.exit_code == 0, result.output
    assert [json.loads(line) for line in result.stdout.splitlines()] == [
        {"stage": "tok", "chunk": {"token": "A"}},
        {"stage": "tok", "chunk": {"token": "B"}},
        {"result": {"text": "AB"}},
    ]


def test_run_many_writes_results_and_a_summary(config, tmp_path):
    requests = tmp_path / "in.jsonl"
    requests.write_text('{"text": "a"}\n{"text": "b"}\n\n{"oops": 1}\n')
    out = tmp_path / "out.jsonl"
    result = omni("run", config, "--inputs", str(requests), "--output", str(out), "-c", "2")
    assert result.exit_code == 1  # one request failed
    records = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["line"])
    assert records[0] == {"line": 1, "result": {"text": "A"}}
    assert records[1] == {"line": 2, "result": {"text": "B"}}
    assert records[2]["line"] == 4 and "KeyError" in records[2]["error"] and "'up'" in records[2]["error"]
    assert "3 requests, 1 failed" in result.stderr and "p50" in result.stderr and "p99" in result.stderr


def test_run_reports_a_failing_request_and_exits_1(config):
    result = omni("run", config, "--input", '{"nope": 1}')
    assert result.exit_code == 1
    assert "failed in stage 'up'" in result.stderr


def test_run_rejects_bad_json_and_missing_inputs(config):
    assert omni("run", config, "--input", "{not json").exit_code == 2
    missing = omni("run", config)
    assert missing.exit_code == 2 and "exactly one of --input" in missing.stderr


def test_run_of_an_invalid_config_lists_its_errors(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: bad\nstages:\n  - name: a\n    factory: omni_test_stages:Echo\n")
    result = omni("run", str(path), "--input", "{}")
    assert result.exit_code == 1
    assert "stages[0]" in result.stderr and "neither 'next' nor 'terminal: true'" in result.stderr

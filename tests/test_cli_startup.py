"""Start-up as a user meets it: a failed start names the stage that failed by its config path
(``stages[i]``, ``.factory``, ``.args``) and fails fast, the pipeline's life is told by log
events at ``info``, and ``omni run`` summarises tensors by their dtype and shape.

The CLI tests run the real ``omni`` console script; the Python API cases run in a subprocess of
their own (a fresh forkserver that sees the test's modules)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from runtime_helpers import no_leaks  # noqa: F401

from omni_core.errors import StartupError

OMNI = str(Path(sys.executable).parent / "omni")

pytestmark = pytest.mark.timeout(240)

STAGES = '''
import sys

import torch


class Produce:
    def __init__(self, prefix: str = ""):
        self.prefix = prefix

    async def __call__(self, payload, ctx):
        return {"text": self.prefix + payload["text"]}


class Ones:
    async def __call__(self, payload, ctx):
        return {"x": torch.ones(2, 3), "text": payload["text"]}


class NeedsModel:
    def __init__(self, model_path: str = "m.bin"):
        load(model_path)


class Required:
    def __init__(self, model_path):
        self.model_path = model_path


class Blocks:
    def __init__(self):
        import threading

        threading.Event().wait()  # a model that takes forever to load


def load(path):
    raise RuntimeError("model file is corrupt: " + path)
'''

# Importable where omni plans and validates, not in a stage process (a native library missing
# on the machine that runs the stages, say).
CHILD_ONLY = '''
import multiprocessing

if multiprocessing.parent_process() is not None:
    raise ImportError("libfoo.so.1: cannot open shared object file")


class Thing:
    async def __call__(self, payload, ctx):
        return payload
'''

API_SCRIPT = '''
import asyncio, json, sys

from omni_core import Pipeline, StartupError


async def main():
    out = []
    for cfg in json.loads(sys.argv[1]):
        try:
            async with Pipeline(cfg):
                out.append("started")
        except StartupError as exc:
            out.append([{"stage": f.stage, "path": f.path, "process": f.process, "message": f.message}
                        for f in exc.failures])
    print(json.dumps(out))


asyncio.run(main())
'''


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMNI_", "PYTEST_", "PYTHONPATH"))}
    env.update(extra)
    return env


def write(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(textwrap.dedent(text).lstrip())
    return path


def omni(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([OMNI, *args], cwd=cwd, env=environment(**env), capture_output=True, text=True, timeout=200)


def events(stderr: str) -> list[dict]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


@pytest.fixture
def work(tmp_path) -> Path:
    write(tmp_path, "tstages.py", STAGES)
    write(tmp_path, "childonly.py", CHILD_ONLY)
    return tmp_path


@pytest.mark.usefixtures("no_leaks")
def test_the_python_api_names_the_stage_that_failed_by_its_config_path(work):
    def cfg(*stages):
        return {"name": "p", "stages": list(stages)}

    cases = [
        # the factory raised: the stage itself
        cfg({"name": "a", "factory": "tstages:Produce", "next": "b"},
            {"name": "b", "factory": "tstages:NeedsModel", "terminal": True}),
        # two stages in one process: only the one that failed is named
        cfg({"name": "a", "factory": "tstages:Produce", "next": "b", "process": "both"},
            {"name": "b", "factory": "tstages:NeedsModel", "terminal": True, "process": "both"}),
        # the factory could not be imported where the stage runs
        cfg({"name": "a", "factory": "childonly:Thing", "terminal": True}),
        # its arguments do not fit the factory's signature
        cfg({"name": "a", "factory": "tstages:Produce", "next": "b"},
            {"name": "b", "factory": "tstages:Required", "terminal": True}),
    ]
    script = write(work, "api.py", API_SCRIPT)
    result = subprocess.run([sys.executable, str(script), json.dumps(cases)], cwd=work, env=environment(),
                            capture_output=True, text=True, timeout=220)
    assert result.returncode == 0, result.stderr
    raised, shared, unimportable, arguments = json.loads(result.stdout)
    assert [(f["stage"], f["path"], f["process"]) for f in raised] == [("b", "stages[1]", "b")]
    assert raised[0]["message"].startswith("stages[1]: stage 'b' failed to start (process 'b'): RuntimeError: model")
    assert [(f["stage"], f["path"], f["process"]) for f in shared] == [("b", "stages[1]", "both")]
    assert [(f["stage"], f["path"]) for f in unimportable] == [("a", "stages[0].factory")]
    assert "libfoo.so.1" in unimportable[0]["message"]
    assert [(f["stage"], f["path"]) for f in arguments] == [("b", "stages[1].args")]
    assert "model_path" in arguments[0]["message"]


@pytest.mark.usefixtures("no_leaks")
def test_a_failed_start_is_one_message_at_the_stage_path_and_fails_fast(work):
    config = write(work, "f.yaml", """
        name: f
        limits: {stop_timeout: 600}
        stages:
          - {name: a, factory: "tstages:Produce", next: b}
          - {name: b, factory: "childonly:Thing", next: c}
          - {name: c, factory: "tstages:Blocks", terminal: true}
    """)
    result = omni("--log-level", "info", "run", str(config), "--input", '{"text": "x"}', cwd=work)
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: stages[1].factory: stage 'b' (factory 'childonly:Thing') failed to start: "
                      "cannot import module 'childonly' of 'childonly:Thing': libfoo.so.1: cannot open shared object file"]
    assert 'childonly.py", line' in result.stderr and "omni_core" not in result.stderr.split(errors[0])[1]
    log = events(result.stderr)
    names = [e["event"] for e in log]
    assert "process failed to start" in names and "pipeline ready" not in names
    stopping = next(e for e in log if e["event"] == "pipeline stopping")
    assert stopping["reason"].startswith("start failed: stages[1].factory: stage 'b'")
    # Fail fast: 'c' is still building its stage (it never finishes) and 'a' is ready. Neither
    # is waited for: 'c' is ended at once, 'a' shut down. Waiting for 'c' to say goodbye, as a
    # running pipeline's stop does, would take half of limits.stop_timeout (300 s), far past
    # this test's timeout.
    assert names.index("pipeline stopped") == names.index("pipeline stopping") + 1


@pytest.mark.usefixtures("no_leaks")
def test_the_life_of_a_pipeline_is_logged_at_info_as_json_lines(work):
    config = write(work, "ok.yaml", """
        name: life
        stages:
          - {name: a, factory: "tstages:Produce", next: b}
          - {name: b, factory: "tstages:Ones", terminal: true}
    """)
    result = omni("--log-level", "info", "run", str(config), "--input", '{"text": "x"}', "--stream", cwd=work)
    assert result.returncode == 0, result.stderr
    log = [e for e in events(result.stderr) if e.get("pipeline") == "life"]
    assert all(e["level"] == "info" for e in log if e["event"].startswith("pipeline"))
    lifecycle = [e["event"] for e in log if e["event"].startswith("pipeline ") or e["event"].startswith("process ")]
    assert lifecycle[0] == "pipeline starting"
    assert lifecycle.count("process started") == 2 and lifecycle.count("process ready") == 2
    assert lifecycle[-3:] == ["pipeline ready", "pipeline stopping", "pipeline stopped"]
    by_name = {e["event"]: e for e in log}
    assert by_name["pipeline starting"]["processes"] == 2
    assert by_name["pipeline ready"]["processes"] == 2 and by_name["pipeline ready"]["start_time_s"] > 0
    assert by_name["pipeline stopping"]["reason"] == "stop requested"
    assert "stop_time_s" in by_name["pipeline stopped"]
    # Tensors in results (and chunks) are summarised by their dtype and shape (--tensor-data: whole).
    assert json.loads(result.stdout.splitlines()[-1]) == {
        "result": {"x": {"tensor": {"dtype": "float32", "shape": [2, 3]}}, "text": "x"}
    }


def test_several_failures_are_each_listed():
    from omni_core.cli.report import describe_startup_failure

    first = StartupError("stages[0]: stage 'a' failed to start (process 'a'): RuntimeError: no model", process="a",
                         stage="a", path="stages[0]", detail="RuntimeError: no model",
                         traceback='Traceback (most recent call last):\n  File "/x/s.py", line 3, in f\n'
                                   '    raise RuntimeError("no model")\nRuntimeError: no model\n')
    second = StartupError("process 'b' (stages: b) died during startup (SIGKILL)", process="b")
    both = StartupError.several([first, second])
    assert both.failures == [first, second] and both.process == "a"
    assert StartupError.several([first]) is first
    text = describe_startup_failure(both)
    assert text.splitlines()[:2] == [
        "error: 2 processes failed to start:",
        "  - stages[0]: stage 'a' failed to start: RuntimeError: no model",
    ]
    assert '        File "/x/s.py", line 3, in f' in text
    assert "  - process 'b' (stages: b) died during startup (SIGKILL)" in text.splitlines()

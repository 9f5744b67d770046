"""The ``omni`` console script as a newcomer meets it: code beside the config, batch runs within
``limits.max_in_flight``, errors without tracebacks, ``omni validate`` catching what ``omni run``
would reject, placement checks, logging, and the odds and ends of the build.

Every test runs the real console script in a subprocess, from a directory that holds nothing
but what the test wrote (so nothing is importable by accident).
"""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from runtime_helpers import no_leaks  # noqa: F401

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
OMNI = str(Path(sys.executable).parent / "omni")

pytestmark = pytest.mark.timeout(180)

STAGES = '''
import asyncio

from omni_core.logs import get_logger


class Produce:
    def __init__(self, prefix: str = ""):
        get_logger().info("stage built", prefix=prefix)
        self.prefix = prefix

    async def __call__(self, payload, ctx):
        if payload.get("fail"):
            raise ValueError("asked to fail")
        if payload.get("hang"):
            await asyncio.Event().wait()
        return {"text": self.prefix + payload["text"]}


class NeedsModel:
    def __init__(self, model_path: str = "m.bin"):
        load(model_path)


def load(path):
    raise RuntimeError("model file is corrupt: " + path)


def broken_strategy(request):
    return 1 / 0
'''


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMNI_", "PYTEST_", "PYTHONPATH"))}
    env.update(extra)
    return env


def omni(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([OMNI, *args], cwd=cwd, env=environment(**env), capture_output=True, text=True, timeout=170)


def write(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(textwrap.dedent(text).lstrip())
    return path


@pytest.fixture
def work(tmp_path) -> Path:
    """``work/cfg/`` holds configs and ``tstages.py``; tests run from ``work/run/``."""
    write(tmp_path / "cfg", "tstages.py", STAGES)
    (tmp_path / "run").mkdir()
    return tmp_path


def no_traceback(result: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in result.stderr, result.stderr
    assert "omni_core" not in result.stderr, result.stderr


# -- 1. code beside the config and in the working directory ---------------------------------------


@pytest.mark.usefixtures("no_leaks")
def test_run_imports_stages_beside_the_config_and_from_the_cwd_in_every_process(work):
    write(work / "run", "cwdstages.py", "from tstages import Produce as Local\n")
    config = write(work / "cfg", "pipe.yaml", """
        name: beside
        stages:
          - {name: a, factory: "tstages:Produce", args: {prefix: ">"}, next: b}
          - {name: b, factory: "cwdstages:Local", args: {prefix: "+"}, terminal: true}
    """)
    result = omni("--log-level", "info", "run", str(config), "--input", '{"text": "hi"}', cwd=work / "run")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"text": "+>hi"}
    # --log-level reaches the stage processes: both built their stage and said so (JSON lines:
    # stderr is not a terminal).
    built = [json.loads(line) for line in result.stderr.splitlines() if '"stage built"' in line]
    assert sorted(e["prefix"] for e in built) == ["+", ">"]
    assert all(e["level"] == "info" for e in built)


def test_validate_imports_from_the_config_folder(work):
    config = write(work / "cfg", "pipe.yaml", """
        name: beside
        stages:
          - {name: a, factory: "tstages:Produce", terminal: true}
    """)
    result = omni("validate", str(config), cwd=work / "run")
    assert result.returncode == 0, result.stderr
    assert "valid pipeline 'beside'" in result.stdout


# -- 2. batches ------------------------------------------------------------------------------------


@pytest.mark.usefixtures("no_leaks")
def test_inputs_stay_within_max_in_flight_and_are_numbered_by_line(work):
    config = write(work / "cfg", "m.yaml", """
        name: limited
        limits: {max_in_flight: 2}
        stages:
          - {name: a, factory: "tstages:Produce", terminal: true}
    """)
    lines = [json.dumps({"text": str(i)}) for i in range(20)]
    lines.insert(3, "")  # a blank line keeps its number
    lines.append(json.dumps({"fail": True, "text": "x"}))
    requests = write(work / "run", "in.jsonl", "\n".join(lines) + "\n")
    result = omni("run", str(config), "--inputs", str(requests), cwd=work / "run")
    assert result.returncode == 1, result.stderr  # the one failing request
    records = {r["line"]: r for r in map(json.loads, result.stdout.splitlines())}
    assert sorted(records) == [n for n in range(1, 23) if n != 4]
    assert records[5] == {"line": 5, "result": {"text": "3"}}
    assert records[22]["error"].startswith("StageError: request 'line-22' failed in stage 'a': ValueError: asked to fail")
    assert not [r for r in records.values() if "Overloaded" in r.get("error", "")]
    assert "21 requests, 1 failed, latency p50" in result.stderr
    assert "over 20 succeeded" in result.stderr


def test_a_summary_without_successes_reports_no_latency():
    from omni_core.cli.run import Batch

    batch = Batch(2)
    batch.done = batch.failures = 2
    assert batch.summary() == "2 requests, 2 failed, no latency: no request succeeded"


def test_overloaded_is_retried_with_back_off():
    import asyncio

    from omni_core.cli.run import submit_retrying
    from omni_core.errors import Overloaded

    class Full:
        calls = 0

        async def submit(self, inputs, *, request_id):
            self.calls += 1
            if self.calls < 3:
                raise Overloaded("full", request_id=request_id)
            return inputs

    pipeline = Full()
    assert asyncio.run(submit_retrying(pipeline, {"x": 1}, "line-1")) == {"x": 1}
    assert pipeline.calls == 3


@pytest.mark.usefixtures("no_leaks")
def test_ctrl_c_prints_the_summary_of_what_finished_and_exits_130(work):
    config = write(work / "cfg", "c.yaml", """
        name: interrupted
        stages:
          - {name: a, factory: "tstages:Produce", terminal: true}
    """)
    requests = write(work / "run", "in.jsonl", '{"text": "a"}\n{"hang": true, "text": "b"}\n')
    master, slave = pty.openpty()  # stderr is a terminal: the start-up progress line shows
    proc = subprocess.Popen([OMNI, "run", str(config), "--inputs", str(requests)], cwd=work / "run",
                            env=environment(), stdout=subprocess.PIPE, stderr=slave, text=True)
    os.close(slave)
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        first = proc.stdout.readline()  # line 1 finished; line 2 hangs until interrupted
        assert json.loads(first) == {"line": 1, "result": {"text": "a"}}
        proc.send_signal(signal.SIGINT)  # line 2 may finish: it never does ...
        deadline = time.monotonic() + 60
        while b"finishing 1 request in flight" not in b"".join(chunks) and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)  # ... so a second Ctrl-C aborts it
        assert proc.wait(timeout=120) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=10)
        os.close(master)
    stderr = b"".join(chunks).decode(errors="replace")
    assert "interrupted: 1 of 2 requests finished, 0 failed, 1 not finished" in stderr
    assert "starting pipeline 'interrupted': 1/1 processes started" in stderr
    assert "1/1 processes ready (" in stderr
    assert "Traceback" not in stderr


# -- 3. errors without tracebacks ---------------------------------------------------------------------


def test_missing_input_files_are_usage_errors_without_a_traceback(work):
    config = write(work / "cfg", "p.yaml", """
        name: p
        stages:
          - {name: a, factory: "tstages:Produce", terminal: true}
    """)
    for args in (["--inputs", "nope.jsonl"], ["--input", "@nope.json"]):
        result = omni("run", str(config), *args, cwd=work / "run")
        assert result.returncode == 2, result.stderr
        assert "nope.json" in result.stderr
        no_traceback(result)


def test_a_raising_placement_strategy_is_named_and_debug_shows_the_traceback(work):
    config = write(work / "cfg", "s.yaml", """
        name: s
        placement: {strategy: "tstages:broken_strategy"}
        stages:
          - {name: a, factory: "tstages:Produce", terminal: true}
    """)
    result = omni("plan", str(config), cwd=work / "run")
    assert result.returncode == 1
    assert result.stderr.startswith(
        "error: placement strategy 'tstages:broken_strategy' raised ZeroDivisionError: division by zero"
    )
    no_traceback(result)
    for debug in (omni("--debug", "plan", str(config), cwd=work / "run"),
                  omni("plan", str(config), cwd=work / "run", OMNI_DEBUG="1")):
        assert debug.returncode == 1
        assert "Traceback (most recent call last)" in debug.stderr and "ZeroDivisionError" in debug.stderr


@pytest.mark.usefixtures("no_leaks")
def test_a_failed_start_shows_the_stage_config_path_and_only_the_user_frames(work):
    config = write(work / "cfg", "f.yaml", """
        name: f
        stages:
          - {name: a, factory: "tstages:Produce", next: b}
          - {name: b, factory: "tstages:NeedsModel", terminal: true}
    """)
    result = omni("run", str(config), "--input", '{"text": "x"}', cwd=work / "run")
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert lines[0] == ("error: stages[1]: stage 'b' (factory 'tstages:NeedsModel') failed to start: "
                        "RuntimeError: model file is corrupt: m.bin")
    assert [line for line in lines if line.startswith("error")] == lines[:1]  # one message
    assert 'tstages.py", line' in result.stderr and "in load" in result.stderr
    assert "omni_core" not in result.stderr and "asyncio" not in result.stderr


@pytest.mark.usefixtures("no_leaks")
def test_a_misspelt_argument_fails_the_run_at_its_config_path_with_did_you_mean(work):
    config = write(work / "cfg", "t.yaml", """
        name: t
        stages:
          - {name: a, factory: "tstages:Produce", args: {prefx: 1}, terminal: true}
    """)
    result = omni("run", str(config), "--input", '{"text": "x"}', cwd=work / "run")
    assert result.returncode == 1
    assert ("stages[0].args.prefx: factory 'tstages:Produce' does not accept argument 'prefx' "
            "(did you mean 'prefix'?)") in result.stderr
    no_traceback(result)


def test_trim_traceback_keeps_only_user_frames():
    from omni_core.errors import trim_traceback, user_traceback

    def user_code():
        raise ValueError("boom")

    try:
        user_code()
    except ValueError as exc:
        text = user_traceback(exc)
    assert "in user_code" in text and text.rstrip().endswith("ValueError: boom")
    import omni_core  # an installed omni-core's frames live where it is installed, not in the checkout

    package = os.path.dirname(os.path.abspath(omni_core.__file__))
    omni_frame = f'  File "{package}/runtime/host.py", line 1, in run\n    host.build_stages()\n'
    assert trim_traceback(f"Traceback (most recent call last):\n{omni_frame}ValueError: x\n") == "ValueError: x\n"


# -- 4. validate catches what run would reject; placement -----------------------------------------


def test_validate_imports_factories_and_checks_their_arguments(work):
    config = write(work / "cfg", "bad.yaml", """
        name: bad
        stages:
          - {name: a, factory: "tstages:Prodce", next: b}
          - {name: b, factory: "tstages:Produce", args: {prefx: 1}, next: c}
          - {name: c, factory: "tstages:load", terminal: true}
    """)
    result = omni("validate", str(config), "--json", cwd=work / "run")
    assert result.returncode == 1
    errors = {e["path"]: e["message"] for e in json.loads(result.stdout)["errors"]}
    assert errors["stages[0].factory"].startswith("module 'tstages' has no attribute 'Prodce'")
    assert errors["stages[1].args.prefx"] == (
        "factory 'tstages:Produce' does not accept argument 'prefx' (did you mean 'prefix'?)"
    )
    assert errors["stages[2].args"] == "factory 'tstages:load' needs argument 'path'"
    shallow = omni("validate", "--shallow", str(config), cwd=work / "run")
    assert shallow.returncode == 0, shallow.stderr


def test_a_gpu_list_needs_one_id_per_rank(work):
    config = write(work / "cfg", "tp.yaml", """
        name: tp
        stages:
          - {name: a, factory: "tstages:Produce", tp_size: 2, gpu: [0], terminal: true}
    """)
    result = omni("validate", "--shallow", str(config), cwd=work / "run")
    assert result.returncode == 1
    assert "stages[0].gpu: 1 GPU id [0] for tp_size 2; a list gives one id per rank" in result.stderr


def test_plan_warns_about_idle_gpus_and_rejects_too_many_ranks(work):
    cpu = write(work / "cfg", "cpu.yaml", """
        name: cpu
        stages:
          - {name: a, factory: "tstages:Produce", next: b}
          - {name: b, factory: "tstages:Produce", terminal: true}
    """)
    idle = omni("plan", str(cpu), "--gpus", "4", cwd=work / "run")
    assert idle.returncode == 0, idle.stderr
    assert "4 GPUs idle (0, 1, 2, 3) while a, b run on the CPU" in idle.stdout
    config = write(work / "cfg", "tp.yaml", """
        name: tp
        stages:
          - {name: a, factory: "tstages:Produce", tp_size: 4, terminal: true}
    """)
    too_many = omni("plan", str(config), "--gpus", "2", cwd=work / "run")
    assert too_many.returncode == 1
    assert "stages[0].tp_size: stage 'a' has tp_size 4 but only 2 GPUs are given" in too_many.stderr


@pytest.mark.skipif(os.path.exists("/dev/nvidiactl"), reason="the machine has a GPU driver")
def test_run_gpus_refuses_without_cuda(work):
    result = omni("run", "pipe.yaml", "--gpus", "2", "--input", "{}", cwd=work / "run")
    assert result.returncode == 2
    assert result.stderr.startswith("error: --gpus 2: this machine has no CUDA GPU")
    assert "omni plan CONFIG --gpus 2" in result.stderr


# -- 5. logging --------------------------------------------------------------------------------------


def test_an_unknown_log_level_is_a_usage_error(work):
    for result in (omni("--log-level", "loud", "plan", "pipe.yaml", cwd=work / "run"),
                   omni("plan", "pipe.yaml", cwd=work / "run", OMNI_LOG_LEVEL="loud")):
        assert result.returncode == 2
        assert "unknown log level 'loud'; use one of debug, info, warning, error, critical" in result.stderr


def test_listeners_see_info_events_below_the_output_level():
    probe = textwrap.dedent("""
        import json
        from omni_core.logs import add_listener, configure_logging, get_logger
        seen = []
        configure_logging("warning", json=True)
        add_listener(seen.append)
        get_logger().info("process ready", process="p")
        get_logger().warning("w")
        print(json.dumps(seen))
    """)
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                            env={k: v for k, v in os.environ.items() if not k.startswith("OMNI_")})
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    # An info event below the output level is seen by the listener ...
    assert [e["event"] for e in seen] == ["process ready", "w"] and seen[0]["process"] == "p"
    # ... but not printed; the warning is.
    printed = [json.loads(line)["event"] for line in result.stderr.splitlines() if line.startswith("{")]
    assert printed == ["w"], result.stderr


# -- 7. the build and the loaders ----------------------------------------------------------------------


def test_json_configs_are_parsed_as_json(work):
    config = write(work / "cfg", "j.json", '{"name": "j", "stages": [{"name": "a", "factory": "x:y", "terminal": true},]}')
    result = omni("validate", str(config), cwd=work / "run")
    assert result.returncode == 1
    assert "cannot parse: line 1 column" in result.stderr and "strict JSON" in result.stderr


def test_plan_and_validate_import_no_torch_for_a_cpu_plan(work):
    write(work / "cfg", "cpu.yaml", """
        name: cpu
        stages:
          - {name: a, factory: "tstages:Produce", next: b}
          - {name: b, factory: "tstages:Produce", terminal: true}
    """)
    probe = textwrap.dedent("""
        import atexit, sys
        atexit.register(lambda: print("torch imported" if "torch" in sys.modules else "no torch", file=sys.stderr))
        from omni_core.cli import main
        main(sys.argv[1:])
    """)
    for command in ("plan", "validate"):
        result = subprocess.run([sys.executable, "-c", probe, command, str(work / "cfg" / "cpu.yaml")], cwd=work / "run",
                                env=environment(), capture_output=True, text=True, timeout=170)
        assert result.returncode == 0, result.stderr
        assert result.stderr.strip().endswith("no torch"), (command, result.stderr)


def test_every_pyproject_declares_its_license_as_an_spdx_expression():
    files = [p for p in ROOT.rglob("pyproject.toml") if ".venv" not in p.parts and ".tox" not in p.parts]
    assert files
    for path in files:
        project = tomllib.loads(path.read_text())["project"]
        assert isinstance(project["license"], str), path


def test_ci_keeps_its_venv_in_a_temporary_directory_it_removes():
    script = (ROOT / ".ci" / "run").read_text()
    assert "/tmp/omni-ci-venv" not in script
    assert 'venv="$(mktemp -d' in script and "trap 'rm -rf \"$venv\"' EXIT" in script


def _launcher_that_raises(options):
    raise KeyError("nodes")


def test_an_unexpected_exception_from_plugin_code_names_the_plugin_and_the_registered_name(monkeypatch):
    from omni_core.cli import report
    from omni_core.registry import Entry, Registry

    registry = Registry()
    registry.add(Entry("launcher", "cluster", f"{__name__}:_launcher_that_raises", "omni-cluster"))
    monkeypatch.setattr(report, "_loaded_registry", lambda: registry)
    try:
        _launcher_that_raises({})
    except KeyError as exc:
        text = report.describe_error(exc)
    assert text.splitlines()[0] == "error: launcher 'cluster' of plugin 'omni-cluster' raised KeyError: 'nodes'"
    assert "Traceback" not in text

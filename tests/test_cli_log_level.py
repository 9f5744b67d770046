"""``--log-level`` on every subcommand, one default level, and other libraries' log output (a
library's own stderr handler, Python warnings, uvicorn) routed through omni's logging: JSON lines
when stderr is not a terminal, quiet at the default level.

The CLI cases run the real ``omni`` console script; the serve cases a real ``omni serve``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import typer
from runtime_helpers import no_leaks  # noqa: F401

from omni_core.cli import app
from omni_core.testing.serve import ServerProcess

OMNI = str(Path(sys.executable).parent / "omni")

pytestmark = pytest.mark.timeout(240)

# A stage whose construction logs the way transformers does (its root logger with a console
# handler of its own, no propagation), warns through Python's warnings, and logs through omni.
STAGES = '''
import logging
import warnings

from omni_core.logs import get_logger


class Chatty:
    def __init__(self):
        library = logging.getLogger("transformers")
        library.addHandler(logging.StreamHandler())
        library.propagate = False
        logging.getLogger("transformers.modeling_utils").warning("library warning while loading")
        logging.getLogger("transformers.modeling_utils").info("library info while loading")
        warnings.warn("a python warning from a library", UserWarning, stacklevel=1)
        get_logger().info("stage built")

    async def __call__(self, payload, ctx):
        return {"text": payload["text"]}
'''

CONFIG = """
name: chatty
stages:
  - {name: a, factory: "chatty_stages:Chatty", terminal: true}
"""


@pytest.fixture
def work(tmp_path: Path) -> Path:
    (tmp_path / "chatty_stages.py").write_text(STAGES)
    (tmp_path / "chatty.yaml").write_text(textwrap.dedent(CONFIG))
    return tmp_path


def environment(work: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMNI_", "PYTEST_", "PYTHONPATH"))}
    env.update(PYTHONPATH=str(work), OMNI_LOG_FORMAT="json", **extra)
    return env


def omni(work: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([OMNI, *args], cwd=work, env=environment(work, **env), capture_output=True, text=True,
                          timeout=200)


def events(text: str) -> list[dict]:
    """Every stderr line as JSON (a line that is not JSON fails the test: nothing is printed
    beside omni's logging)."""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def commands(group, prefix: tuple[str, ...] = ()):
    for name, command in getattr(group, "commands", {}).items():
        yield (*prefix, name), command
        yield from commands(command, (*prefix, name))


def test_every_command_and_group_takes_log_level_with_one_default():
    root = typer.main.get_command(app)
    found = list(commands(root))
    assert {path for path, _ in found} >= {("serve",), ("run",), ("validate",), ("plan",), ("clean",), ("plugins",),
                                          ("plugins", "list"), ("plugins", "new"), ("plugins", "check")}
    for path, command in [((), root), *found]:
        options = {o for p in command.params for o in getattr(p, "opts", ())}
        assert "--log-level" in options, f"omni {' '.join(path)} has no --log-level"
        level = next(p for p in command.params if "--log-level" in getattr(p, "opts", ()))
        assert "warning (default)" in level.help, path
    from omni_core.logs import DEFAULT_LEVEL, parse_level

    assert DEFAULT_LEVEL == "warning" and parse_level(None) == parse_level("warning")


@pytest.mark.usefixtures("no_leaks")
def test_run_takes_log_level_after_the_subcommand_and_routes_library_output_as_json(work):
    result = omni(work, "run", "chatty.yaml", "--input", '{"text": "hi"}', "--log-level", "info")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"text": "hi"}
    log = events(result.stderr)
    names = [e["event"] for e in log]
    assert "pipeline starting" in names and "stage built" in names  # omni's own info, parent and stage
    library = [e for e in log if e.get("logger") == "transformers.modeling_utils"]
    # The library's own handler is not used (the line would be plain text, and twice).
    assert [(e["event"], e["level"]) for e in library] == [("library warning while loading", "warning"),
                                                           ("library info while loading", "info")]
    assert all("timestamp" in e for e in library)
    assert any(e.get("logger") == "py.warnings" and "a python warning from a library" in e["event"] for e in log)


@pytest.mark.usefixtures("no_leaks")
def test_the_default_level_is_quiet_about_libraries_and_info(work):
    result = omni(work, "run", "chatty.yaml", "--input", '{"text": "hi"}')
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    # The subcommand's level wins over the top-level one.
    quiet = omni(work, "--log-level", "info", "validate", "chatty.yaml", "--log-level", "error")
    assert quiet.returncode == 0 and quiet.stderr == ""
    for args in (["plan", "chatty.yaml"], ["plugins", "list"], ["clean", "--dry-run"], ["plugins", "--log-level", "debug", "list"]):
        assert omni(work, *args, "--log-level", "debug").returncode == 0, args
    bad = omni(work, "serve", "chatty.yaml", "--log-level", "loud")
    assert bad.returncode == 2 and "unknown log level 'loud'" in bad.stderr


def _serve_output(work: Path, *args: str) -> list[str]:
    server = ServerProcess("chatty.yaml", *args, env=environment(work), cwd=str(work)).start()
    try:
        import httpx

        r = httpx.post(f"{server.url}/v1/pipelines/chatty/requests", json={"input": {"text": "hi"}}, timeout=60)
        assert r.status_code == 200 and r.json()["result"] == {"text": "hi"}
    finally:
        assert server.stop() == 0, server.output()
    server.assert_nothing_left()
    return [line for line in server.lines if not line.startswith("omni serve: ")]


def test_serve_takes_log_level_and_prints_uvicorn_and_libraries_as_json(work):
    log = events("\n".join(_serve_output(work, "--log-level", "info")))
    names = [e["event"] for e in log]
    assert "listening" in names and "ready" in names and "http request" in names
    uvicorn = [e for e in log if str(e.get("logger", "")).startswith("uvicorn")]
    assert uvicorn and all(e["level"] in ("info", "warning", "error") for e in uvicorn)
    assert any(e.get("logger") == "transformers.modeling_utils" for e in log)


def test_serve_at_the_default_level_prints_only_where_it_listens_and_its_drain(work):
    log = events("\n".join(_serve_output(work)))
    assert [(e["event"], e["level"], e.get("logger")) for e in log] == [("draining", "warning", None)]

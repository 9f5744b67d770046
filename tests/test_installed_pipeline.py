"""A pipeline shipped by a separately pip-installed package, whose stages, functions and config
are registered only through entry points, runs through ``omni run`` and through ``Pipeline`` with
fan-out, fan-in and streaming across several processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from runtime_helpers import arun, no_leaks  # noqa: F401

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("no_leaks")]

PACKAGE = {
    "pyproject.toml": """
        [build-system]
        requires = ["setuptools>=61"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "acme-omni"
        version = "1.2.3"

        [project.entry-points.omni]
        acme = "acme_omni.plugin"

        [tool.setuptools]
        packages = ["acme_omni"]
    """,
    "acme_omni/__init__.py": "",
    "acme_omni/stages.py": """
        class Split:
            def __call__(self, payload, ctx):
                return {"text": payload["text"]}

        class Upper:
            async def __call__(self, payload, ctx):
                return {"text": payload["text"].upper()}

        class Reverse:
            async def __call__(self, payload, ctx):
                return {"text": payload["text"][::-1]}

        class Speak:
            async def __call__(self, payload, ctx):
                for word in payload["text"].split():
                    await ctx.emit(word)
                return {"spoken": payload["text"]}

        def merge(payloads):
            return {"text": " ".join(payloads[k]["text"] for k in ("upper", "reverse"))}
    """,
    "acme_omni/plugin.py": """
        import omni_core

        PIPELINE = {
            "name": "acme-pipe",
            "stages": [
                {"name": "split", "factory": "acme.split", "next": ["upper", "reverse"]},
                {"name": "upper", "factory": "acme.upper", "next": "join", "process": "workers"},
                {"name": "reverse", "factory": "acme.reverse", "next": "join", "process": "workers"},
                {"name": "join", "factory": "acme.split", "wait_for": ["upper", "reverse"],
                 "merge_fn": "acme.merge", "next": "speak"},
                {"name": "speak", "factory": "acme.speak", "terminal": True},
            ],
        }

        @omni_core.hookimpl
        def omni_register_stages(register):
            register("acme.split", "acme_omni.stages:Split", description="passes text on")
            register("acme.upper", "acme_omni.stages:Upper")
            register("acme.reverse", "acme_omni.stages:Reverse")
            register("acme.speak", "acme_omni.stages:Speak", description="streams words")

        @omni_core.hookimpl
        def omni_register_functions(register):
            register("acme.merge", "acme_omni.stages:merge", kind="merge")

        @omni_core.hookimpl
        def omni_register_pipelines(register):
            register("acme-pipe", PIPELINE)
    """,
}


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """acme-omni, really installed by pip into its own site directory."""
    src = tmp_path_factory.mktemp("acme-src")
    for rel, text in PACKAGE.items():
        path = src / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    target = tmp_path_factory.mktemp("acme-site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--target", str(target), str(src)],
        check=True,
        timeout=180,
    )
    assert list(target.glob("acme_omni-1.2.3.dist-info"))
    return target


def _env(site: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["OMNI_LOAD_PLUGINS"] = "acme-omni"  # hermetic: this distribution and the built-ins only
    env["PYTHONPATH"] = os.pathsep.join([str(site), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _omni(site: Path, *args: str) -> subprocess.CompletedProcess:
    cli = [sys.executable, "-c", "from omni_core.cli import main; main()", *args]
    return subprocess.run(cli, env=_env(site), capture_output=True, text=True, timeout=120)


def test_installed_package_shows_up_in_plugins_list(site):
    listing = json.loads(_omni(site, "plugins", "list", "--json").stdout)
    acme = next(p for p in listing if p["name"] == "acme")
    assert acme["distribution"] == "acme-omni" and acme["version"] == "1.2.3" and acme["error"] is None
    assert acme["registered"]["stage"] == ["acme.split", "acme.upper", "acme.reverse", "acme.speak"]
    assert acme["registered"]["merge"] == ["acme.merge"] and acme["registered"]["pipeline"] == ["acme-pipe"]


def test_installed_pipeline_runs_through_omni_run_with_streaming(site):
    done = _omni(site, "run", "acme-pipe", "--input", '{"text": "hello world"}', "--stream")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert lines == [
        {"stage": "speak", "chunk": "HELLO"},
        {"stage": "speak", "chunk": "WORLD"},
        {"stage": "speak", "chunk": "dlrow"},
        {"stage": "speak", "chunk": "olleh"},
        {"result": {"spoken": "HELLO WORLD dlrow olleh"}},
    ]


def test_installed_pipeline_runs_through_the_pipeline_api(site, monkeypatch):
    from omni_core import Pipeline
    from omni_core.plugins import reset_plugins

    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("OMNI_LOAD_PLUGINS", "acme-omni")
    reset_plugins()

    async def body():
        async with Pipeline("acme-pipe") as p:
            assert len(p.pids()) == 4
            events = [e async for e in p.stream({"text": "a b"})]
            return events, await p.submit({"text": "x"})

    try:
        events, single = arun(body())
    finally:
        reset_plugins()
    assert [e.data for e in events[:-1]] == ["A", "B", "b", "a"]
    assert events[-1].data == {"spoken": "A B b a"}
    assert single == {"spoken": "X x"}

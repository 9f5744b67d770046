"""Plugins for the tests: real installed distributions (a ``*.dist-info`` with METADATA and
``entry_points.txt`` next to the module, found by ``importlib.metadata`` like any pip-installed
package) and an in-tree plugin object for tests that only need a registry.

Every distribution here has a module named ``omnitest_*`` so the tests can forget them between
runs, and an entry point named after what it shows (``good``, ``broken``, ``raises`` ...); tests
pick the ones they want with ``OMNI_LOAD_PLUGINS``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from pathlib import Path

import attrs

import omni_core

MODULE_PREFIX = "omnitest_"


@attrs.frozen
class FakeDistribution:
    """One installable plugin: distribution name, version, entry points and module files."""

    name: str
    version: str
    entry_points: Mapping[str, str]
    files: Mapping[str, str]

    @property
    def dist_info(self) -> str:
        return f"{self.name.replace('-', '_')}-{self.version}.dist-info"


def install_distribution(site: Path, dist: FakeDistribution) -> None:
    """Write ``dist`` into ``site`` the way an installer lays out a wheel."""
    for rel, text in dist.files.items():
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    info = site / dist.dist_info
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {dist.name}\nVersion: {dist.version}\n"
        "Summary: a plugin used by omni-core's tests\n"
    )
    lines = ["[omni]"] + [f"{name} = {target}" for name, target in dist.entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    (info / "top_level.txt").write_text(
        "\n".join(sorted({rel.split("/")[0].removesuffix(".py") for rel in dist.files})) + "\n"
    )


# -- the plugins ---------------------------------------------------------------------------------

GOOD = FakeDistribution(
    name="omnitest-good",
    version="1.4.2",
    entry_points={"good": "omnitest_good"},
    files={
        "omnitest_good/__init__.py": '''
            """A well-behaved plugin: one registration through every hook."""
            from pathlib import Path

            import omni_core


            class UpperStage:
                def __init__(self, prefix: str = ""):
                    self.prefix = prefix

                def __call__(self, payload, ctx):
                    return self.prefix + str(payload).upper()


            def pick(request_id, payload):
                return "*"


            def join(payloads):
                return "".join(str(p) for p in payloads.values())


            class GoodRelay:
                pass


            def place_everything_on_cpu(request):
                return {}


            class GoodLauncher:
                pass


            @omni_core.hookimpl
            def omni_register_stages(register):
                register("acme.upper", UpperStage, description="upper-cases text")
                register("acme.lazy", "omnitest_good.heavy:HeavyStage", description="imported on use")


            @omni_core.hookimpl
            def omni_register_functions(register):
                register("acme.pick", pick, kind="route")
                register("acme.join", join, kind="merge")


            @omni_core.hookimpl
            def omni_register_relays(register):
                register("acme.relay", GoodRelay)


            @omni_core.hookimpl
            def omni_register_placements(register):
                register("acme.cpu", place_everything_on_cpu)


            @omni_core.hookimpl
            def omni_register_launchers(register):
                register("acme.launcher", GoodLauncher)


            def make_api(api):
                """An HTTP API for omni serve: POST /v1/acme/echo runs the body through the
                pipeline; GET /v1/acme/options shows this API's options from the config."""
                from starlette.responses import JSONResponse
                from starlette.routing import Route

                async def echo(request):
                    try:
                        result = await api.submit(await request.json())
                    except Exception as exc:
                        return api.error_response(exc)
                    return JSONResponse({"acme": result, "pipeline": api.pipeline_name})

                async def options(request):
                    return JSONResponse(api.options)

                return [Route("/v1/acme/echo", echo, methods=["POST"]), Route("/v1/acme/options", options)]


            @omni_core.hookimpl
            def omni_register_apis(register):
                register("acme.api", make_api, description="echoes through the pipeline")


            @omni_core.hookimpl
            def omni_register_families(register):
                register("acme.family", {"name": "acme.family"}, model_types=["acme_lm"], pipeline="acme.demo")


            @omni_core.hookimpl
            def omni_register_pipelines(register):
                register("acme.demo", "omnitest_good:demo.yaml")
                register("acme.inline", {
                    "name": "inline", "launcher": "acme.launcher",
                    "stages": [{"name": "up", "factory": "acme.upper", "terminal": True}],
                })
        ''',
        "omnitest_good/heavy.py": '''
            """Registered lazily: imported only when a config uses acme.lazy."""


            class HeavyStage:
                def __call__(self, payload, ctx):
                    return payload
        ''',
        "omnitest_good/demo.yaml": '''
            name: acme-demo
            launcher: acme.launcher
            stages:
              - name: shout
                factory: acme.upper
                args: {prefix: "> "}
                next: echo
              - name: echo
                factory: acme.lazy
                terminal: true
        ''',
    },
)

BROKEN = FakeDistribution(
    name="omnitest-broken",
    version="0.3.0",
    entry_points={"broken": "omnitest_broken"},
    files={
        "omnitest_broken.py": '''
            """Fails at import: a dependency that is not installed."""
            import omnitest_dependency_that_is_not_installed  # noqa: F401

            import omni_core


            @omni_core.hookimpl
            def omni_register_stages(register):
                register("broken.stage", object)
        ''',
    },
)

RAISES = FakeDistribution(
    name="omnitest-raises",
    version="2.0.0",
    entry_points={"raises": "omnitest_raises"},
    files={
        "omnitest_raises.py": '''
            """Imports fine; its hook fails half-way through registering."""
            import omni_core


            class Registered:
                pass


            @omni_core.hookimpl
            def omni_register_stages(register):
                register("raises.first", Registered)
                raise RuntimeError("model catalogue not found")
        ''',
    },
)

MISSPELLED = FakeDistribution(
    name="omnitest-misspelled",
    version="0.1.0",
    entry_points={"misspelled": "omnitest_misspelled"},
    files={
        "omnitest_misspelled.py": '''
            """Implements a hook that does not exist (one letter short)."""
            import omni_core


            class Stage:
                pass


            @omni_core.hookimpl
            def omni_register_stage(register):
                register("misspelled.stage", Stage)
        ''',
    },
)

DISABLED = FakeDistribution(
    name="omnitest-disabled",
    version="0.1.0",
    entry_points={"disabled": "omnitest_disabled"},
    files={
        "omnitest_disabled.py": '''
            """A fine plugin that the tests turn off with OMNI_DISABLED_PLUGINS."""
            import omni_core


            class Stage:
                pass


            @omni_core.hookimpl
            def omni_register_stages(register):
                register("disabled.stage", Stage)
        ''',
    },
)


def _duplicate(letter: str) -> FakeDistribution:
    return FakeDistribution(
        name=f"omnitest-dup-{letter}",
        version="0.1.0",
        entry_points={f"dup_{letter}": f"omnitest_dup_{letter}"},
        files={
            f"omnitest_dup_{letter}.py": f'''
                """Registers 'shared.stage', which the other dup plugin registers too."""
                import omni_core


                class Stage:
                    pass


                class Own:
                    pass


                @omni_core.hookimpl
                def omni_register_stages(register):
                    register("shared.stage", Stage)
                    register("dup_{letter}.own", Own)
            ''',
        },
    )


DUP_A = _duplicate("a")
DUP_B = _duplicate("b")

BROKEN_RELAY = FakeDistribution(
    name="omnitest-brokenrelay",
    version="0.3.0",
    entry_points={"brokenrelay": "omnitest_brokenrelay.plugin"},
    files={
        "omnitest_brokenrelay/__init__.py": "",
        "omnitest_brokenrelay/plugin.py": '''
            """Registers a relay, lazily and with its capabilities, whose module cannot import."""
            import omni_core
            from omni_core.options import positive_int


            @omni_core.hookimpl
            def omni_register_relays(register):
                register("brokenrelay", "omnitest_brokenrelay.relay:BrokenRelay",
                         capabilities={"devices": ["cpu", "cuda"], "scopes": ["node"], "priority": 1},
                         options={"slots": positive_int(8, "credits")})
        ''',
        "omnitest_brokenrelay/relay.py": '''
            raise ImportError("omnitest_brokenrelay.relay needs a library that is not installed")
        ''',
    },
)

ALL = (GOOD, BROKEN, RAISES, MISSPELLED, DISABLED, DUP_A, DUP_B, BROKEN_RELAY)


def make_plugin_site(site: Path) -> Path:
    """A directory holding every test distribution, ready to be put on ``sys.path``."""
    site.mkdir(parents=True, exist_ok=True)
    for dist in ALL:
        install_distribution(site, dist)
    return site


def forget_test_modules() -> None:
    """Drop every ``omnitest_*`` module, so the next test imports (or not) from scratch."""
    for name in [m for m in sys.modules if m.startswith(MODULE_PREFIX)]:
        del sys.modules[name]


def omni_command() -> list[str]:
    """The ``omni`` console script of this interpreter (the module's main when not installed)."""
    script = Path(sys.executable).parent / "omni"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from omni_core.cli import main; main()"]


def _distributions_in(site: Path | str) -> list[str]:
    """The distributions installed in ``site`` (their ``*.dist-info`` folders)."""
    return sorted(p.name.split("-")[0] for p in Path(site).glob("*.dist-info"))


def run_omni(
    *args: str, pythonpath: Path | str | None = None, env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``omni ARGS`` in a fresh process; ``pythonpath`` makes extra distributions visible."""
    skip = ("OMNI_LOAD_PLUGINS", "OMNI_DISABLED_PLUGINS")
    full_env = {k: v for k, v in os.environ.items() if k not in skip}
    # hermetic: the distributions in ``pythonpath`` load, nothing else installed does
    full_env["OMNI_LOAD_PLUGINS"] = ",".join(_distributions_in(pythonpath)) if pythonpath is not None else ""
    full_env["NO_COLOR"] = "1"
    if pythonpath is not None:
        full_env["PYTHONPATH"] = os.pathsep.join(
            [str(pythonpath)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
        )
    full_env.update(env or {})
    return subprocess.run(
        [*omni_command(), *args], capture_output=True, text=True, env=full_env, cwd=cwd, timeout=60
    )


# -- an in-tree plugin for tests that only need a registry ---------------------------------------


class Upper:
    """A stage factory with one optional argument and one injected one."""

    def __init__(self, prefix: str = "", *, stage_name: str = ""):
        self.prefix = prefix

    def __call__(self, payload, ctx):
        return self.prefix + str(payload).upper()


class NeedsModel:
    """A stage factory with a required argument."""

    def __init__(self, model: str, device: str = "cpu"):
        self.model = model


def pick(request_id, payload):
    return "*"


def join(payloads):
    return dict(payloads)


def project(payload):
    return payload


def done_to(request_id, payload):
    return "*"


def wait_for(request_id, from_stage, payload):
    return None


def terminals(inputs):
    return None


class AcmePlugin:
    """The in-tree plugin: ``load_plugins(extra=[("acme", AcmePlugin())])``."""

    @omni_core.hookimpl
    def omni_register_stages(self, register):
        register("acme.upper", Upper, description="upper-cases text")
        register("acme.needs_model", NeedsModel)
        register("acme.lazy", "plugin_fixtures:Upper")

    @omni_core.hookimpl
    def omni_register_functions(self, register):
        register("acme.pick", pick, kind="route")
        register("acme.join", join, kind="merge")
        register("acme.project", project, kind="project_payload")
        register("acme.done_to", done_to, kind="stream_done")
        register("acme.wait", wait_for, kind="wait_for")
        register("acme.terminals", terminals, kind="terminal_stages")


#: A pipeline given as a mapping, for registrations by dotted path.
DEMO_PIPELINE = {
    "name": "fixture-demo",
    "stages": [
        {"name": "a", "factory": "acme.upper", "next": "b"},
        {"name": "b", "factory": "acme.upper", "terminal": True},
    ],
}

"""``omni plugins new``: a complete plugin distribution rendered from the templates in
``omni_core/templates/plugin`` (``common/`` plus one folder per kind) with :class:`string.Template`.

Template files end in ``.tmpl``; ``__pkg__`` in a path becomes the package name. Placeholders:
``$name`` (the plugin's name and namespace), ``$pkg`` (``omni_NAME``), ``$dist`` (``omni-NAME``),
``$omni_min`` (the omni-core version the plugin declares as its minimum), ``$omni_core`` and
``$omni_core_min`` (what the generated ``tox.ini`` installs by default: see
:func:`omni_core_requirement`), ``$torch`` (the torch version its ``constraints.txt`` pins) and a
few for the README. Nothing rendered names a path of the machine that generated it.
"""

from __future__ import annotations

import keyword
import re
from importlib import metadata, resources
from pathlib import Path
from string import Template

from ._version import __version__
from .errors import OmniError

#: The kinds ``omni plugins new --kind`` knows, with what the generated plugin contributes.
KINDS: dict[str, str] = {
    "stage": "stages, a route and a merge function, and a pipeline that uses them",
    "relay": "a relay built on omni_core.relay.kit, tested with the relay conformance kit",
    "placement": "a placement strategy with an options schema, and a pipeline placed by it",
    "launcher": "a launcher that wraps the local one, adding environment variables and a start log",
    "api": "an HTTP API that omni serve mounts, in front of a pipeline of its own",
    "family": "a model family for omni-transformers' kit, with its tiny checkpoint writer and pipeline",
}
#: The hook a kind's plugin implements (for the README's ``omni plugins list --hook``).
_HOOKS = {"stage": "stages", "relay": "relays", "placement": "placements", "launcher": "launchers",
          "api": "apis", "family": "families"}
#: What a kind's generated code imports besides omni-core.
_DEPENDENCIES = {"stage": [], "relay": ["torch>=2.1", "msgspec>=0.18"], "placement": [], "launcher": ["attrs>=23.1"],
                 "api": ["starlette>=0.37"],
                 "family": ["omni-transformers>=0.1", "torch>=2.1", "transformers>=5.24,<6"]}
#: Where the generated tox.ini finds what no index has besides omni-core (a requirement, or a path
#: in the variable it names), per kind.
_TOX_DEPS = {"family": "{env:OMNI_TRANSFORMERS:omni-transformers>=0.1}"}
#: What a kind's tests need besides pytest.
_TEST_DEPENDENCIES = {"api": ["httpx>=0.27"]}
#: The suffix of the class a kind's plugin defines (``$cls``).
_CLASS_SUFFIX = {"relay": "Relay", "launcher": "Launcher"}
NAME = re.compile(r"^[a-z][a-z0-9_]*$")


class ScaffoldError(OmniError):
    """The plugin cannot be generated: a bad name, an existing folder, an unknown kind."""


def _layout(kind: str, name: str, pkg: str) -> str:
    if kind == "family":
        return (f"- `{pkg}/plugin.py`: registers the family `{name}` (`omni_register_families`: its model types "
                f"and pipeline), its stages by dotted path and the pipeline `{name}.example`\n"
                f"- `{pkg}/family.py`: the family descriptor (`omni_transformers.kit.family.Family`); set "
                "`MODEL_TYPES` to your checkpoints' `model_type`\n"
                f"- `{pkg}/tiny.py`: the tiny random checkpoint writer (`python -m omni_transformers.tiny DIR "
                f"--family {name}`)\n"
                f"- `{pkg}/stages.py`: a processor, the kit's thinker, a toy codec (replace it with your talker "
                "and vocoder on the kit's skeletons)\n"
                f"- `{pkg}/pipelines/example.yaml`: the pipeline `{name}.example`, the family's default\n"
                "- `tests/`: registration, a checkpoint folder finding the family, the pipeline in real processes "
                "equal to transformers' `generate`\n\n"
                "omni-transformers, like omni-core, may be on no index you use: `OMNI_TRANSFORMERS` (a requirement, "
                "or a path to `plugins/omni-transformers` of omni's source tree) tells tox where it is.")
    if kind == "launcher":
        return (f"- `{pkg}/plugin.py`: registers the launcher `{name}.local` by dotted path with its options "
                "schema (configs are checked without importing it), a stage and a pipeline\n"
                f"- `{pkg}/launcher.py`: the launcher: omni's local launcher plus environment variables and a "
                "start log\n"
                f"- `{pkg}/pipelines/example.yaml`: the pipeline `{name}.example`, launched by it\n"
                "- `tests/`: option checks, and pipelines started through the launcher in real processes")
    if kind == "api":
        return (f"- `{pkg}/plugin.py`: registers the API `{name}.api` (with its options schema), a stage and "
                "a pipeline that mounts the API\n"
                f"- `{pkg}/api.py`: the routes `POST /v1/{name}/upper` and `GET /v1/{name}/info`\n"
                f"- `{pkg}/pipelines/example.yaml`: the pipeline `{name}.example` (`serve: {{apis: [{name}.api]}}`)\n"
                "- `tests/`: a real `omni serve` process, asked over HTTP")
    if kind == "placement":
        return (f"- `{pkg}/plugin.py`: registers `{name}.round_robin` by dotted path with its options schema\n"
                f"- `{pkg}/placement.py`: the strategy, a pure function of a PlacementRequest\n"
                f"- `{pkg}/pipelines/example.yaml`: the pipeline `{name}.example`, placed by it\n"
                "- `tests/`: the strategy on simulated GPUs, option checks, the pipeline in real processes")
    if kind == "relay":
        return (f"- `{pkg}/plugin.py`: registers the relay `{name}` by dotted path, with its "
                "capabilities and options schema (planning never imports the relay)\n"
                f"- `{pkg}/relay.py`: the relay, built on `omni_core.relay.kit`\n"
                f"- `tests/`: the relay conformance kit against `{name}`, and a pipeline using it")
    return (f"- `{pkg}/plugin.py`: the hooks: registers `{name}.*` names (stages by dotted path)\n"
            f"- `{pkg}/stages.py`: the stage classes\n"
            f"- `{pkg}/pipelines/example.yaml`: the pipeline `{name}.example`\n"
            "- `tests/`: registration, functions, and the pipeline in real processes")


def _values(name: str, kind: str) -> dict[str, str]:
    pkg, dist = f"omni_{name}", f"omni-{name.replace('_', '-')}"
    run = "$ " + run_command(name, kind)
    if kind == "api":
        run += "\n$ " + serve_command(name) + "    # then, from another terminal:\n$ " + curl_command(name)
    return {
        "name": name,
        "pkg": pkg,
        "dist": dist,
        "kind": kind,
        "cls": "".join(part.title() for part in name.split("_")) + _CLASS_SUFFIX.get(kind, ""),
        "env_var": f"{name.upper()}_GREETING",
        "kind_flag": "" if kind == "stage" else f" --kind {kind}",
        "hook": _HOOKS[kind],
        "tox_deps": f"\n    {_TOX_DEPS[kind]}" if kind in _TOX_DEPS else "",
        "installed_first": "omni-core and omni-transformers are" if kind == "family" else "omni-core is",
        "omni_min": __version__,
        "description": f"omni plugin {name!r}: {KINDS[kind]}.",
        "run_example": run,
        "omni_core": omni_core_requirement(),
        "omni_core_min": omni_core_requirement(minimum=True),
        "torch": torch_pin(),
        "layout": _layout(kind, name, pkg),
        "dependencies": ", ".join(f'"{d}"' for d in [f"omni-core>={__version__}", *_DEPENDENCIES[kind]]),
        "test_dependencies": ", ".join(f'"{d}"' for d in ["pytest>=8", "pytest-timeout>=2.2",
                                                        *_TEST_DEPENDENCIES.get(kind, [])]),
    }


def omni_core_requirement(minimum: bool = False) -> str:
    """The omni-core the generated ``tox.ini`` installs when ``OMNI_CORE`` (``OMNI_CORE_MIN`` for
    the minimum) is not set: a requirement any machine can read, never a path of the checkout that
    generated the plugin. Where no index has omni-core, those variables point at omni's source
    tree or a wheel (the generated README says so)."""
    return f"omni-core=={__version__}" if minimum else f"omni-core>={__version__}"


def torch_pin() -> str:
    """The torch version of the environment that runs the generator, without its local label
    (``2.13.0``, not ``2.13.0+cpu``, a label no default index has): the generated
    ``constraints.txt`` pins it, so tox installs that release and never the newest one. Which
    build pip picks (CPU or CUDA) is the index's business: the generated README says how to get
    the CPU one."""
    return metadata.version("torch").split("+", 1)[0]


def run_command(name: str, kind: str) -> str:
    """The ``omni run`` line that tries a generated plugin's example pipeline."""
    example = '{"n": 4}' if kind == "relay" else '{"text": "hello omni"}'
    if kind == "family":  # its pipeline needs a checkpoint: the family's tiny one, served by folder
        return (f"python -m omni_transformers.tiny {name}-tiny --family {name} && "
                f"omni run {name}-tiny --input '{example}'")
    return f"omni run {name}.example --input '{example}'"


def serve_command(name: str) -> str:
    """The ``omni serve`` line that mounts a generated API plugin."""
    return f"omni serve {name}.example --port 8000"


def curl_command(name: str) -> str:
    """A request to a generated API plugin's route, from another terminal."""
    return (f"curl -s -X POST http://127.0.0.1:8000/v1/{name}/upper -H 'content-type: application/json' "
            "-d '{\"text\": \"hello omni\"}'")


def _templates(kind: str):
    root = resources.files("omni_core") / "templates" / "plugin"
    for folder in ("common", kind):
        yield from _walk(root / folder, "")


def _walk(node, prefix: str):
    for child in sorted(node.iterdir(), key=lambda c: c.name):
        rel = f"{prefix}{child.name}"
        if child.is_dir():
            if child.name != "__pycache__":
                yield from _walk(child, rel + "/")
        elif child.name.endswith(".tmpl"):
            yield rel.removesuffix(".tmpl"), child.read_text(encoding="utf-8")


def check_name(name: str) -> None:
    if not NAME.match(name) or keyword.iskeyword(name):
        raise ScaffoldError(
            f"invalid plugin name {name!r}: use lower-case letters, digits and '_', starting with a "
            "letter (it becomes the package omni_NAME and the namespace of every name it registers)")


def new_plugin(name: str, directory: str | Path = ".", kind: str = "stage") -> Path:
    """Write the distribution ``omni-NAME/`` into ``directory``; returns its path."""
    check_name(name)
    if kind not in KINDS:
        raise ScaffoldError(f"unknown kind {kind!r}; kinds: {', '.join(KINDS)}")
    values = _values(name, kind)
    target = Path(directory) / values["dist"]
    if target.exists():
        raise ScaffoldError(f"{target} already exists; choose another --dir or remove it")
    files = []
    for rel, text in _templates(kind):
        try:
            rendered = Template(text).substitute(values)
        except (KeyError, ValueError) as exc:  # a template bug, not the user's
            raise RuntimeError(f"template {kind}/{rel}: {exc!r}") from exc
        files.append((rel.replace("__pkg__", values["pkg"]), rendered))
    for rel, text in files:
        path = target / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return target

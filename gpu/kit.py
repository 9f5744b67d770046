"""What ``gpu/prepare`` and ``gpu/check`` share: the distributions, what the GPU machine is known
to hold, how the wheel set is checked, and which tests are GPU tests.

Standard library only (``packaging`` is borrowed from pip when it is not installed): both scripts
run under a bare ``python3`` on either machine.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELS = ROOT / ".whl"
MANIFEST = "manifest.json"
MAX_MIB = 60

#: omni's distributions the check installs: name -> (source folder, import name, tests folder,
#: folder pytest runs in). omni-ray stays out: ray's wheels alone are several times the 64 MiB that
#: travels with the tree, so ``num_gpus`` under Ray is not run on the GPU machine.
DISTS = {
    "omni-core": (".", "omni_core", "tests", "."),
    "omni-contrib-stages": ("contrib_stages", "omni_contrib_stages", "contrib_stages/tests", "contrib_stages"),
    "omni-cuda-ipc": ("plugins/omni-cuda-ipc", "omni_cuda_ipc", "plugins/omni-cuda-ipc/tests", "."),
    "omni-nccl": ("plugins/omni-nccl", "omni_nccl", "plugins/omni-nccl/tests", "."),
    "omni-transformers": ("plugins/omni-transformers", "omni_transformers", "plugins/omni-transformers/tests", "."),
}
LEFT_OUT = {"omni-ray": "ray's wheels alone are larger than what travels to the GPU machine (64 MiB)",
            "omni-tcp": "a relay between nodes: no GPU code path, and the GPU machine is one node"}

#: Requirements beyond omni's own runtime dependencies: what the GPU tests run with.
KIT_REQUIREMENTS = ["pytest>=8", "pytest-timeout>=2.2"]

#: The GPU machine (device docs, pip list read there 2026-11): Python 3.12, and these versions of
#: the packages omni relies on the machine for. Packages it holds in a version nobody read are
#: shipped anyway (they are small): only these are taken from the machine.
MACHINE_PYTHON = "3.12"
PROVIDED = {"torch": "2.11.0", "torchaudio": "2.11.0", "numpy": "2.5.2", "tokenizers": "0.23.2", "safetensors": "0.8.0",
            "triton": "3.6.0"}
#: Also read there: what a shipped wheel shadows (reported, not relied on).
MACHINE_READ = {"transformers": "5.17.0", "huggingface-hub": "1.33.0", "accelerate": "1.15.0"}
#: Every package the GPU machine's image holds (device docs, read 2026-11-17), versions mostly unread.
MACHINE_NAMES = frozenset({
    "absl-py", "accelerate", "aiofiles", "aiohappyeyeballs", "aiohttp", "aiosignal", "annotated-doc",
    "anyio", "attrs", "botorch", "build", "certifi", "charset-normalizer", "chex", "click", "cloudpickle",
    "cmake", "colorama", "contourpy", "coverage", "cuda-bindings", "cuda-core", "cuda-pathfinder",
    "cuda-toolkit", "cupy-cuda13x", "cycler", "cython", "diffrax", "e3nn", "einops", "equinox", "etils",
    "execnet", "filelock", "flatbuffers", "flax", "fonttools", "formulaic", "frozenlist", "fsspec",
    "gpytorch", "grpcio", "h11", "h5py", "hf-xet", "httpcore", "httpx", "huggingface-hub", "humanize",
    "hypothesis", "idna", "imageio", "iniconfig", "interface-meta", "jax", "jax-cuda13-pjrt",
    "jax-cuda13-plugin", "jaxlib", "jaxtyping", "jinja2", "joblib", "kiwisolver", "lazy-loader",
    "lightning", "lightning-utilities", "linear-operator", "lineax", "llvmlite", "lxml", "markdown",
    "markdown-it-py", "markupsafe", "matplotlib", "mdurl", "meson", "ml-dtypes", "mpi4py", "mpmath",
    "msgpack", "multidict", "multipledispatch", "mypy-extensions", "nanobind", "narwhals", "networkx",
    "ninja", "numba", "numba-cuda", "numpy", "numpyro", "nvidia-cublas", "nvidia-cuda-cupti",
    "nvidia-cuda-nvrtc", "nvidia-cuda-runtime", "nvidia-cudnn-cu13", "nvidia-cufft", "nvidia-cufile",
    "nvidia-curand", "nvidia-cusolver", "nvidia-cusparse", "nvidia-cusparselt-cu13", "nvidia-ml-py",
    "nvidia-nccl-cu13", "nvidia-nvjitlink", "nvidia-nvshmem-cu13", "nvidia-nvtx", "onnx", "onnx-ir",
    "onnxruntime", "onnxscript", "opencv-python-headless", "optax", "opt-einsum", "opt-einsum-fx",
    "optimistix", "orbax-checkpoint", "packaging", "pandas", "pathspec", "patsy", "peft", "pillow", "pip",
    "pluggy", "portalocker", "prometheus-client", "propcache", "protobuf", "psutil", "pyarrow", "pybind11",
    "py-cpuinfo", "pygments", "pyparsing", "pyproject-hooks", "pyre-extensions", "pytest",
    "pytest-benchmark", "pytest-cov", "pytest-mock", "pytest-timeout", "pytest-xdist", "python-dateutil",
    "pytorch-lightning", "pyyaml", "regex", "requests", "rich", "sacrebleu", "safetensors",
    "scikit-build-core", "scikit-image", "scikit-learn", "scipy", "seaborn", "sentencepiece",
    "sentence-transformers", "setuptools", "shellingham", "simplejson", "six", "sortedcontainers",
    "statsmodels", "sympy", "tabulate", "tensorboard", "tensorboard-data-server", "tensorstore",
    "threadpoolctl", "tifffile", "tiktoken", "timm", "tokenizers", "toolz", "torch", "torchaudio",
    "torchdiffeq", "torch-geometric", "torchmetrics", "torchvision", "tqdm", "transformers", "treescope",
    "triton", "typer", "typing-extensions", "typing-inspect", "urllib3", "uvloop", "wadler-lindig",
    "werkzeug", "wheel", "wrapt", "xarray", "xxhash", "yarl", "zipp"
})
#: Never shipped, whatever asks for them: the machine's CUDA stack.
NEVER = re.compile(r"^(torch|torchvision|torchaudio|triton|nvidia-.*|cuda-.*|cupy-.*|jax.*)$")

#: Wheel tags of the GPU machine (x86-64, glibc 2.39); pip matches manylinux_2_N exactly.
PLATFORMS = ["manylinux2014_x86_64", "manylinux1_x86_64"] + [f"manylinux_2_{n}_x86_64" for n in range(17, 40)]


def pip_target_args() -> list[str]:
    """pip options that select wheels for the GPU machine's Python instead of this one's."""
    args = ["--only-binary=:all:", "--python-version", MACHINE_PYTHON, "--implementation", "cp"]
    for platform in PLATFORMS:
        args += ["--platform", platform]
    return args


def build_python() -> str | None:
    """A Python with the setuptools omni's pyproject.toml files ask for (>= 77): this one, else the
    repository's .venv; None when neither has it."""
    probe = "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)"
    for python in (sys.executable, str(ROOT / ".venv" / "bin" / "python")):
        if Path(python).exists() and subprocess.run([python, "-c", probe], capture_output=True).returncode == 0:
            return python
    return None


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def packaging():
    """``(Requirement, Version, default_environment)`` from ``packaging``, or pip's copy of it."""
    try:
        from packaging.markers import default_environment
        from packaging.requirements import Requirement
        from packaging.version import Version
    except ImportError:  # a bare interpreter: pip vendors it
        from pip._vendor.packaging.markers import default_environment
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.version import Version
    return Requirement, Version, default_environment


def machine_environment() -> dict[str, str]:
    """Marker values of the GPU machine's interpreter."""
    *_, default_environment = packaging()
    env = dict(default_environment())
    env.update(python_version=MACHINE_PYTHON, python_full_version=f"{MACHINE_PYTHON}.3", sys_platform="linux",
               platform_system="Linux", platform_machine="x86_64", implementation_name="cpython",
               platform_python_implementation="CPython", os_name="posix")
    return env


def runtime_requirements(requires: list[str], env: dict[str, str]) -> list:
    """The requirements (no extras) that apply under marker values ``env``."""
    Requirement, *_ = packaging()
    out = []
    for text in requires:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({**env, "extra": ""}):
            out.append(req)
    return out


def wheel_metadata(path: Path) -> dict:
    """Name, version, Requires-Dist and importable top-level names of a wheel file."""
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = zf.read(meta_name).decode()
    fields = {"requires": []}
    for line in meta.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(": ")
        if key == "Name":
            fields["name"] = value.strip()
        elif key == "Version":
            fields["version"] = value.strip()
        elif key == "Requires-Dist":
            fields["requires"].append(value.strip())
    tops = set()
    for n in names:
        head = n.split("/", 1)[0]
        if head.endswith((".dist-info", ".data")) or head.startswith("__"):
            continue
        if "/" in n:
            tops.add(head)
        elif n.endswith(".py"):
            tops.add(n[:-3])
        elif n.endswith(".so"):
            tops.add(n.split(".", 1)[0])
    fields["modules"] = sorted(t for t in tops if t.isidentifier())
    return fields


def stale_files(wheel: Path, source: Path) -> list[str]:
    """Files of an omni wheel that differ from the tree at ``source`` (or that the tree has in the
    wheel's packages and the wheel lacks): the wheel was built from other code."""
    out = []
    with zipfile.ZipFile(wheel) as zf:
        packaged = {n for n in zf.namelist() if ".dist-info/" not in n and not n.endswith("/")}
        for name in sorted(packaged):
            here = source / name
            if not here.is_file() or here.read_bytes() != zf.read(name):
                out.append(name)
        for top in {n.split("/", 1)[0] for n in packaged if "/" in n}:
            for path in (source / top).rglob("*"):
                rel = path.relative_to(source).as_posix()
                if path.is_file() and "__pycache__" not in rel and path.suffix in (".py", ".yaml", ".json", ".html", ".js", ".css", ".toml") \
                        and rel not in packaged:
                    out.append(rel)
    return out


def omni_wheel(folder: Path, dist: str) -> Path | None:
    found = sorted(folder.glob(f"{dist.replace('-', '_')}-*.whl"))
    return found[-1] if found else None


def check_requirements(dists: dict[str, dict], installed, env: dict[str, str]) -> list[str]:
    """Every runtime requirement of ``dists`` (name -> wheel_metadata) and of the kit, met by
    ``installed(name) -> version or None``; the problems, one line each (empty: complete)."""
    Requirement, Version, _ = packaging()
    problems = []
    wanted = [(d["name"], req) for d in dists.values() for req in runtime_requirements(d["requires"], env)]
    wanted += [("gpu kit", Requirement(text)) for text in [*KIT_REQUIREMENTS, "transformers>=5.24"]]
    for who, req in wanted:
        have = installed(canonical(req.name))
        if have is None:
            problems.append(f"{who} needs {req}: not installed")
        elif req.specifier and not req.specifier.contains(Version(have), prereleases=True):
            problems.append(f"{who} needs {req}: {have} is installed")
    return problems


def needed(wanted: list[str], resolved: dict[str, dict], env: dict[str, str]) -> tuple[set[str], set[str]]:
    """What ``wanted`` (requirement strings) needs of ``resolved`` (name -> {"requires"}), not
    walking into what the GPU machine provides: a package that needs torch (silero-vad) does not
    bring torch's own dependencies along. ``(names to ship, names left to the machine)``."""
    Requirement, *_ = packaging()
    todo = [(canonical(Requirement(w).name), frozenset(Requirement(w).extras)) for w in wanted]
    seen: set = set()
    reach: set[str] = set()
    left: set[str] = set()
    while todo:
        name, extras = todo.pop()
        if name in PROVIDED or NEVER.match(name):
            left.add(name)
            continue
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        if name not in resolved:
            raise KeyError(f"pip's resolution has no {name}, which the requirements name")
        reach.add(name)
        for text in resolved[name]["requires"]:
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in {"", *extras}):
                todo.append((canonical(req.name), frozenset(req.extras)))
    return reach, left


# -- GPU tests -------------------------------------------------------------------------------------

#: A line that marks tests ``cuda`` (a decorator, ``pytestmark = [...]`` or an item of it on a line of
#: its own, ``needs_two = pytest.mark.cuda(...)``) or calls ``require_cuda``; the same text inside
#: strings or comments does not count.
GPU_MARK = re.compile(r"^\s*(@?pytest\.mark\.cuda\b|\w+\s*=\s*(\[.*)?pytest\.mark\.cuda\b|(\w+\.)*require_cuda\()", re.M)


def gpu_test_files(root: Path = ROOT) -> dict[str, list[str]]:
    """distribution -> its test files (relative to the root) that hold GPU tests: those marked
    ``cuda`` (``@pytest.mark.cuda``, ``pytestmark = pytest.mark.cuda``) or calling ``require_cuda``."""
    out = {}
    for dist, (_, _, tests, _) in DISTS.items():
        folder = root / tests
        files = sorted(p for p in folder.glob("test_*.py") if GPU_MARK.search(p.read_text()))
        out[dist] = [p.relative_to(root).as_posix() for p in files]
    return out


def pytest_command(python: str, dist: str, files: list[str], junit: Path, root: Path = ROOT) -> tuple[list[str], Path]:
    """The pytest command line that runs ``dist``'s GPU tests (``-m cuda``) and where it runs.
    Plugins of the machine's own pytest are not loaded (their versions are unknown); pytest-timeout
    is named explicitly, and every skip is reported with its reason."""
    cwd = root / DISTS[dist][3]
    rel = [str((root / f).relative_to(cwd)) if cwd != root else f for f in files]
    return [python, "-m", "pytest", "-p", "pytest_timeout", "-p", "no:cacheprovider", "-m", "cuda", "-rfEs",
            "-o", "junit_family=xunit2", f"--junitxml={junit}", *rel], cwd


def read_junit(path: Path) -> list[dict]:
    """One ``{"test", "outcome", "seconds", "message"}`` per test case of a junit XML file."""
    import xml.etree.ElementTree as ET

    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (node.get("message") or node.text or "").strip()
                break
        name = f"{case.get('classname', '')}::{case.get('name', '')}".lstrip(":")
        cases.append({"test": name, "outcome": outcome, "seconds": float(case.get("time") or 0), "message": message[:2000]})
    return cases


def junit_properties(path: Path) -> dict[str, str]:
    """The properties the tests of a junit XML file recorded for their suite (pytest's
    ``record_testsuite_property``, the one kind xunit2 keeps): name -> value, in order."""
    import xml.etree.ElementTree as ET

    out = {}
    for suite in ET.parse(path).getroot().iter("testsuite"):
        props = suite.find("properties")
        for prop in props.iter("property") if props is not None else ():
            out[prop.get("name", "")] = prop.get("value", "")
    return out


def git_commit() -> dict:
    def git(*args):
        try:
            out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(status) if status is not None else None}


def read_manifest(folder: Path = WHEELS) -> dict:
    path = folder / MANIFEST
    if not path.is_file():
        raise SystemExit(f"{path} is missing: run gpu/prepare on a machine with pip and a package index first")
    return json.loads(path.read_text())


def say(message: str) -> None:
    print(message, flush=True)


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(1)

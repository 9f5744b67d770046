"""The GPU kit on a CPU machine: ``OMNI_REQUIRE_CUDA`` turning GPU skips into failures (one GPU
promised: two-GPU tests still skip, saying why), and gpu/check's test selection, result reading,
requirement check and stale-wheel detection (gpu/kit.py)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from omni_core.testing.cuda import cuda_decision, required_devices

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def kit():
    spec = importlib.util.spec_from_file_location("omni_gpu_kit", ROOT / "gpu" / "kit.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("devices,have,required,expected", [
    (1, 1, 0, None), (1, 1, 1, None), (2, 2, 1, None),
    (1, 0, 0, ("skip", "needs 1 CUDA device, found 0")),
    (1, 0, 1, ("fail", "needs 1 CUDA device, found 0, and OMNI_REQUIRE_CUDA=1 is set")),
    (2, 1, 1, ("skip", "needs 2 CUDA devices, found 1")),
    (2, 0, 1, ("skip", "needs 2 CUDA devices, found 0")),
    (2, 1, 2, ("fail", "needs 2 CUDA devices, found 1, and OMNI_REQUIRE_CUDA=2 is set")),
])
def test_what_a_gpu_test_does_for_each_machine_and_promise(devices, have, required, expected):
    assert cuda_decision(devices, have, required) == expected


def test_the_reason_given_in_the_marker_is_in_the_message():
    assert cuda_decision(2, 1, 1, "NCCL needs a GPU per rank") == ("skip", "needs 2 CUDA devices, found 1 (NCCL needs a GPU per rank)")


@pytest.mark.parametrize("value,expected", [("", 0), ("0", 0), ("1", 1), (" 2 ", 2)])
def test_required_devices_reads_the_variable(monkeypatch, value, expected):
    monkeypatch.setenv("OMNI_REQUIRE_CUDA", value)
    assert required_devices() == expected


@pytest.mark.parametrize("value", ["yes", "-1", "1.5"])
def test_a_bad_value_is_an_error_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("OMNI_REQUIRE_CUDA", value)
    with pytest.raises(ValueError, match="OMNI_REQUIRE_CUDA=.*number of CUDA devices"):
        required_devices()


SUITE = {
    "conftest.py": (
        "import os\n"
        "import omni_core.testing.cuda as cuda\n"
        "from omni_core.testing.cuda import pytest_configure, pytest_runtest_setup  # noqa: F401\n"
        "cuda.cuda_devices = lambda: int(os.environ.get('FAKE_CUDA_DEVICES', '0'))\n"
    ),
    "test_suite.py": (
        "import pytest\n"
        "@pytest.mark.cuda\n"
        "def test_one_gpu():\n    pass\n"
        "@pytest.mark.cuda(devices=2, reason='NCCL needs a GPU per rank')\n"
        "def test_two_gpus():\n    pass\n"
        "def test_cpu():\n    pass\n"
    ),
}


def run_suite(tmp_path: Path, kit, devices: int, require: str | None) -> dict[str, tuple[str, str]]:
    for name, text in SUITE.items():
        (tmp_path / name).write_text(text)
    junit = tmp_path / f"junit-{devices}-{require}.xml"
    env = {k: v for k, v in os.environ.items() if k != "OMNI_REQUIRE_CUDA"}
    env.update(FAKE_CUDA_DEVICES=str(devices), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    if require is not None:
        env["OMNI_REQUIRE_CUDA"] = require
    subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={junit}", "test_suite.py"],
                   cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    return {c["test"].rsplit("::", 1)[1]: (c["outcome"], c["message"]) for c in kit.read_junit(junit)}


def test_without_the_variable_gpu_tests_skip_on_a_machine_without_cuda(tmp_path, kit):
    got = run_suite(tmp_path, kit, 0, None)
    assert got["test_one_gpu"] == ("skipped", "needs 1 CUDA device, found 0")
    assert got["test_two_gpus"][0] == "skipped" and got["test_cpu"][0] == "passed"


def test_under_omni_require_cuda_1_a_one_gpu_test_without_cuda_fails(tmp_path, kit):
    got = run_suite(tmp_path, kit, 0, "1")
    # failed in its setup: an error, which gpu/check counts as a failure
    assert got["test_one_gpu"][0] == "error" and "OMNI_REQUIRE_CUDA=1 is set" in got["test_one_gpu"][1]
    assert got["test_two_gpus"] == ("skipped", "needs 2 CUDA devices, found 0 (NCCL needs a GPU per rank)")


def test_on_one_gpu_two_gpu_tests_are_skipped_with_their_reason(tmp_path, kit):
    got = run_suite(tmp_path, kit, 1, "1")
    assert got["test_one_gpu"][0] == "passed"
    assert got["test_two_gpus"] == ("skipped", "needs 2 CUDA devices, found 1 (NCCL needs a GPU per rank)")


# -- gpu/check's selection and bookkeeping ----------------------------------------------------------


def test_the_gpu_test_files_are_those_with_a_cuda_mark_or_require_cuda(tmp_path, kit):
    for rel, text in {
        "tests/test_marked.py": "@pytest.mark.cuda\ndef test_x(): pass\n",
        "tests/test_module.py": "pytestmark = [pytest.mark.timeout(5), pytest.mark.cuda(devices=2)]\n",
        "tests/test_inside.py": "def test_x():\n    require_cuda(1)\n",
        "tests/test_cpu.py": "def test_cuda_is_mentioned_in_a_name(): pass  # pytest.mark.cuda\n",
        "tests/test_strings.py": "SUITE = {'t.py': '@pytest.mark.cuda', 'u.py': 'require_cuda(2)'}\n",
        "tests/helpers.py": "@pytest.mark.cuda\n",
        "plugins/omni-cuda-ipc/tests/test_relay.py": "pytestmark = pytest.mark.cuda(reason='x')\n",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    files = kit.gpu_test_files(tmp_path)
    assert files["omni-core"] == ["tests/test_inside.py", "tests/test_marked.py", "tests/test_module.py"]
    assert files["omni-cuda-ipc"] == ["plugins/omni-cuda-ipc/tests/test_relay.py"]
    assert files["omni-contrib-stages"] == [] and files["omni-nccl"] == []


def test_the_tree_s_gpu_tests_are_selected_and_cpu_only_modules_are_not(kit):
    files = kit.gpu_test_files()
    assert {"tests/test_gpu_runtime.py", "tests/test_relay_shm.py"} <= set(files["omni-core"])
    assert "tests/test_placement.py" not in files["omni-core"]
    assert "tests/test_gpu_kit.py" not in files["omni-core"], "marks inside strings do not count"
    assert "contrib_stages/tests/test_demo_gpu.py" in files["omni-contrib-stages"]
    assert files["omni-transformers"] == ["plugins/omni-transformers/tests/test_families_gpu.py"]
    assert "plugins/omni-cuda-ipc/tests/test_cuda_ipc_conformance.py" in files["omni-cuda-ipc"]
    assert "omni-ray" not in files, "omni-ray does not travel to the GPU machine"


def test_the_pytest_command_runs_the_cuda_marker_only_with_timeouts_and_skip_reasons(tmp_path, kit):
    cmd, cwd = kit.pytest_command("python3", "omni-contrib-stages", ["contrib_stages/tests/test_demo_gpu.py"], tmp_path / "j.xml")
    assert cwd == ROOT / "contrib_stages" and cmd[-1] == "tests/test_demo_gpu.py"
    assert cmd[cmd.index("-m", 2) + 1] == "cuda" and "pytest_timeout" in cmd and "-rfEs" in cmd
    cmd, cwd = kit.pytest_command("python3", "omni-core", ["tests/test_gpu_runtime.py"], tmp_path / "j.xml")
    assert cwd == ROOT and cmd[-1] == "tests/test_gpu_runtime.py"


def test_requirements_missing_or_too_old_are_named(kit):
    dists = {"omni-x": {"name": "omni-x", "requires": ["pyzmq>=25", "msgspec>=0.18", "tomli>=2; python_version<'3.11'"]}}
    have = {"pyzmq": "24.0", "transformers": "5.25.0", "pytest": "9.0", "pytest-timeout": "2.4.0"}
    problems = kit.check_requirements(dists, have.get, kit.machine_environment())
    assert problems == ["omni-x needs pyzmq>=25: 24.0 is installed", "omni-x needs msgspec>=0.18: not installed"]
    have["transformers"] = "5.17.0"
    assert "gpu kit needs transformers>=5.24: 5.17.0 is installed" in kit.check_requirements({}, have.get, kit.machine_environment())


def test_a_wheel_built_from_other_code_is_stale(tmp_path, kit):
    tree = tmp_path / "tree"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "__init__.py").write_text("A = 1\n")
    (tree / "pkg" / "data.yaml").write_text("a: 1\n")
    wheel = tmp_path / "pkg-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("pkg/__init__.py", "A = 1\n")
        zf.writestr("pkg/data.yaml", "a: 1\n")
        zf.writestr("pkg-0.1.0.dist-info/METADATA", "Name: pkg\nVersion: 0.1.0\n")
    assert kit.stale_files(wheel, tree) == []
    (tree / "pkg" / "__init__.py").write_text("A = 2\n")
    (tree / "pkg" / "new.py").write_text("")
    assert kit.stale_files(wheel, tree) == ["pkg/__init__.py", "pkg/new.py"]


def test_what_only_the_machine_s_packages_need_is_not_shipped(kit):
    resolved = {
        "silero-vad": {"requires": ["packaging", "torch>=1.12", "onnxruntime>=1.16; extra == 'onnx-cpu'"]},
        "packaging": {"requires": []},
        "torch": {"requires": ["sympy", "nvidia-cudnn-cu13==9.24"]},
        "sympy": {"requires": ["mpmath"]},
        "mpmath": {"requires": []},
        "uvicorn": {"requires": ["click>=7", "h11>=0.8", "uvloop; sys_platform == 'win32'", "websockets; extra == 'standard'"]},
        "click": {"requires": []}, "h11": {"requires": []}, "websockets": {"requires": []},
    }
    reach, left = kit.needed(["silero-vad>=5.1", "uvicorn[standard]>=0.30"], resolved, kit.machine_environment())
    assert reach == {"silero-vad", "packaging", "uvicorn", "click", "h11", "websockets"}
    assert left == {"torch"}


def gpu_check():
    """gpu/check as a module (it has no .py suffix)."""
    from importlib.machinery import SourceFileLoader

    sys.path.insert(0, str(ROOT / "gpu"))  # gpu/check imports kit from beside it
    loader = SourceFileLoader("omni_gpu_check", str(ROOT / "gpu" / "check"))
    spec = importlib.util.spec_from_loader("omni_gpu_check", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def test_the_dry_run_installs_what_the_collected_distributions_require_and_the_venv_lacks_never_torch(tmp_path):
    """The dry run collects the GPU tests of every distribution with the README's venv, which has
    only omni-core and omni-contrib-stages: it installs the rest (and what they require that the
    venv lacks) into a folder of its own. Which requirements: a distribution's and its [test]
    extra's that nothing installed satisfies, never torch."""
    check = gpu_check()
    info = tmp_path / "site" / "omnitest_needs-1.0.dist-info"
    info.mkdir(parents=True)
    info.joinpath("METADATA").write_text(
        "Metadata-Version: 2.1\nName: omnitest-needs\nVersion: 1.0\n"
        "Requires-Dist: torch>=99\nRequires-Dist: pytest>=1\nRequires-Dist: omnitest-absent>=2\n"
        "Requires-Dist: pytest>=999 ; extra == 'docs'\nRequires-Dist: omnitest-absent-test ; extra == 'test'\n")
    found = subprocess.run([sys.executable, "-c", check.MISSING_REQUIREMENTS, "omnitest-needs"], capture_output=True,
                           text=True, env=check.site_env(tmp_path / "site"), timeout=120)
    assert found.returncode == 0, found.stderr
    assert found.stdout.split() == ["omnitest-absent>=2", "omnitest-absent-test"]


def test_the_families_gpu_tests_are_collected_and_skip_without_cuda_or_fail_when_promised(tmp_path, kit):
    """What gpu/check and its dry run do with omni-transformers' GPU tests here: collect the three (-m cuda),
    and run them: skipped without CUDA, failed (errors) under OMNI_REQUIRE_CUDA=1, before writing anything."""
    check = gpu_check()
    [name] = kit.gpu_test_files()["omni-transformers"]
    rc, ids, out = check.collect(sys.executable, ROOT, [name])
    assert rc == 0, out
    assert {i.rsplit("::", 1)[1] for i in ids} == {
        "test_qwen3_omni_tiny_in_bfloat16_equals_generate_and_8_at_once_equal_alone",
        "test_qwen3_omni_of_realistic_size_answers_one_spoken_request",
        "test_qwen2_5_omni_tiny_in_bfloat16_equals_generate_and_8_at_once_equal_alone"}
    if torch_cuda():
        pytest.skip("this machine has CUDA: the tests would run")
    outcomes = {}
    for require in (None, "1"):
        junit = tmp_path / f"junit-{require}.xml"
        cmd, cwd = kit.pytest_command(sys.executable, "omni-transformers", [name], junit)
        env = {k: v for k, v in os.environ.items() if k != "OMNI_REQUIRE_CUDA"}
        env.update(PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", **({"OMNI_REQUIRE_CUDA": require} if require else {}))
        subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
        outcomes[require] = {(c["outcome"], c["message"].splitlines()[0]) for c in kit.read_junit(junit)}
    assert outcomes[None] == {("skipped", "needs 1 CUDA device, found 0 (the families' GPU pipelines in bfloat16)")}
    [(outcome, message)] = outcomes["1"]  # failed in setup: an error, which gpu/check counts as a failure
    assert outcome == "error" and "needs 1 CUDA device, found 0 (the families' GPU pipelines in bfloat16), and " \
        "OMNI_REQUIRE_CUDA=1 is set" in message


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_numbers_the_tests_record_for_their_suite_reach_the_results(tmp_path, kit):
    """gpu/check's junit is xunit2, which keeps only the suite's properties: what a test records there
    (record_testsuite_property) is read back with the test's results."""
    (tmp_path / "test_numbers.py").write_text(
        "def test_a(record_testsuite_property):\n"
        "    record_testsuite_property('test_a.first_audio_s', 0.25)\n"
        "    record_testsuite_property('test_a.tokens', 12)\n")
    junit = tmp_path / "j.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-o", "junit_family=xunit2",
                    f"--junitxml={junit}", "test_numbers.py"], cwd=tmp_path, capture_output=True, timeout=120,
                   env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert kit.junit_properties(junit) == {"test_a.first_audio_s": "0.25", "test_a.tokens": "12"}
    markdown = gpu_check().markdown({"started": "2026-12-07T10:00:00+00:00", "tests": {"omni-transformers": {
        "status": "ok", "seconds": 1.0, "counts": {"passed": 1, "failed": 0, "error": 0, "skipped": 0},
        "cases": [], "recorded": kit.junit_properties(junit)}}})
    assert "- omni-transformers: `test_a.first_audio_s` = 0.25" in markdown


def test_dist_runs_only_the_named_distributions_tests_within_their_caps():
    check = gpu_check()
    lines: list[str] = []
    files = check.plan(lines.append, ["omni-transformers"])
    assert files["omni-transformers"] == ["plugins/omni-transformers/tests/test_families_gpu.py"]
    assert all(not names for dist, names in files.items() if dist != "omni-transformers")
    assert "  omni-core: not run (not named by --dist)" in lines
    assert check.tests_limit(["omni-transformers"]) == check.TEST_CAPS["omni-transformers"]
    assert check.tests_limit(None) == check.PHASES["tests"]


def test_omni_s_wheels_are_built_from_copies_without_build_leftovers(tmp_path):
    """setuptools never empties build/lib: a module deleted from the tree would still be in a wheel built in
    place. gpu/prepare builds from copies of the source folders without build/ and the like."""
    from importlib.machinery import SourceFileLoader

    sys.path.insert(0, str(ROOT / "gpu"))
    loader = SourceFileLoader("omni_gpu_prepare", str(ROOT / "gpu" / "prepare"))
    spec = importlib.util.spec_from_loader("omni_gpu_prepare", loader)
    prepare = importlib.util.module_from_spec(spec)
    loader.exec_module(prepare)
    copies = {p.name: p for p in prepare.clean_sources(tmp_path)}
    assert set(copies) == set(prepare.kit.DISTS)
    for dist, copy in copies.items():
        left = [p for p in copy.rglob("*") if p.name in ("build", "__pycache__") or p.name.endswith(".egg-info")]
        assert not left, f"{dist}: {left[:3]}"
        assert (copy / "pyproject.toml").is_file()
    root = copies["omni-core"]
    assert (root / "omni_core" / "__init__.py").is_file()
    assert not (root / "plugins").exists() and not (root / "contrib_stages").exists()
    assert (copies["omni-transformers"] / "omni_transformers" / "qwen3_omni" / "tiny.py").read_bytes() == \
        (ROOT / "plugins/omni-transformers/omni_transformers/qwen3_omni/tiny.py").read_bytes()

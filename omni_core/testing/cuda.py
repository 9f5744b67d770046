"""GPU tests that skip without CUDA, or fail under ``OMNI_REQUIRE_CUDA=1``.

Mark a test (or a module, with ``pytestmark``) ``@pytest.mark.cuda`` or
``@pytest.mark.cuda(devices=2)``. Where the machine has that many CUDA devices the test runs;
where it has not, the test is skipped, unless ``OMNI_REQUIRE_CUDA=1`` is set: then it fails, so a
run on a GPU machine can never pass by skipping its GPU tests. Inside a test or fixture,
:func:`require_cuda` does the same check.

Enable it in a test suite's ``conftest.py``::

    from omni_core.testing.cuda import pytest_configure, pytest_runtest_setup  # noqa: F401

Importing this module does not import torch (it is loaded when a marked test runs).
"""

from __future__ import annotations

import os

REQUIRE_ENV = "OMNI_REQUIRE_CUDA"


def cuda_required() -> bool:
    """Whether ``OMNI_REQUIRE_CUDA=1``: missing CUDA fails GPU tests instead of skipping them."""
    return os.environ.get(REQUIRE_ENV, "").strip() == "1"


def cuda_devices() -> int:
    """How many CUDA devices this process can use (0 without a CUDA build of torch)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def require_cuda(devices: int = 1, why: str = "") -> None:
    """Skip the running test unless ``devices`` CUDA devices are usable; fail instead under
    ``OMNI_REQUIRE_CUDA=1``."""
    import pytest

    have = cuda_devices()
    if have >= devices:
        return
    text = f"needs {devices} CUDA device{'s' if devices != 1 else ''}, found {have}"
    if why:
        text += f" ({why})"
    if cuda_required():
        pytest.fail(f"{text}, and {REQUIRE_ENV}=1 is set", pytrace=False)
    pytest.skip(text)


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        f"cuda(devices=1, reason=''): needs CUDA devices; skipped without them, failed under {REQUIRE_ENV}=1",
    )


def pytest_runtest_setup(item) -> None:
    marks = list(item.iter_markers(name="cuda"))
    if not marks:
        return
    devices = max(int(m.kwargs.get("devices", m.args[0] if m.args else 1)) for m in marks)
    reason = next((m.kwargs["reason"] for m in marks if m.kwargs.get("reason")), "")
    require_cuda(devices, reason)

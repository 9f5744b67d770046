"""GPU tests that skip without CUDA, or fail under ``OMNI_REQUIRE_CUDA=1``.

Mark a test (or a module, with ``pytestmark``) ``@pytest.mark.cuda`` or
``@pytest.mark.cuda(devices=2)``. Where the machine has that many CUDA devices the test runs;
where it has not, the test is skipped, unless ``OMNI_REQUIRE_CUDA`` says the machine must have
them: then it fails, so a run on a GPU machine can never pass by skipping its GPU tests.

``OMNI_REQUIRE_CUDA=N`` (N >= 1) declares that the machine has N CUDA devices: a test that needs
at most N devices and finds fewer fails; a test that needs more than N is skipped, its reason
naming how many it needs (``OMNI_REQUIRE_CUDA=1`` on a one-GPU machine runs every one-GPU test
and reports each two-GPU test as skipped, "needs 2 CUDA devices, found 1"). Unset, empty or 0:
every GPU test without its devices is skipped. Inside a test or fixture, :func:`require_cuda`
does the same check.

Enable it in a test suite's ``conftest.py``::

    from omni_core.testing.cuda import pytest_configure, pytest_runtest_setup  # noqa: F401

Importing this module does not import torch (it is loaded when a marked test runs).
"""

from __future__ import annotations

import os

REQUIRE_ENV = "OMNI_REQUIRE_CUDA"


def required_devices() -> int:
    """How many CUDA devices ``OMNI_REQUIRE_CUDA`` says this machine has (0: none required).

    A value that is not a whole number >= 0 is an error naming the variable."""
    value = os.environ.get(REQUIRE_ENV, "").strip()
    if not value:
        return 0
    try:
        count = int(value)
    except ValueError:
        count = -1
    if count < 0:
        raise ValueError(f"{REQUIRE_ENV}={value!r}: expected the number of CUDA devices this machine must have "
                         f"(1 on a one-GPU machine; 0 or unset to skip GPU tests without CUDA)")
    return count


def cuda_required() -> bool:
    """Whether ``OMNI_REQUIRE_CUDA`` is set to 1 or more: missing CUDA fails GPU tests instead of
    skipping them."""
    return required_devices() > 0


def cuda_devices() -> int:
    """How many CUDA devices this process can use (0 without a CUDA build of torch)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def require_cuda(devices: int = 1, why: str = "") -> None:
    """Skip the running test unless ``devices`` CUDA devices are usable; fail instead when
    ``OMNI_REQUIRE_CUDA`` promises at least ``devices`` of them (see the module's docstring)."""
    import pytest

    decision = cuda_decision(devices, cuda_devices(), required_devices(), why)
    if decision is None:
        return
    action, text = decision
    if action == "fail":
        pytest.fail(text, pytrace=False)
    pytest.skip(text)


def cuda_decision(devices: int, have: int, required: int, why: str = "") -> tuple[str, str] | None:
    """What a test needing ``devices`` CUDA devices does on a machine with ``have`` of them when
    ``OMNI_REQUIRE_CUDA`` is ``required``: None (it runs), ``("skip", reason)`` or
    ``("fail", reason)``."""
    if have >= devices:
        return None
    text = f"needs {devices} CUDA device{'s' if devices != 1 else ''}, found {have}"
    if why:
        text += f" ({why})"
    if required and devices <= required:
        return "fail", f"{text}, and {REQUIRE_ENV}={required} is set"
    return "skip", text


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        f"cuda(devices=1, reason=''): needs CUDA devices; skipped without them, failed under {REQUIRE_ENV}=N (N >= devices)",
    )


def pytest_runtest_setup(item) -> None:
    marks = list(item.iter_markers(name="cuda"))
    if not marks:
        return
    devices = max(int(m.kwargs.get("devices", m.args[0] if m.args else 1)) for m in marks)
    reason = next((m.kwargs["reason"] for m in marks if m.kwargs.get("reason")), "")
    require_cuda(devices, reason)

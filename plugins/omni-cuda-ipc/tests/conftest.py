"""Shared test configuration: the ``cuda`` marker (skip without CUDA, fail under OMNI_REQUIRE_CUDA=1)."""

from omni_core.testing.cuda import pytest_configure, pytest_runtest_setup  # noqa: F401

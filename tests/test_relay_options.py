"""Which options a relay instance gets from the pipeline's and the stages' ``relay:`` configs."""

from __future__ import annotations

from omni_core.config.schema import RelayConfig
from omni_core.runtime.edges import relay_options


def test_a_forced_backend_gets_its_options():
    assert relay_options(RelayConfig(backend="shm", options={"slots": 4}), "shm") == {"slots": 4}
    assert relay_options(RelayConfig(backend="shm", options={"slots": 4}), "inline") == {}


def test_under_auto_options_are_keyed_by_relay_name():
    cfg = RelayConfig(backend="auto", options={"shm": {"slots": 8}, "nccl": {"timeout": 5}})
    assert relay_options(cfg, "shm") == {"slots": 8}
    assert relay_options(cfg, "nccl") == {"timeout": 5}
    assert relay_options(cfg, "inline") == {}

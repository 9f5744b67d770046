"""omni: serve multi-stage model pipelines as a set of OS processes, extended by plugins.

Public API::

    import omni_core

    @omni_core.hookimpl
    def omni_register_stages(register):
        register("acme.upper", Upper, description="upper-cases text")

    cfg = omni_core.load_config("pipeline.yaml")
"""

from __future__ import annotations

from ._version import __version__
from .config import PipelineConfig, StageConfig, load_config
from .errors import (
    ConfigError,
    InvalidInput,
    OmniError,
    Overloaded,
    PluginError,
    ProcessDied,
    ProcessHung,
    RequestAborted,
    StageError,
    StartupError,
)
from .plugins import hookimpl

# The runtime imports torch and zmq; load it only when used, so `omni plugins list`, `omni
# validate` and plugin modules that only register names stay fast.
_LAZY = {
    "DecodeLoop": "omni_core.kits",
    "Event": "omni_core.runtime.requests",
    "MicroBatcher": "omni_core.kits",
    "PENDING": "omni_core.runtime.context",
    "PayloadError": "omni_core.relay.payload",
    "Pipeline": "omni_core.runtime.pipeline",
    "StageContext": "omni_core.runtime.context",
    "SyncPipeline": "omni_core.runtime.sync",
    "run": "omni_core.runtime.pipeline",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'omni_core' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

__all__ = [
    "DecodeLoop",
    "Event",
    "MicroBatcher",
    "PENDING",
    "PayloadError",
    "Pipeline",
    "StageContext",
    "SyncPipeline",
    "run",
    "ConfigError",
    "InvalidInput",
    "OmniError",
    "Overloaded",
    "PipelineConfig",
    "PluginError",
    "ProcessDied",
    "ProcessHung",
    "RequestAborted",
    "StageConfig",
    "StageError",
    "StartupError",
    "__version__",
    "hookimpl",
    "load_config",
]

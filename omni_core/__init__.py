"""omni: serve multi-stage model pipelines as a set of OS processes, extended by plugins.

Public API::

    import omni_core

    @omni_core.hookimpl
    def omni_register_stages(register):
        register("acme.upper", Upper, description="upper-cases text")

    cfg = omni_core.load_config("pipeline.yaml")
"""

from __future__ import annotations

__version__ = "0.1.0"

from .config import PipelineConfig, StageConfig, load_config
from .errors import (
    ConfigError,
    OmniError,
    Overloaded,
    PluginError,
    ProcessDied,
    RequestAborted,
    StageError,
    StartupError,
)
from .plugins import hookimpl
from .runtime.context import StageContext
from .runtime.pipeline import Pipeline, run
from .runtime.requests import Event

__all__ = [
    "Event",
    "Pipeline",
    "StageContext",
    "run",
    "ConfigError",
    "OmniError",
    "Overloaded",
    "PipelineConfig",
    "PluginError",
    "ProcessDied",
    "RequestAborted",
    "StageConfig",
    "StageError",
    "StartupError",
    "__version__",
    "hookimpl",
    "load_config",
]

"""Pipeline configuration: the schema, loading from files or mappings, whole-graph validation."""

from .load import load_config, read_config_file, structure, to_dict
from .schema import (
    EndpointsConfig,
    LauncherConfig,
    LimitsConfig,
    PipelineConfig,
    PlacementConfig,
    RelayConfig,
    RestartConfig,
    RetryConfig,
    ServeConfig,
    StageConfig,
)
from .validate import collect_issues, validate_config

__all__ = [
    "EndpointsConfig",
    "LauncherConfig",
    "LimitsConfig",
    "PipelineConfig",
    "PlacementConfig",
    "RelayConfig",
    "RestartConfig",
    "RetryConfig",
    "ServeConfig",
    "StageConfig",
    "collect_issues",
    "load_config",
    "read_config_file",
    "structure",
    "to_dict",
    "validate_config",
]

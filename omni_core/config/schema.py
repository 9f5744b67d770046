"""The pipeline configuration schema: attrs classes, one per section.

Field names are what users write in YAML/TOML; the reference in ``docs/config.md`` is tested
against these classes so the two cannot drift. Every class is frozen: a loaded config is a value.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs

#: Arguments omni passes to a stage factory that declares them, never read from ``args``; their
#: values come from :meth:`omni_core.plan.topology.ProcessSpec.injected_args`.
INJECTED_ARGS = ("stage_name", "device", "gpu_id", "tp_rank", "tp_size", "tp_init_method")

#: The reserved stage name ``stream_to`` uses for the request's caller: a stage with
#: ``stream_to: [caller]`` streams its chunks straight to the caller (as a terminal stage does).
CALLER_STAGE = "caller"

#: Field metadata read by the validator: the range a value must be in (checked with its config path).
POSITIVE = {"check": "positive"}
NON_NEGATIVE = {"check": "non_negative"}


@attrs.frozen(kw_only=True)
class RelayConfig:
    """Which relay moves tensors on an edge. ``relay: shm`` is short for ``relay: {backend: shm}``.

    ``auto`` picks per edge: same process → object passing; otherwise the best installed relay
    that can move the data."""

    backend: str = "auto"
    options: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class PlacementConfig:
    """How stages are put on GPUs. ``gpus`` simulates that many devices (planning without GPUs);
    ``memory_per_gpu`` is the budget strategies fill (bytes; default: the device's memory)."""

    strategy: str = "explicit"
    gpus: int | None = attrs.field(default=None, metadata=POSITIVE)
    memory_per_gpu: int | None = attrs.field(default=None, metadata=POSITIVE)
    options: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class LauncherConfig:
    """What starts the stage processes. ``launcher: local`` is short for ``{name: local}``."""

    name: str = "local"
    options: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class EndpointsConfig:
    """Where the control plane listens. ``ipc_dir``: parent of the private runtime dir (default:
    the system temp dir). ``host``/``port_range``: tcp endpoints for multi-node launchers."""

    ipc_dir: str | None = None
    host: str = "127.0.0.1"
    port_range: tuple[int, int] | None = None


@attrs.frozen(kw_only=True)
class LimitsConfig:
    """Bounds that keep a pipeline from hanging or growing without limit (seconds, counts)."""

    max_in_flight: int = attrs.field(default=1024, metadata=POSITIVE)
    startup_timeout: float = attrs.field(default=120.0, metadata=POSITIVE)
    request_timeout: float | None = attrs.field(default=300.0, metadata=POSITIVE)
    stop_timeout: float = attrs.field(default=10.0, metadata=POSITIVE)
    stream_buffer: int = attrs.field(default=64, metadata=POSITIVE)
    stream_stall_timeout: float = attrs.field(default=60.0, metadata=POSITIVE)
    heartbeat_interval: float = attrs.field(default=1.0, metadata=POSITIVE)
    heartbeat_timeout: float = attrs.field(default=10.0, metadata=POSITIVE)
    loop_block_warning: float = attrs.field(default=2.0, metadata=POSITIVE)


@attrs.frozen(kw_only=True)
class RestartConfig:
    """What happens when a stage process dies: ``never`` stops the pipeline (default);
    ``on-failure`` restarts that process group, at most ``max_restarts`` times."""

    policy: Literal["never", "on-failure"] = "never"
    max_restarts: int = attrs.field(default=3, metadata=NON_NEGATIVE)


#: The errors a request may be retried after: its process died or hung (it is restarted).
RETRYABLE_ERRORS: tuple[Literal["ProcessDied", "ProcessHung"], ...] = ("ProcessDied", "ProcessHung")


@attrs.frozen(kw_only=True)
class RetryConfig:
    """Whether a request whose attempt failed with one of the errors ``on`` is run again (with
    the same request id and inputs) once its process group is back: ``attempts`` is how many
    times it may run in all (1, the default: never again)."""

    attempts: int = attrs.field(default=1, metadata=POSITIVE)
    on: tuple[Literal["ProcessDied", "ProcessHung"], ...] = RETRYABLE_ERRORS


@attrs.frozen(kw_only=True)
class ServeConfig:
    """How ``omni serve`` serves the pipeline (ignored by ``omni run`` and the library)."""

    apis: tuple[str, ...] = ()
    options: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    #: The largest request body, in bytes, any route takes (core routes and APIs alike).
    max_request_bytes: int = attrs.field(default=16 * 1024 * 1024, metadata=POSITIVE)
    #: The directory requests over the network may name files in (``wav_path``, audio and image
    #: paths; resolved paths must stay inside it). None (the default): they may name no server file.
    allow_local_files: str | None = None


@attrs.frozen(kw_only=True)
class StageConfig:
    """One stage: what runs (``factory`` + ``args``), where its output goes, and where it runs."""

    name: str
    factory: str
    args: dict[str, Any] = attrs.field(factory=dict)
    # wiring
    next: tuple[str, ...] = ()
    route_fn: str | None = None
    terminal: bool = False
    wait_for: tuple[str, ...] = ()
    wait_for_fn: str | None = None
    merge_fn: str | None = None
    project_payload: dict[str, str] = attrs.field(factory=dict)
    stream_to: tuple[str, ...] = ()
    project_stream: dict[str, str] = attrs.field(factory=dict)
    stream_done_to_fn: str | None = None
    can_accept_stream_before_payload: bool = False
    # placement and processes
    tp_size: int = attrs.field(default=1, metadata=POSITIVE)
    gpu: tuple[int, ...] | None = None
    memory: float | None = attrs.field(default=None, metadata=POSITIVE)
    process: str | None = None
    replicas: int = attrs.field(default=1, metadata=POSITIVE)
    env: dict[str, str] = attrs.field(factory=dict)
    threads: int | None = attrs.field(default=None, metadata=POSITIVE)
    relay: RelayConfig | None = None
    max_concurrency: int = attrs.field(default=64, metadata=POSITIVE)
    #: Opaque to the core: passed to the launcher of the process hosting the stage, which checks it
    #: (e.g. ``{resources: {node_a: 1}, num_cpus: 1}`` for ``ray``).
    launch: dict[str, Any] = attrs.field(factory=dict)

    @property
    def is_fan_in(self) -> bool:
        return bool(self.wait_for)


@attrs.frozen(kw_only=True)
class PipelineConfig:
    """A whole pipeline: its stages and how they are wired, placed, launched and bounded."""

    name: str
    stages: tuple[StageConfig, ...]
    description: str | None = None
    entry_stage: str | None = None
    relay: RelayConfig = attrs.field(factory=RelayConfig)
    placement: PlacementConfig = attrs.field(factory=PlacementConfig)
    launcher: LauncherConfig = attrs.field(factory=LauncherConfig)
    env_defaults: dict[str, str] = attrs.field(factory=dict)
    terminal_stages_fn: str | None = None
    endpoints: EndpointsConfig = attrs.field(factory=EndpointsConfig)
    limits: LimitsConfig = attrs.field(factory=LimitsConfig)
    restart: RestartConfig = attrs.field(factory=RestartConfig)
    retry: RetryConfig = attrs.field(factory=RetryConfig)
    allow_cycles: bool = False
    allow_pickle: bool = False
    serve: ServeConfig = attrs.field(factory=ServeConfig)

    @property
    def entry(self) -> str:
        """The stage that receives the caller's inputs (``entry_stage``, else the first stage)."""
        return self.entry_stage or self.stages[0].name

    def stage(self, name: str) -> StageConfig:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(name)

    @property
    def stage_names(self) -> list[str]:
        return [s.name for s in self.stages]

    @property
    def terminal_stages(self) -> list[str]:
        return [s.name for s in self.stages if s.terminal]

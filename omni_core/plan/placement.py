"""Placement: which GPU (or the CPU) each process of each stage runs on. Pure functions, no I/O.

A placement strategy (registered through ``omni_register_placements``) receives a
:class:`PlacementRequest` and returns ``{stage: [gpu id or None, ...]}``: one entry per
tensor-parallel rank (every replica then uses the same GPUs) or one per replica and rank,
replica-major (``replicas * tp_size`` entries). :func:`place` runs the configured strategy,
normalises its answer to the second form and validates it with :func:`check_placement`.

Memory model (see ``docs/placement.md``):

- A stage's ``memory`` is what *one* of its processes (one replica, one TP rank) takes on its GPU:
  a value ≤ 1 is a fraction of the GPU's budget, a value > 1 is bytes.
- A GPU's budget is ``placement.memory_per_gpu`` when set, else the device's memory
  (:attr:`Device.memory`); a byte demand on a GPU whose memory is unknown is an error.
- A stage without ``memory`` counts as :data:`DEFAULT_MEMORY` of a GPU (override with
  ``placement.options.default_memory``, same units). Declared demands above a GPU's budget are an
  error; an overflow that only the default shares cause is a warning.
- Stages sharing a ``process`` are one unit: one GPU, their demands added up.
- With no device at all, the built-in strategies put every stage on the CPU.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from ..config.schema import PipelineConfig
from ..errors import ConfigError, ConfigIssue, PluginError
from ..registry import Registry

#: The share of a GPU a stage without ``memory`` counts as (``placement.options.default_memory``).
DEFAULT_MEMORY = 0.1
#: Slack when comparing sums of fractions with a budget.
EPS = 1e-9
GIB = 1 << 30

Placement = dict[str, tuple[int | None, ...]]


@attrs.frozen
class Device:
    """One GPU as placement sees it: its index (as the stage processes will see it before
    remapping) and its memory budget in bytes (None when unknown)."""

    index: int
    memory: int | None = None


@attrs.frozen
class StageDemand:
    """What one stage asks of placement. ``memory`` is per process (replica and rank)."""

    name: str
    tp_size: int = 1
    gpu: tuple[int, ...] | None = None
    memory: float | None = None
    process: str | None = None
    replicas: int = 1

    @property
    def group(self) -> str:
        """The process group the stage runs in (its ``process``, else its own name)."""
        return self.process or self.name


@attrs.frozen
class Group:
    """Stages that share one process (per replica and rank): placed as one unit. The first stage
    (the head) decides ``tp_size``, ``replicas`` and a pinned ``gpu``."""

    name: str
    stages: tuple[StageDemand, ...]

    @property
    def head(self) -> StageDemand:
        return self.stages[0]


@attrs.frozen
class PlacementRequest:
    """The input of a strategy: stages in config order, the devices, and the strategy's options."""

    stages: tuple[StageDemand, ...]
    devices: tuple[Device, ...]
    options: dict = attrs.field(factory=dict)

    def groups(self) -> list[Group]:
        """Process groups in the order of their first stage."""
        members: dict[str, list[StageDemand]] = {}
        for stage in self.stages:
            members.setdefault(stage.group, []).append(stage)
        return [Group(name, tuple(stages)) for name, stages in members.items()]

    def path(self, stage: str, field: str) -> str:
        """The config path of ``field`` of the stage named ``stage``."""
        index = next(i for i, s in enumerate(self.stages) if s.name == stage)
        return f"stages[{index}].{field}"

    def device(self, index: int) -> Device | None:
        return next((d for d in self.devices if d.index == index), None)

    @property
    def default_memory(self) -> float:
        """What a stage without ``memory`` counts as (≤ 1: fraction, > 1: bytes)."""
        return default_memory(self.options)


def default_memory(options: Mapping[str, Any]) -> float:
    """``options["default_memory"]``, else :data:`DEFAULT_MEMORY`; a ConfigError unless it is a
    positive number."""
    value = options.get("default_memory", DEFAULT_MEMORY)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ConfigError([ConfigIssue(
            "placement.options.default_memory", f"must be a number greater than 0, got {value!r}",
            "a fraction of a GPU (≤ 1) or bytes (> 1)",
        )])
    return float(value)


# -- memory ------------------------------------------------------------------------------------


def percent(fraction: float) -> str:
    """``0.25`` → ``25%``, ``0.125`` → ``12.5%``."""
    value = round(fraction * 100, 1)
    return f"{value:.0f}%" if value == int(value) else f"{value:.1f}%"


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB"


def amount_text(amount: float) -> str:
    """A ``memory`` value as users wrote it: a percentage or a size."""
    return percent(amount) if amount <= 1 else gib(amount)


def stage_share(request: PlacementRequest, stage: StageDemand, device: Device) -> tuple[float, bool]:
    """The fraction of ``device``'s budget one process of ``stage`` takes, and whether the stage
    declared it (False: the default share). A byte amount on a device of unknown memory is a
    ConfigError naming the stage and the GPU."""
    amount = stage.memory
    declared = amount is not None
    if amount is None:
        amount = request.default_memory
    if amount <= 1:
        return amount, declared
    if device.memory is None:
        path = request.path(stage.name, "memory") if declared else "placement.options.default_memory"
        what = f"stage {stage.name!r} asks for" if declared else f"stage {stage.name!r} counts as the default"
        raise ConfigError([ConfigIssue(
            path, f"{what} {gib(amount)} on GPU {device.index}, whose memory is unknown",
            "set placement.memory_per_gpu (bytes), or give memory as a fraction of a GPU (≤ 1)",
        )])
    return amount / device.memory, declared


def group_share(request: PlacementRequest, group: Group, device: Device) -> float:
    """The fraction of ``device`` one process of ``group`` takes: its stages' shares added up."""
    return sum(stage_share(request, stage, device)[0] for stage in group.stages)


@attrs.frozen
class Holder:
    """One process of one stage on a GPU, with the share of the GPU it takes."""

    stage: str
    label: str
    share: float
    declared: bool
    tp_size: int = 1


@attrs.frozen
class GpuLoad:
    """What a placement puts on one GPU."""

    device: Device
    holders: tuple[Holder, ...] = ()

    @property
    def declared(self) -> float:
        """The sum of the shares stages declared (must stay within 1)."""
        return sum(h.share for h in self.holders if h.declared)

    @property
    def total(self) -> float:
        """The sum of every share, default shares included."""
        return sum(h.share for h in self.holders)

    def over_by(self) -> float:
        """How far the declared shares exceed the budget (0 when they fit)."""
        return max(0.0, self.declared - 1)


def holder_label(stage: StageDemand, replica: int, rank: int) -> str:
    """``thinker``, ``thinker rank 1``, ``thinker replica 2``, ``thinker replica 2 rank 1``."""
    label = stage.name
    if stage.replicas > 1:
        label += f" replica {replica}"
    if stage.tp_size > 1:
        label += f" rank {rank}"
    return label


def slot_ids(placement: Mapping[str, Sequence[int | None]], stage: StageDemand) -> list[tuple[int, int, int | None]]:
    """``(replica, rank, gpu)`` of every process of ``stage`` in a normalised placement."""
    ids = placement[stage.name]
    return [
        (r, k, ids[r * stage.tp_size + k]) for r in range(stage.replicas) for k in range(stage.tp_size)
    ]


def gpu_loads(request: PlacementRequest, placement: Mapping[str, Sequence[int | None]]) -> tuple[GpuLoad, ...]:
    """The load of every device (in device order) under a normalised placement whose ids are
    all visible. Holders appear in config order."""
    held: dict[int, list[Holder]] = {d.index: [] for d in request.devices}
    for stage in request.stages:
        for replica, rank, gpu in slot_ids(placement, stage):
            if gpu is None:
                continue
            device = request.device(gpu)
            if device is None:
                continue
            share, declared = stage_share(request, stage, device)
            label = holder_label(stage, replica, rank)
            held[gpu].append(Holder(stage.name, label, share, declared, stage.tp_size))
    return tuple(GpuLoad(d, tuple(held[d.index])) for d in request.devices)


# -- from the config -----------------------------------------------------------------------------


def request_from_config(cfg: PipelineConfig, devices: Sequence[Device]) -> PlacementRequest:
    return PlacementRequest(
        stages=tuple(
            StageDemand(
                name=s.name, tp_size=s.tp_size, gpu=s.gpu, memory=s.memory, process=s.process,
                replicas=s.replicas,
            )
            for s in cfg.stages
        ),
        devices=tuple(devices),
        options=dict(cfg.placement.options),
    )


def simulated_devices(count: int, memory: int | None = None) -> tuple[Device, ...]:
    """``count`` GPUs numbered from 0, each with ``memory`` bytes (None: unknown)."""
    return tuple(Device(i, memory) for i in range(count))


def cuda_driver_present() -> bool:
    """Whether this machine could have a CUDA GPU at all: the NVIDIA driver's control device or
    its library exists. False means no GPU for sure; True still needs torch to count them."""
    import ctypes.util
    import os

    return os.path.exists("/dev/nvidiactl") or ctypes.util.find_library("cuda") is not None


def detect_devices(memory_override: int | None = None) -> tuple[Device, ...]:
    """The GPUs torch can see (none on a CPU-only machine), numbered as torch numbers them, that
    is, as indexes into ``CUDA_VISIBLE_DEVICES`` when it is set."""
    if not cuda_driver_present():
        return ()  # without importing torch (seconds): a CPU machine plans and validates fast
    try:
        import torch
    except ImportError:  # pragma: no cover
        return ()
    if not torch.cuda.is_available():
        return ()
    return tuple(
        Device(i, memory_override or torch.cuda.get_device_properties(i).total_memory)
        for i in range(torch.cuda.device_count())
    )


def place(cfg: PipelineConfig, registry: Registry, devices: Sequence[Device]) -> Placement:
    """Run the configured strategy and check its answer. Returns the normalised placement
    (``replicas * tp_size`` ids per stage, replica-major); a ConfigError names stage and GPU."""
    strategy = registry.resolve("placement", cfg.placement.strategy)
    request = request_from_config(cfg, devices)
    answer = _call_strategy(registry, cfg.placement.strategy, strategy, request)
    issues = check_placement(request, answer)
    if issues:
        raise ConfigError(issues)
    return normalize(request, answer)


def _call_strategy(registry: Registry, name: str, strategy: Callable, request: PlacementRequest) -> Any:
    """Run a strategy; an exception other than a ConfigError is a bug of the plugin that
    registered it, and the error says which plugin and which strategy."""
    try:
        return strategy(request)
    except ConfigError:
        raise
    except Exception as exc:
        owner = _owner(registry, "placement", name)
        raise PluginError(
            f"placement strategy {name!r}{owner} raised {type(exc).__name__}: {exc}; "
            "this is a bug in the plugin (report it there), or choose another placement.strategy"
        ) from exc


def _owner(registry: Registry, kind: str, name: str) -> str:
    try:
        return f" of plugin {registry.get(kind, name).plugin!r}"
    except Exception:  # a dotted path: no plugin registered it
        return ""


def normalize(request: PlacementRequest, answer: Mapping[str, Sequence[int | None]]) -> Placement:
    """Expand per-rank answers to one id per replica and rank (replica-major)."""
    out: Placement = {}
    for stage in request.stages:
        ids = tuple(answer[stage.name])
        out[stage.name] = ids * stage.replicas if len(ids) == stage.tp_size else ids
    return out


# -- checking an answer --------------------------------------------------------------------------


def check_placement(request: PlacementRequest, answer: Mapping[str, Any]) -> list[ConfigIssue]:
    """Every problem of a strategy's answer: shape, visibility, TP ranks on distinct GPUs, shared
    processes on one GPU, declared memory within each GPU's budget. Empty when it is valid."""
    issues = _shape_issues(request, answer)
    if issues:
        return issues
    placement = normalize(request, answer)
    issues = _visibility_issues(request, placement)
    if issues:
        return issues
    issues = _pinned_issues(request, placement) + _capacity_issues(request, placement)
    if issues:
        return issues
    issues = _rank_issues(request, placement) + _process_issues(request, placement)
    try:
        loads = gpu_loads(request, placement)
    except ConfigError as exc:
        return issues + exc.issues
    return issues + [_budget_issue(request, load) for load in loads if load.over_by() > EPS]


def _capacity_issues(request: PlacementRequest, placement: Placement) -> list[ConfigIssue]:
    """A tensor-parallel stage with more ranks than the GPUs given is an error rather than
    ranks that silently run on the CPU (what ``explicit`` does with a stage without ``gpu``).
    A stage ``placement.options.cpu`` keeps on the CPU is exempt; so is everything when no GPU
    is given. (Ranks a strategy doubles up on one GPU are reported by the rank check.)"""
    if not request.devices:
        return []
    kept = _kept_on_cpu(request)
    issues = []
    for stage in request.stages:
        on_cpu = all(gpu is None for gpu in placement[stage.name])
        if stage.tp_size > len(request.devices) and on_cpu and stage.name not in kept:
            given = len(request.devices)
            issues.append(ConfigIssue(
                request.path(stage.name, "tp_size"),
                f"stage {stage.name!r} has tp_size {stage.tp_size} but only {_count(given, 'GPU')} "
                f"{'is' if given == 1 else 'are'} given ({', '.join(f'GPU {d.index}' for d in request.devices)}); "
                "each tensor-parallel rank needs a GPU of its own",
                f"lower tp_size to at most {given}, or plan with more GPUs (--gpus / placement.gpus)",
            ))
    return issues


def _kept_on_cpu(request: PlacementRequest) -> set[str]:
    """The stages ``placement.options.cpu`` names (a name or a list; malformed: none)."""
    kept = request.options.get("cpu", [])
    if isinstance(kept, str):
        return {kept}
    return {k for k in kept if isinstance(k, str)} if isinstance(kept, (list, tuple)) else set()


def _pinned_issues(request: PlacementRequest, placement: Placement) -> list[ConfigIssue]:
    """A stage's ``gpu`` is the user's word: a strategy that moves it is wrong (checked when GPUs
    are given; with none, every stage runs on the CPU and a warning says so)."""
    if not request.devices:
        return []
    issues = []
    for stage in request.stages:
        if stage.gpu is None:
            continue
        wanted = pinned_ids(stage) * stage.replicas
        got = tuple(placement[stage.name])
        if got != wanted:
            issues.append(ConfigIssue(
                request.path(stage.name, "gpu"),
                f"the placement strategy put stage {stage.name!r} on {_ids_text(got)}, but its 'gpu' says {_ids_text(wanted)}",
                "a stage's gpu is never overridden; remove 'gpu' to let the strategy choose",
            ))
    return issues


def _ids_text(ids: Sequence[int | None]) -> str:
    return "[" + ", ".join("CPU" if i is None else str(i) for i in ids) + "]"


def _is_id(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool))


def _shape_issues(request: PlacementRequest, answer: Mapping[str, Any]) -> list[ConfigIssue]:
    issues = []
    for stage in request.stages:
        ids = answer.get(stage.name) if isinstance(answer, Mapping) else None
        counts = sorted({stage.tp_size, stage.tp_size * stage.replicas})
        if (
            not isinstance(ids, (list, tuple))
            or len(ids) not in counts
            or not all(_is_id(i) for i in ids)
        ):
            expected = " or ".join(str(c) for c in counts)
            issues.append(ConfigIssue(
                request.path(stage.name, "gpu"),
                f"the placement strategy gave stage {stage.name!r} {ids!r}; expected {expected} GPU ids (or null for the CPU)",
                "one per tensor-parallel rank, or one per replica and rank",
            ))
    return issues


def _visibility_issues(request: PlacementRequest, placement: Placement) -> list[ConfigIssue]:
    visible = {d.index for d in request.devices}
    seen = ", ".join(str(v) for v in sorted(visible)) or "none"
    issues = []
    for stage in request.stages:
        for replica, rank, gpu in slot_ids(placement, stage):
            if gpu is not None and gpu not in visible:
                issues.append(ConfigIssue(
                    request.path(stage.name, "gpu"),
                    f"stage {holder_label(stage, replica, rank)!r} is placed on GPU {gpu}, which is not visible (visible GPUs: {seen})",
                    "use a visible GPU id, or plan with --gpus N / placement.gpus",
                ))
    return issues


def _rank_issues(request: PlacementRequest, placement: Placement) -> list[ConfigIssue]:
    issues = []
    for stage in request.stages:
        for replica in range(stage.replicas):
            ids = placement[stage.name][replica * stage.tp_size:(replica + 1) * stage.tp_size]
            issue = _ranks_issue(request, stage, replica, ids)
            if issue:
                issues.append(issue)
    return issues


def _ranks_issue(request: PlacementRequest, stage: StageDemand, replica: int, ids: Sequence[int | None]) -> ConfigIssue | None:
    """TP ranks of one replica: all on the CPU, or on distinct GPUs."""
    where = stage.name if stage.replicas == 1 else f"{stage.name} replica {replica}"
    path = request.path(stage.name, "gpu")
    if None in ids and any(i is not None for i in ids):
        gpus = sorted({i for i in ids if i is not None})
        return ConfigIssue(path, f"stage {where!r} has ranks on the CPU and on GPU {gpus[0]}",
                           "put every tensor-parallel rank on a GPU, or none")
    for rank, gpu in enumerate(ids):
        if gpu is not None and gpu in ids[:rank]:
            first = ids.index(gpu)
            return ConfigIssue(
                path,
                f"stage {where!r} has ranks {first} and {rank} both on GPU {gpu}; tensor-parallel ranks need "
                f"distinct GPUs (tp_size {stage.tp_size}, {_count(len(request.devices), 'GPU')} visible)",
                "give one GPU per rank, lower tp_size, or plan with more GPUs",
            )
    return None


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _process_issues(request: PlacementRequest, placement: Placement) -> list[ConfigIssue]:
    issues = []
    for group in request.groups():
        head = placement[group.head.name]
        for stage in group.stages[1:]:
            ids = placement[stage.name]
            if ids != head:
                issues.append(ConfigIssue(
                    request.path(stage.name, "process"),
                    f"stages {group.head.name!r} and {stage.name!r} share process {group.name!r} but are placed on "
                    f"{_where(head)} and {_where(ids)}; the stages of one process run on one GPU",
                    "place them on the same GPU, or give them separate processes",
                ))
    return issues


def _where(ids: Sequence[int | None]) -> str:
    names = ["CPU" if i is None else f"GPU {i}" for i in dict.fromkeys(ids)]
    return ", ".join(names)


def _budget_issue(request: PlacementRequest, load: GpuLoad) -> ConfigIssue:
    """The issue of a GPU whose declared demands exceed its budget; its path is the ``memory``
    of the first stage (in config order) that no longer fits."""
    running, tipping = 0.0, load.holders[-1]
    for holder in load.holders:
        running += holder.share if holder.declared else 0.0
        if running > 1 + EPS:
            tipping = holder
            break
    over = load.over_by()
    size = f" ({gib(over * load.device.memory)})" if load.device.memory else ""
    parts = ", ".join(f"{h.label} {percent(h.share)}" for h in load.holders if h.declared)
    return ConfigIssue(
        request.path(tipping.stage, "memory"),
        f"GPU {load.device.index} is over its memory budget by {percent(over)}{size} at stage {tipping.stage!r}: {parts} "
        f"(total {percent(load.declared)})",
        "lower their memory, move a stage to another GPU, or add GPUs",
    )


# -- warnings ------------------------------------------------------------------------------------


def placement_warnings(request: PlacementRequest, placement: Placement) -> list[str]:
    """What is allowed but probably not meant: a GPU over budget once the default shares of
    stages without ``memory`` are counted, a TP stage sharing a GPU with another stage, stages
    that ask for a GPU when none is visible. ``placement`` is valid and normalised."""
    loads = gpu_loads(request, placement)
    return [
        *[w for load in loads if (w := _default_budget_warning(request, load))],
        *[w for load in loads for w in _tp_sharing_warnings(load)],
        *_no_gpu_warnings(request),
        *_idle_gpu_warnings(request, placement, loads),
    ]


def _default_budget_warning(request: PlacementRequest, load: GpuLoad) -> str | None:
    if load.total <= 1 + EPS or load.over_by() > EPS:
        return None
    guessed = [h.label for h in load.holders if not h.declared]
    default = amount_text(request.default_memory)
    which = (f"{guessed[0]}, which sets no memory, at the default {default}; set 'memory' on it"
             if len(guessed) == 1 else
             f"{', '.join(guessed)}, which set no memory, at the default {default} each; set 'memory' on them")
    return f"GPU {load.device.index} may be over its memory budget: {percent(load.total)} counting {which}"


def _tp_sharing_warnings(load: GpuLoad) -> list[str]:
    out = []
    for stage in dict.fromkeys(h.stage for h in load.holders if h.tp_size > 1):
        others = list(dict.fromkeys(h.stage for h in load.holders if h.stage != stage))
        if others:
            ranks = [h.label for h in load.holders if h.stage == stage]
            out.append(
                f"GPU {load.device.index} is shared by tensor-parallel {', '.join(ranks)} and "
                f"{', '.join(others)}; TP ranks run in lockstep, so the slowest GPU sets the pace"
            )
    return out


def _no_gpu_warnings(request: PlacementRequest) -> list[str]:
    asking = [s.name for s in request.stages if s.gpu is not None]
    if request.devices or not asking:
        return []
    return [f"no GPU is visible: {', '.join(asking)} run on the CPU despite their 'gpu' (plan with --gpus N to simulate GPUs)"]


def _idle_gpu_warnings(request: PlacementRequest, placement: Placement, loads: Sequence[GpuLoad]) -> list[str]:
    """GPUs left idle while stages run on the CPU that nothing keeps there: with ``explicit``
    only stages with a ``gpu`` use one, which is rarely what a plan for N GPUs is meant to do.
    Stages named in ``placement.options.cpu`` are on the CPU on purpose."""
    idle = [load.device.index for load in loads if not load.holders]
    kept = _kept_on_cpu(request)
    on_cpu = [s.name for s in request.stages if s.name not in kept and all(g is None for g in placement[s.name])]
    if not idle or not on_cpu:
        return []
    gpus = ", ".join(str(i) for i in idle)
    return [
        f"{_count(len(idle), 'GPU')} idle ({gpus}) while {', '.join(on_cpu)} run on the CPU; give those stages "
        "'gpu: N', or use placement strategy 'pack' or 'spread' (placement.options.cpu keeps a stage on the CPU)"
    ]


# -- the built-in strategies ---------------------------------------------------------------------


def cpu_only(request: PlacementRequest) -> Placement:
    """Every stage on the CPU."""
    return {s.name: (None,) * (s.tp_size * s.replicas) for s in request.stages}


def check_options(request: PlacementRequest, allowed: Sequence[str]) -> None:
    """A ConfigError for options the strategy does not know, with the closest known one."""
    issues = []
    for key in request.options:
        if key not in allowed:
            guess = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"did you mean {guess[0]!r}?" if guess else f"options here: {', '.join(allowed)}"
            issues.append(ConfigIssue(f"placement.options.{key}", f"unknown placement option {key!r}", hint))
    if issues:
        raise ConfigError(issues)
    default_memory(request.options)


def pinned_ids(stage: StageDemand) -> tuple[int | None, ...]:
    """The ids a stage's ``gpu:`` field gives its ranks: one per rank, or a single id meaning
    consecutive GPUs starting there; None (CPU) for every rank when absent."""
    if stage.gpu is None:
        return (None,) * stage.tp_size
    if len(stage.gpu) == stage.tp_size:
        return tuple(stage.gpu)
    return tuple(stage.gpu[0] + r for r in range(stage.tp_size))


def explicit(request: PlacementRequest) -> Placement:
    """Place each stage where its ``gpu:`` field says (every replica on the same GPUs); stages
    without one run on the CPU, and so does everything when no GPU is visible. A single id for a
    TP stage means consecutive GPUs starting there."""
    check_options(request, ("default_memory",))
    if not request.devices:
        return cpu_only(request)
    return {stage.name: pinned_ids(stage) for stage in request.stages}


@attrs.define
class Ledger:
    """The load of each device while a greedy strategy places process groups one by one."""

    request: PlacementRequest
    used: dict[int, float] = attrs.Factory(dict)
    count: dict[int, int] = attrs.Factory(dict)

    def need(self, group: Group, index: int) -> float:
        device = self.request.device(index)
        return 0.0 if device is None else group_share(self.request, group, device)

    def after(self, group: Group, index: int) -> float:
        """The load of device ``index`` if one process of ``group`` went there."""
        return self.used.get(index, 0.0) + self.need(group, index)

    def fits(self, group: Group, index: int) -> bool:
        return self.after(group, index) <= 1 + EPS

    def add(self, group: Group, ids: Sequence[int | None]) -> None:
        for index in ids:
            if index is not None:
                self.used[index] = self.after(group, index)
                self.count[index] = self.count.get(index, 0) + 1


Picker = Callable[[Ledger, Group], list[int]]


def least_loaded(ledger: Ledger, group: Group, exclude: Sequence[int] = ()) -> list[int]:
    """Device ids ordered by the load they would have with ``group`` on them, then by how many
    processes they hold, then by id."""
    ids = [d.index for d in ledger.request.devices if d.index not in exclude]
    return sorted(ids, key=lambda i: (round(ledger.after(group, i), 9), ledger.count.get(i, 0), i))


def complete(ledger: Ledger, group: Group, preferred: Sequence[int]) -> list[int]:
    """``tp_size`` distinct ids: the preferred ones first, then the least loaded. With fewer
    devices than ranks, ids repeat (and the check reports it)."""
    size = group.head.tp_size
    picks = list(preferred[:size])
    picks += least_loaded(ledger, group, exclude=picks)[: size - len(picks)]
    order = [d.index for d in ledger.request.devices]
    picks += [order[i % len(order)] for i in range(size - len(picks))]
    return picks


def pick_first_fit(ledger: Ledger, group: Group) -> list[int]:
    """``pack``: the lowest-numbered GPUs with room for one process of the group each."""
    fitting = [d.index for d in ledger.request.devices if ledger.fits(group, d.index)]
    return complete(ledger, group, fitting)


def pick_least_loaded(ledger: Ledger, group: Group) -> list[int]:
    """``spread``: the GPUs that would be least loaded with the group on them."""
    return complete(ledger, group, least_loaded(ledger, group))


def cpu_groups(request: PlacementRequest) -> set[str]:
    """Groups whose stages ``placement.options.cpu`` (a stage name or a list) keeps on the CPU."""
    value = request.options.get("cpu", [])
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, (list, tuple)):
        raise ConfigError([ConfigIssue("placement.options.cpu", f"expected a stage name or a list of them, got {value!r}")])
    known = {s.name: s for s in request.stages}
    issues = [issue for i, name in enumerate(names) if (issue := _cpu_issue(known, i, name))]
    if issues:
        raise ConfigError(issues)
    return {known[n].group for n in names}


def _cpu_issue(known: Mapping[str, StageDemand], i: int, name: Any) -> ConfigIssue | None:
    stage = known.get(name) if isinstance(name, str) else None
    path = f"placement.options.cpu[{i}]"
    if stage is None:
        guess = difflib.get_close_matches(str(name), list(known), n=1)
        hint = f"did you mean {guess[0]!r}?" if guess else f"stages are: {', '.join(known)}"
        return ConfigIssue(path, f"unknown stage {name!r}", hint)
    if stage.gpu is not None:
        return ConfigIssue(path, f"stage {name!r} is kept on the CPU but its 'gpu' pins it to GPU {stage.gpu[0]}",
                           "remove one of the two")
    return None


def greedy(request: PlacementRequest, pick: Picker) -> Placement:
    """Place process groups one by one, in config order after the pinned ones (those with a
    ``gpu:``, placed where it says); ``pick`` chooses the GPUs of each replica of the rest."""
    check_options(request, ("default_memory", "cpu"))
    if not request.devices:
        return cpu_only(request)
    on_cpu = cpu_groups(request)
    ledger = Ledger(request)
    chosen: dict[str, list[int | None]] = {}
    for group in sorted(request.groups(), key=lambda g: g.head.gpu is None):
        ids: list[int | None] = []
        for _ in range(group.head.replicas):
            if group.name in on_cpu:
                ranks: list[int | None] = [None] * group.head.tp_size
            elif group.head.gpu is not None:
                ranks = list(pinned_ids(group.head))
            else:
                ranks = list(pick(ledger, group))
            ledger.add(group, ranks)
            ids += ranks
        chosen[group.name] = ids
    return {stage.name: tuple(chosen[stage.group]) for stage in request.stages}


def pack(request: PlacementRequest) -> Placement:
    """Fill each GPU up to its memory budget before using the next: every process goes on the
    lowest-numbered GPU with room for it (TP ranks on distinct GPUs); when none has room, on the
    least loaded, and the check reports the overflow. Stages with a ``gpu:`` stay there."""
    return greedy(request, pick_first_fit)


def spread(request: PlacementRequest) -> Placement:
    """Balance stages over the GPUs: every process goes on the GPU that would be least loaded
    with it (ties: fewer processes, then the lower id), TP ranks on distinct GPUs. Stages with a
    ``gpu:`` stay there."""
    return greedy(request, pick_least_loaded)

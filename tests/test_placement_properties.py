"""Properties of placement over random configs: every plan the planner returns is valid (checked
here independently of the planner's own checks), every config that cannot be placed fails with an
error naming a stage and a GPU, and the strategies keep their promises (explicit follows the gpu
fields, pack and spread succeed whenever a simple capacity bound says they must)."""

from __future__ import annotations

import re
from collections import defaultdict

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from omni_core.config import structure
from omni_core.config.schema import PipelineConfig
from omni_core.errors import ConfigError
from omni_core.plan import build_plan
from omni_core.plan.placement import DEFAULT_MEMORY
from omni_core.plugins import load_plugins

GIB = 1 << 30
GPU_MEMORY = 80 * GIB
STRATEGIES = ("explicit", "pack", "spread")
SHARED = "shared"

PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def registry():
    return load_plugins(env={"OMNI_LOAD_PLUGINS": ""}).registry


# -- random configs ------------------------------------------------------------------------------


memories = st.one_of(
    st.none(),
    st.integers(1, 100).map(lambda p: p / 100),
    st.integers(1, 80).map(lambda g: g * GIB),
)


@st.composite
def gpu_field(draw, gpus: int, tp_size: int):
    """None, one id, or one id per rank; ids may be invisible (== gpus) or repeat."""
    ids = st.integers(0, gpus)
    return draw(st.one_of(st.none(), ids, st.lists(ids, min_size=tp_size, max_size=tp_size)))


@st.composite
def configs(draw, strategy: str | None = None) -> tuple[PipelineConfig, int]:
    """A structurally valid pipeline (a chain of up to 6 stages, some sharing a process) and a
    number of simulated GPUs; placement may or may not be possible."""
    strategy = strategy or draw(st.sampled_from(STRATEGIES))
    gpus = draw(st.integers(0, 5))
    stages = []
    for i in range(draw(st.integers(1, 6))):
        tp_size = draw(st.integers(1, 3))
        stage = {"name": f"s{i}", "factory": "acme_models:Stage", "tp_size": tp_size,
                 "replicas": draw(st.integers(1, 2)), "memory": draw(memories)}
        if strategy == "explicit":
            stage["gpu"] = draw(gpu_field(gpus, tp_size))
        stages.append(stage)
    share_process(draw, stages)
    chain(stages)
    placement = {"strategy": strategy, "memory_per_gpu": draw(st.sampled_from([None, GPU_MEMORY]))}
    return structure({"name": "random", "stages": stages, "placement": placement}), gpus


def chain(stages: list[dict]) -> None:
    """Wire the stages in a line: each routes to the next, the last one is terminal."""
    for this, following in zip(stages, [*stages[1:], None], strict=True):
        this.update({"next": following["name"]} if following else {"terminal": True})


def share_process(draw, stages: list[dict]) -> None:
    """Put some single-process stages (no TP, no replicas) in one shared process, with the
    first one's gpu field, as config validation requires."""
    single = [s for s in stages if s["tp_size"] == 1 and s["replicas"] == 1]
    members = draw(st.lists(st.sampled_from(single), unique_by=lambda s: s["name"], max_size=3)) if single else []
    if len(members) >= 2:
        for stage in members:
            stage.update(process=SHARED, gpu=members[0].get("gpu"))


environs = st.one_of(st.none(), st.lists(st.sampled_from(["3", "5", "7", "GPU-a1", "MIG-b2"]), min_size=6, max_size=6))


# -- an independent model of the rules -----------------------------------------------------------


def groups(cfg: PipelineConfig) -> dict[str, list]:
    out: dict[str, list] = {}
    for stage in cfg.stages:
        out.setdefault(stage.process or stage.name, []).append(stage)
    return out


def share(memory: float | None, cfg: PipelineConfig) -> float | None:
    """A stage's share of one simulated GPU (None: unknown), the default for no memory."""
    amount = DEFAULT_MEMORY if memory is None else memory
    if amount <= 1:
        return amount
    return None if cfg.placement.memory_per_gpu is None else amount / cfg.placement.memory_per_gpu


def explicit_ids(stage, gpus: int) -> tuple:
    if gpus == 0 or stage.gpu is None:
        return (None,) * stage.tp_size * stage.replicas
    ranks = stage.gpu if len(stage.gpu) == stage.tp_size else tuple(stage.gpu[0] + r for r in range(stage.tp_size))
    return tuple(ranks) * stage.replicas


def explicit_is_placeable(cfg: PipelineConfig, gpus: int) -> bool:
    """Whether the gpu fields describe a valid placement on ``gpus`` GPUs."""
    used: dict[int, float] = defaultdict(float)
    for stage in cfg.stages:
        if 0 < gpus < stage.tp_size and stage.gpu is None:
            return False  # ranks do not silently run on the CPU when GPUs are given
        ids = explicit_ids(stage, gpus)
        for replica in range(stage.replicas):
            ranks = [i for i in ids[replica * stage.tp_size:(replica + 1) * stage.tp_size] if i is not None]
            if len(set(ranks)) != len(ranks) or any(i >= gpus for i in ranks):
                return False
        for gpu in (i for i in ids if i is not None):
            amount = share(stage.memory, cfg)
            if amount is None:
                return False
            used[gpu] += amount if stage.memory is not None else 0.0
    return all(total <= 1 + 1e-9 for total in used.values())


def process_shares(cfg: PipelineConfig) -> list[tuple[float | None, float | None, int]]:
    """Per process group: (share of one process incl. default shares, declared share, tp_size)
    once per replica."""
    out = []
    for members in groups(cfg).values():
        shares = [share(s.memory, cfg) for s in members]
        total = None if None in shares else sum(shares)
        declared = None if None in shares else sum(a for a, s in zip(shares, members, strict=True) if s.memory is not None)
        out += [(total, declared, members[0].tp_size)] * members[0].replicas
    return out


def greedy_must_succeed(cfg: PipelineConfig, gpus: int) -> bool:
    """A capacity bound under which first-fit and least-loaded placement cannot fail: a unit of
    k ranks with share s finds no room only if more than G - k GPUs are fuller than 1 - s."""
    if gpus == 0:
        return True
    units = process_shares(cfg)
    if any(total is None for total, _, _ in units):
        return False
    k_max = max(k for _, _, k in units)
    s_max = max(total for total, _, _ in units)
    demand = sum(total * k for total, _, k in units)
    return k_max <= gpus and demand <= (gpus - k_max + 1) * (1 - s_max)


def greedy_must_fail(cfg: PipelineConfig, gpus: int) -> bool:
    """More ranks than GPUs, more declared memory than all GPUs hold, or bytes on GPUs of
    unknown memory."""
    if gpus == 0:
        return False
    units = process_shares(cfg)
    if any(total is None for total, _, _ in units):
        return True
    declared = sum(d * k for _, d, k in units)
    return max(k for _, _, k in units) > gpus or declared > gpus + 1e-9


def must_succeed(cfg: PipelineConfig, gpus: int) -> bool:
    if cfg.placement.strategy == "explicit":
        return explicit_is_placeable(cfg, gpus)
    return greedy_must_succeed(cfg, gpus)


def assert_valid_plan(cfg: PipelineConfig, plan, gpus: int, visible: list[str] | None) -> None:
    """Every rule a plan must keep, checked from its processes."""
    expected = sum(m[0].replicas * m[0].tp_size for m in groups(cfg).values())
    assert len(plan.processes) == expected
    declared: dict[int, float] = defaultdict(float)
    for proc in plan.processes:
        assert proc.gpu is None or 0 <= proc.gpu < gpus
        physical = "" if proc.gpu is None else (str(proc.gpu) if visible is None else visible[proc.gpu])
        assert proc.forced_env["CUDA_VISIBLE_DEVICES"] == physical
        for name in proc.stages:
            stage = cfg.stage(name)
            assert plan.placement[name][proc.replica * stage.tp_size + proc.tp_rank] == proc.gpu
            if proc.gpu is not None and stage.memory is not None:
                declared[proc.gpu] += share(stage.memory, cfg)
    assert all(total <= 1 + 1e-9 for total in declared.values()), declared
    for group in plan.groups:
        for replica in {p.replica for p in plan.group(group)}:
            ranks = [p for p in plan.group(group) if p.replica == replica]
            ids = [p.gpu for p in ranks]
            assert all(i is None for i in ids) or len(set(ids)) == len(ids) and None not in ids
            assert [p.leader for p in ranks] == [None] + [ranks[0].name] * (len(ranks) - 1)


def assert_precise(error: ConfigError, cfg: PipelineConfig) -> None:
    """Every issue names a stage of the config and a GPU."""
    for issue in error.issues:
        text = f"{issue.path}: {issue.message}"
        assert re.search(r"GPU \d+", text), text
        assert any(re.search(rf"'{name}\b", issue.message) for name in cfg.stage_names), text


def attempt(registry, cfg: PipelineConfig, gpus: int, visible: list[str] | None = None):
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": ",".join(visible)}
    try:
        return build_plan(cfg, registry, gpus=gpus, cores=4, environ=environ), None
    except ConfigError as exc:
        return None, exc


# -- properties ----------------------------------------------------------------------------------


@PROPERTY
@given(drawn=configs(), visible=environs)
def test_every_config_gets_a_valid_plan_or_an_error_naming_stage_and_gpu(registry, drawn, visible):
    cfg, gpus = drawn
    plan, error = attempt(registry, cfg, gpus, visible)
    if must_succeed(cfg, gpus):
        assert error is None, error
    if plan is not None:
        assert_valid_plan(cfg, plan, gpus, visible)
    else:
        assert_precise(error, cfg)


@PROPERTY
@given(drawn=configs("explicit"))
def test_explicit_plans_exactly_the_gpu_fields_when_they_are_valid_and_fails_when_not(registry, drawn):
    cfg, gpus = drawn
    plan, error = attempt(registry, cfg, gpus)
    assert (plan is not None) == explicit_is_placeable(cfg, gpus), error
    if plan is not None:
        assert plan.placement == {s.name: explicit_ids(s, gpus) for s in cfg.stages}


@PROPERTY
@given(drawn=configs("pack") | configs("spread"))
def test_pack_and_spread_succeed_within_capacity_and_fail_beyond_it(registry, drawn):
    cfg, gpus = drawn
    plan, error = attempt(registry, cfg, gpus)
    if greedy_must_succeed(cfg, gpus):
        assert error is None, error
    if greedy_must_fail(cfg, gpus):
        assert plan is None
    if plan is not None and gpus:
        assert all(p.gpu is not None for p in plan.processes)


@PROPERTY
@given(drawn=configs())
def test_without_gpus_every_strategy_places_everything_on_the_cpu(registry, drawn):
    cfg, _ = drawn
    plan, error = attempt(registry, cfg, 0)
    assert error is None
    assert all(p.gpu is None and p.device == "cpu" for p in plan.processes)


@PROPERTY
@given(
    strategy=st.sampled_from(STRATEGIES),
    gpus=st.integers(1, 4),
    shares=st.lists(st.integers(30, 100).map(lambda p: p / 100), min_size=1, max_size=12),
    data=st.data(),
)
def test_declared_memory_beyond_every_gpu_fails_naming_stage_and_gpu(registry, strategy, gpus, shares, data):
    assume(sum(shares) > gpus)
    stages = [{"name": f"s{i}", "factory": "acme_models:Stage", "memory": m} for i, m in enumerate(shares)]
    if strategy == "explicit":
        for stage in stages:
            stage["gpu"] = data.draw(st.integers(0, gpus - 1))
    chain(stages)
    cfg = structure({"name": "full", "stages": stages, "placement": {"strategy": strategy}})
    plan, error = attempt(registry, cfg, gpus)
    assert plan is None
    assert any("is over its memory budget" in i.message for i in error.issues)
    assert_precise(error, cfg)


@PROPERTY
@given(gpus=st.integers(1, 8), count=st.integers(1, 24))
def test_spread_keeps_the_count_of_equal_stages_per_gpu_within_one(registry, gpus, count):
    stages = [{"name": f"s{i}", "factory": "acme_models:Stage", "memory": 0.01} for i in range(count)]
    chain(stages)
    cfg = structure({"name": "even", "stages": stages, "placement": {"strategy": "spread"}})
    plan, _ = attempt(registry, cfg, gpus)
    per_gpu = [sum(p.gpu == g for p in plan.processes) for g in range(gpus)]
    assert max(per_gpu) - min(per_gpu) <= 1


@PROPERTY
@given(gpus=st.integers(1, 8), per_gpu=st.integers(1, 5), count=st.integers(1, 30))
def test_pack_uses_as_few_gpus_as_equal_stages_need(registry, gpus, per_gpu, count):
    assume(count <= gpus * per_gpu)
    stages = [{"name": f"s{i}", "factory": "acme_models:Stage", "memory": 1 / per_gpu} for i in range(count)]
    chain(stages)
    cfg = structure({"name": "packed", "stages": stages, "placement": {"strategy": "pack"}})
    plan, error = attempt(registry, cfg, gpus)
    assert error is None
    assert [p.gpu for p in plan.processes] == [i // per_gpu for i in range(count)]

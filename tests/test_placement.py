"""Placement strategies (explicit, pack, spread) and the checks every strategy's answer passes."""

from __future__ import annotations

import pytest

from omni_core.config import structure
from omni_core.errors import ConfigError, PluginError
from omni_core.plan import build_plan
from omni_core.plan.placement import (
    DEFAULT_MEMORY,
    Device,
    PlacementRequest,
    StageDemand,
    check_placement,
    explicit,
    pack,
    percent,
    spread,
)
from omni_core.registry import Entry

GIB = 1 << 30


def pipeline(*stages: dict, strategy: str = "explicit", **placement) -> dict:
    """A config mapping: the stages in a chain (each routes to the next, the last is terminal)."""
    chained = []
    for i, stage in enumerate(stages):
        stage = {"factory": "acme_models:Stage", **stage}
        if i + 1 < len(stages):
            stage.setdefault("next", stages[i + 1]["name"])
        else:
            stage.setdefault("terminal", True)
        chained.append(stage)
    return {"name": "test", "stages": chained, "placement": {"strategy": strategy, **placement}}


def plan_of(registry, *stages: dict, gpus: int | None = None, strategy: str = "explicit", **placement):
    cfg = structure(pipeline(*stages, strategy=strategy, **placement))
    return build_plan(cfg, registry, gpus=gpus, cores=8, environ={})


def placement_of(registry, *stages: dict, gpus: int | None = None, strategy: str = "explicit", **placement):
    return plan_of(registry, *stages, gpus=gpus, strategy=strategy, **placement).placement


def error_of(registry, *stages: dict, gpus: int | None = None, strategy: str = "explicit", **placement) -> ConfigError:
    with pytest.raises(ConfigError) as caught:
        plan_of(registry, *stages, gpus=gpus, strategy=strategy, **placement)
    return caught.value


def quarter(name: str, **fields) -> dict:
    return {"name": name, "memory": 0.25, **fields}


# -- explicit ------------------------------------------------------------------------------------


def test_explicit_places_each_stage_on_its_gpu_field_and_the_rest_on_the_cpu(registry):
    placement = placement_of(registry, {"name": "a", "gpu": 1}, {"name": "b"}, {"name": "c", "gpu": 0}, gpus=2)
    assert placement == {"a": (1,), "b": (None,), "c": (0,)}


def test_explicit_single_id_for_a_tp_stage_means_consecutive_gpus(registry):
    placement = placement_of(registry, {"name": "t", "tp_size": 3, "gpu": 1}, gpus=4)
    assert placement == {"t": (1, 2, 3)}


def test_explicit_list_gives_one_gpu_per_rank(registry):
    placement = placement_of(registry, {"name": "t", "tp_size": 2, "gpu": [3, 0]}, gpus=4)
    assert placement == {"t": (3, 0)}


def test_explicit_replicas_share_the_pinned_gpu_and_each_counts_against_its_budget(registry):
    issue = error_of(registry, {"name": "r", "gpu": 0, "replicas": 2, "memory": 0.6}, gpus=1).issues[0]
    assert issue.path == "stages[0].memory"
    assert "GPU 0 is over its memory budget by 20%" in issue.message
    assert "r replica 0 60%, r replica 1 60%" in issue.message


# -- pack ----------------------------------------------------------------------------------------


def test_pack_fills_the_first_gpu_before_the_next(registry):
    stages = [quarter(f"s{i}") for i in range(6)]
    placement = placement_of(registry, *stages, gpus=3, strategy="pack")
    assert [placement[f"s{i}"] for i in range(6)] == [(0,), (0,), (0,), (0,), (1,), (1,)]


def test_pack_goes_back_to_an_earlier_gpu_that_still_has_room(registry):
    placement = placement_of(
        registry, {"name": "big", "memory": 0.7}, {"name": "huge", "memory": 0.8}, {"name": "small", "memory": 0.3},
        gpus=2, strategy="pack",
    )
    assert placement == {"big": (0,), "huge": (1,), "small": (0,)}


def test_pack_counts_a_stage_without_memory_as_the_default_share(registry):
    count = round(1 / DEFAULT_MEMORY)
    stages = [{"name": f"s{i}"} for i in range(count + 1)]
    placement = placement_of(registry, *stages, gpus=2, strategy="pack")
    assert [placement[f"s{i}"][0] for i in range(count + 1)] == [0] * count + [1]


def test_default_share_is_an_option(registry):
    stages = [{"name": f"s{i}"} for i in range(3)]
    placement = placement_of(registry, *stages, gpus=3, strategy="pack", options={"default_memory": 0.5})
    assert placement == {"s0": (0,), "s1": (0,), "s2": (1,)}


def test_pack_converts_bytes_with_the_memory_of_each_gpu(registry):
    stages = [{"name": "a", "memory": 30 * GIB}, {"name": "b", "memory": 30 * GIB}, {"name": "c", "memory": 30 * GIB}]
    placement = placement_of(registry, *stages, gpus=2, strategy="pack", memory_per_gpu=80 * GIB)
    assert placement == {"a": (0,), "b": (0,), "c": (1,)}


def test_pack_puts_tp_ranks_on_distinct_gpus(registry):
    placement = placement_of(registry, {"name": "t", "tp_size": 4, "memory": 0.1}, gpus=4, strategy="pack")
    assert placement == {"t": (0, 1, 2, 3)}


def test_pack_keeps_pinned_stages_where_they_are_and_counts_them_first(registry):
    placement = placement_of(
        registry, {"name": "free", "memory": 0.5}, {"name": "pinned", "memory": 0.8, "gpu": 0},
        gpus=2, strategy="pack",
    )
    assert placement == {"free": (1,), "pinned": (0,)}


def test_pack_keeps_stages_listed_in_the_cpu_option_on_the_cpu(registry):
    placement = placement_of(registry, {"name": "tok"}, {"name": "llm"}, gpus=1, strategy="pack",
                             options={"cpu": ["tok"]})
    assert placement == {"tok": (None,), "llm": (0,)}


def test_pack_places_replicas_like_separate_processes(registry):
    placement = placement_of(registry, {"name": "r", "replicas": 3, "memory": 0.5}, gpus=2, strategy="pack")
    assert placement == {"r": (0, 0, 1)}


# -- spread --------------------------------------------------------------------------------------


def test_spread_deals_equal_stages_round_robin(registry):
    stages = [{"name": f"s{i}"} for i in range(5)]
    placement = placement_of(registry, *stages, gpus=2, strategy="spread")
    assert [placement[f"s{i}"][0] for i in range(5)] == [0, 1, 0, 1, 0]


def test_spread_puts_each_stage_on_the_least_loaded_gpu(registry):
    placement = placement_of(
        registry, {"name": "a", "memory": 0.6}, {"name": "b", "memory": 0.3}, {"name": "c", "memory": 0.2},
        {"name": "d", "memory": 0.2}, gpus=2, strategy="spread",
    )
    assert placement == {"a": (0,), "b": (1,), "c": (1,), "d": (1,)}


def test_spread_gives_tp_ranks_the_least_loaded_distinct_gpus(registry):
    placement = placement_of(registry, {"name": "a", "memory": 0.5}, {"name": "t", "tp_size": 2, "memory": 0.2},
                             gpus=3, strategy="spread")
    assert placement == {"a": (0,), "t": (1, 2)}


def test_spread_spreads_replicas_over_gpus(registry):
    placement = placement_of(registry, {"name": "r", "replicas": 4}, gpus=4, strategy="spread")
    assert placement == {"r": (0, 1, 2, 3)}


# -- every strategy ------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["explicit", "pack", "spread"])
def test_without_devices_every_strategy_places_everything_on_the_cpu(registry, strategy):
    placement = placement_of(
        registry, {"name": "a", "gpu": 0}, {"name": "t", "tp_size": 2, "replicas": 2}, gpus=0, strategy=strategy,
    )
    assert placement == {"a": (None,), "t": (None,) * 4}


@pytest.mark.parametrize("strategy", ["explicit", "pack", "spread"])
def test_stages_sharing_a_process_are_placed_together(registry, strategy):
    pinned = {"gpu": 1} if strategy == "explicit" else {}
    placement = placement_of(
        registry, {"name": "big", "memory": 0.5},
        {"name": "a", "process": "p", "memory": 0.2, **pinned}, {"name": "b", "process": "p", "memory": 0.2, **pinned},
        {"name": "c", "process": "p", "memory": 0.2, **pinned}, gpus=2, strategy=strategy,
    )
    assert placement["a"] == placement["b"] == placement["c"] != (None,)


def test_a_shared_process_needs_room_for_all_its_stages(registry):
    placement = placement_of(
        registry, {"name": "big", "memory": 0.5},
        {"name": "a", "process": "p", "memory": 0.3}, {"name": "b", "process": "p", "memory": 0.3},
        gpus=2, strategy="pack",
    )
    assert placement == {"big": (0,), "a": (1,), "b": (1,)}


# -- errors: which stage, which GPU, by how much -------------------------------------------------


@pytest.mark.parametrize("strategy", ["explicit", "pack", "spread"])
def test_a_gpu_field_beyond_the_visible_gpus_names_stage_and_gpu(registry, strategy):
    issue = error_of(registry, {"name": "a", "gpu": 3}, gpus=2, strategy=strategy).issues[0]
    assert issue.path == "stages[0].gpu"
    assert issue.message == "stage 'a' is placed on GPU 3, which is not visible (visible GPUs: 0, 1)"


@pytest.mark.parametrize("strategy", ["pack", "spread"])
def test_more_tp_ranks_than_gpus_is_an_error_naming_stage_and_gpu(registry, strategy):
    issue = error_of(registry, {"name": "t", "tp_size": 3}, gpus=2, strategy=strategy).issues[0]
    assert issue.path == "stages[0].gpu"
    assert "stage 't' has ranks" in issue.message
    assert "both on GPU" in issue.message
    assert "tp_size 3, 2 GPUs visible" in issue.message


def test_explicit_tp_ranks_do_not_silently_run_on_the_cpu_when_gpus_are_too_few(registry):
    issue = error_of(registry, {"name": "t", "tp_size": 3}, gpus=2).issues[0]
    assert issue.path == "stages[0].tp_size"
    assert issue.message == (
        "stage 't' has tp_size 3 but only 2 GPUs are given (GPU 0, GPU 1); each tensor-parallel rank needs a GPU of its own"
    )
    assert "lower tp_size to at most 2" in issue.hint


def test_a_stage_kept_on_the_cpu_may_have_more_ranks_than_gpus(registry):
    placement = placement_of(registry, {"name": "t", "tp_size": 3}, gpus=2, strategy="pack", options={"cpu": "t"})
    assert placement == {"t": (None, None, None)}


def test_a_strategy_that_moves_a_pinned_stage_is_an_error(registry):
    registry.add(Entry("placement", "mover", lambda request: {s.name: (1,) for s in request.stages}, "test"))
    issue = error_of(registry, {"name": "a", "gpu": 0}, gpus=2, strategy="mover").issues[0]
    assert issue.path == "stages[0].gpu"
    assert issue.message == "the placement strategy put stage 'a' on [1], but its 'gpu' says [0]"


def test_a_strategy_that_raises_names_the_plugin_and_the_strategy(registry):
    def broken(request):
        raise ZeroDivisionError("division by zero")

    registry.add(Entry("placement", "broken", broken, "acme-placement"))
    with pytest.raises(PluginError) as caught:
        plan_of(registry, {"name": "a"}, gpus=1, strategy="broken")
    assert str(caught.value).startswith(
        "placement strategy 'broken' of plugin 'acme-placement' raised ZeroDivisionError: division by zero"
    )


def test_idle_gpus_while_stages_run_on_the_cpu_are_a_warning(registry):
    plan = plan_of(registry, {"name": "a", "gpu": 0}, {"name": "b"}, {"name": "c"}, gpus=4)
    assert plan.warnings[-1] == (
        "3 GPUs idle (1, 2, 3) while b, c run on the CPU; give those stages 'gpu: N', or use placement "
        "strategy 'pack' or 'spread' (placement.options.cpu keeps a stage on the CPU)"
    )
    assert not plan_of(registry, {"name": "a"}, {"name": "b"}, gpus=2, strategy="spread").warnings
    assert not plan_of(registry, {"name": "a"}, gpus=2, strategy="pack", options={"cpu": "a"}).warnings


def test_explicit_tp_ranks_on_one_gpu_are_an_error(registry):
    issue = error_of(registry, {"name": "t", "tp_size": 2, "gpu": [1, 1]}, gpus=2).issues[0]
    assert issue.message.startswith("stage 't' has ranks 0 and 1 both on GPU 1; tensor-parallel ranks need distinct GPUs")


@pytest.mark.parametrize("strategy", ["explicit", "pack", "spread"])
def test_declared_memory_over_a_gpu_budget_names_gpu_amount_and_stages(registry, strategy):
    error = error_of(
        registry, {"name": "enc", "memory": 0.6, "gpu": 0}, {"name": "llm", "memory": 0.65, "gpu": 0},
        gpus=1, strategy=strategy, memory_per_gpu=80 * GIB,
    )
    (issue,) = error.issues
    assert issue.path == "stages[1].memory"
    assert issue.message == (
        "GPU 0 is over its memory budget by 25% (20.0 GiB) at stage 'llm': enc 60%, llm 65% (total 125%)"
    )


@pytest.mark.parametrize("strategy", ["pack", "spread"])
def test_more_demand_than_all_gpus_hold_is_an_error(registry, strategy):
    error = error_of(registry, *[{"name": f"s{i}", "memory": 0.7} for i in range(3)], gpus=2, strategy=strategy)
    assert any("is over its memory budget" in i.message and "s2" in i.message for i in error.issues)


def test_bytes_on_a_gpu_of_unknown_memory_name_stage_and_gpu(registry):
    issue = error_of(registry, {"name": "llm", "memory": 20 * GIB}, gpus=2, strategy="pack").issues[0]
    assert issue.path == "stages[0].memory"
    assert issue.message == "stage 'llm' asks for 20.0 GiB on GPU 0, whose memory is unknown"
    assert "placement.memory_per_gpu" in issue.hint


def test_stages_of_one_process_on_different_gpus_are_an_error(registry):
    issue = error_of(registry, {"name": "a", "process": "p", "gpu": 0}, {"name": "b", "process": "p", "gpu": 1},
                     gpus=2).issues[0]
    assert issue.path == "stages[1].process"
    assert issue.message.startswith("stages 'a' and 'b' share process 'p' but are placed on GPU 0 and GPU 1")


def test_unknown_option_suggests_the_closest(registry):
    issue = error_of(registry, {"name": "a"}, gpus=1, strategy="pack", options={"default_mem": 0.2}).issues[0]
    assert (issue.path, issue.message, issue.hint) == (
        "placement.options.default_mem", "unknown placement option 'default_mem'", "did you mean 'default_memory'?"
    )


def test_cpu_option_with_an_unknown_stage_suggests_the_closest(registry):
    issue = error_of(registry, {"name": "tokenizer"}, gpus=1, strategy="spread", options={"cpu": ["tokeniser"]}).issues[0]
    assert (issue.path, issue.hint) == ("placement.options.cpu[0]", "did you mean 'tokenizer'?")


@pytest.mark.parametrize("value", [0, -1, "half", True])
def test_default_memory_must_be_a_positive_number(registry, value):
    issue = error_of(registry, {"name": "a"}, gpus=1, strategy="pack", options={"default_memory": value}).issues[0]
    assert issue.path == "placement.options.default_memory"


# -- plugin strategies are checked the same way --------------------------------------------------


def request(*stages: StageDemand, gpus: int = 2) -> PlacementRequest:
    return PlacementRequest(stages=stages, devices=tuple(Device(i) for i in range(gpus)))


def test_answer_of_the_wrong_length_is_an_error_naming_the_stage():
    (issue,) = check_placement(request(StageDemand("t", tp_size=2)), {"t": [0]})
    assert issue.path == "stages[0].gpu"
    assert issue.message == "the placement strategy gave stage 't' [0]; expected 2 GPU ids (or null for the CPU)"


def test_answer_missing_a_stage_is_an_error():
    (issue,) = check_placement(request(StageDemand("a"), StageDemand("b")), {"a": [0]})
    assert "stage 'b' None" in issue.message


def test_answer_may_give_one_id_per_replica_and_rank():
    stages = (StageDemand("t", tp_size=2, replicas=2),)
    assert check_placement(request(*stages), {"t": [0, 1, 1, 0]}) == []


def test_answer_with_cpu_and_gpu_ranks_mixed_is_an_error():
    (issue,) = check_placement(request(StageDemand("t", tp_size=2)), {"t": [None, 1]})
    assert issue.message == "stage 't' has ranks on the CPU and on GPU 1"


def test_a_registered_plugin_strategy_is_used_and_checked(registry):
    def everything_on_gpu_zero(req):
        return {s.name: [0] * s.tp_size for s in req.stages}

    registry.add(Entry(kind="placement", name="zero", target=everything_on_gpu_zero, plugin="tests"))
    assert placement_of(registry, {"name": "a"}, gpus=1, strategy="zero") == {"a": (0,)}
    issue = error_of(registry, {"name": "t", "tp_size": 2}, gpus=2, strategy="zero").issues[0]
    assert "both on GPU 0" in issue.message


def test_builtin_strategies_are_pure_functions_of_the_request():
    req = request(StageDemand("a", memory=0.4), StageDemand("t", tp_size=2), StageDemand("b", memory=0.4))
    for strategy in (explicit, pack, spread):
        assert strategy(req) == strategy(req)


# -- warnings ------------------------------------------------------------------------------------


def test_default_shares_over_budget_are_a_warning_not_an_error(registry):
    plan = plan_of(registry, {"name": "llm", "memory": 0.95, "gpu": 0}, {"name": "vocoder", "gpu": 0}, gpus=1)
    assert plan.warnings == (
        "GPU 0 may be over its memory budget: 105% counting vocoder, which sets no memory, at the default "
        "10%; set 'memory' on it",
    )


def test_several_default_shares_over_budget_are_named_in_one_warning(registry):
    plan = plan_of(registry, {"name": "llm", "memory": 0.85, "gpu": 0}, {"name": "a", "gpu": 0}, {"name": "b", "gpu": 0},
                   gpus=1, options={"default_memory": 8 * GIB}, memory_per_gpu=80 * GIB)
    assert plan.warnings == (
        "GPU 0 may be over its memory budget: 105% counting a, b, which set no memory, at the default "
        "8.0 GiB each; set 'memory' on them",
    )


def test_a_tp_stage_sharing_a_gpu_with_another_stage_is_a_warning(registry):
    plan = plan_of(registry, {"name": "enc", "gpu": 1}, {"name": "llm", "tp_size": 2, "gpu": 0}, gpus=2)
    assert plan.warnings == (
        "GPU 1 is shared by tensor-parallel llm rank 1 and enc; TP ranks run in lockstep, so the slowest GPU "
        "sets the pace",
    )


def test_gpu_fields_without_any_visible_gpu_are_a_warning(registry):
    plan = plan_of(registry, {"name": "a", "gpu": 0}, {"name": "b"}, gpus=0)
    assert plan.warnings == (
        "no GPU is visible: a run on the CPU despite their 'gpu' (plan with --gpus N to simulate GPUs)",
    )


def test_a_plan_that_fits_has_no_warnings(registry):
    plan = plan_of(registry, quarter("a"), quarter("b"), {"name": "t", "tp_size": 2, "memory": 0.5}, gpus=4,
                   strategy="spread")
    assert plan.warnings == ()


@pytest.mark.parametrize(("fraction", "text"), [(0.25, "25%"), (0.125, "12.5%"), (1.0, "100%"), (0.3333, "33.3%")])
def test_percent_shows_at_most_one_decimal(fraction, text):
    assert percent(fraction) == text

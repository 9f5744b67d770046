"""From a placement to processes: process groups, TP ranks, replicas, environments, device
visibility, edges and endpoints, for mixed topologies."""

from __future__ import annotations

import pytest
from test_placement import GIB, pipeline

from omni_core.config import structure
from omni_core.errors import ConfigError
from omni_core.plan import OBJECT_RELAY, build_plan, endpoints
from omni_core.plan.topology import build_processes, visible_devices


def plan_for(registry, *stages, gpus=2, environ=None, strategy="explicit", **top):
    mapping = pipeline(*stages, strategy=strategy)
    mapping.update(top)
    return build_plan(structure(mapping), registry, gpus=gpus, cores=12, environ=environ or {})


def test_one_process_hosting_three_stages(registry):
    plan = plan_for(
        registry,
        {"name": "reader", "process": "front", "gpu": 1},
        {"name": "tokenizer", "process": "front", "gpu": 1},
        {"name": "encoder", "process": "front", "gpu": 1},
        {"name": "llm", "gpu": 0},
    )
    front = plan.process("front")
    assert front.stages == ("reader", "tokenizer", "encoder")
    assert (front.gpu, front.device, front.forced_env["CUDA_VISIBLE_DEVICES"]) == (1, "cuda:0", "1")
    assert [p.name for p in plan.processes] == ["front", "llm"]
    assert plan.edge("reader", "tokenizer").relay == OBJECT_RELAY
    assert plan.edge("tokenizer", "encoder").local
    assert not plan.edge("encoder", "llm").local
    assert plan.edge("encoder", "llm").relay != OBJECT_RELAY
    assert plan.processes_of("tokenizer") == ["front"]


def test_two_processes_sharing_one_simulated_gpu(registry):
    plan = plan_for(
        registry,
        {"name": "asr", "gpu": 0, "memory": 0.3},
        {"name": "llm", "gpu": 0, "memory": 0.6},
        gpus=1,
    )
    asr, llm = plan.process("asr"), plan.process("llm")
    assert asr.gpu == llm.gpu == 0
    assert asr.forced_env["CUDA_VISIBLE_DEVICES"] == llm.forced_env["CUDA_VISIBLE_DEVICES"] == "0"
    (load,) = plan.loads
    assert [h.stage for h in load.holders] == ["asr", "llm"]
    assert load.total == pytest.approx(0.9)
    assert plan.warnings == ()


def test_a_tp_stage_runs_one_process_per_rank_with_rank_zero_leading(registry):
    plan = plan_for(registry, {"name": "enc"}, {"name": "llm", "tp_size": 4, "gpu": 0}, gpus=4)
    ranks = plan.group("llm")
    assert [p.name for p in ranks] == ["llm.0", "llm.1", "llm.2", "llm.3"]
    assert [p.gpu for p in ranks] == [0, 1, 2, 3]
    assert [p.tp_rank for p in ranks] == [0, 1, 2, 3]
    assert {p.tp_size for p in ranks} == {4}
    assert [p.leader for p in ranks] == [None, "llm.0", "llm.0", "llm.0"]
    assert [p.name for p in plan.leaders()] == ["enc", "llm.0"]
    assert plan.processes_of("llm") == ["llm.0"]
    assert [p.forced_env["CUDA_VISIBLE_DEVICES"] for p in ranks] == ["0", "1", "2", "3"]
    assert {p.device for p in ranks} == {"cuda:0"}


def test_replicated_tp_stage_names_every_process_by_replica_and_rank(registry):
    plan = plan_for(registry, {"name": "llm", "tp_size": 2, "replicas": 2}, gpus=4, strategy="spread")
    assert [(p.name, p.gpu, p.leader) for p in plan.processes] == [
        ("llm#0.0", 0, None), ("llm#0.1", 1, "llm#0.0"), ("llm#1.0", 2, None), ("llm#1.1", 3, "llm#1.0"),
    ]
    assert plan.processes_of("llm") == ["llm#0.0", "llm#1.0"]
    assert plan.placement == {"llm": (0, 1, 2, 3)}


def test_the_plan_answers_a_requests_replica_and_a_leaders_followers(registry):
    plan = plan_for(registry, {"name": "a"}, {"name": "llm", "tp_size": 2, "replicas": 3}, gpus=6, strategy="spread")
    assert [plan.replica("llm", rid) for rid in range(5)] == ["llm#0.0", "llm#1.0", "llm#2.0", "llm#0.0", "llm#1.0"]
    assert {plan.replica("a", rid) for rid in range(5)} == {"a"}
    assert plan.followers("llm#1.0") == ["llm#1.1"]
    assert plan.followers("a") == [] and plan.followers("llm#1.1") == []


def test_mixed_topology_shared_process_shared_gpu_and_tp(registry):
    plan = plan_for(
        registry,
        {"name": "audio", "process": "front", "memory": 0.1},
        {"name": "vision", "process": "front", "memory": 0.1},
        {"name": "thinker", "tp_size": 2, "memory": 0.5, "stream_to": "talker"},
        {"name": "talker", "memory": 0.3},
        {"name": "vocoder", "memory": 0.1},
        gpus=2, strategy="pack",
    )
    assert plan.groups == ["front", "thinker", "talker", "vocoder"]
    assert [(p.name, p.gpu) for p in plan.processes] == [
        ("front", 0), ("thinker.0", 0), ("thinker.1", 1), ("talker", 0), ("vocoder", 1),
    ]
    assert plan.edge("thinker", "talker", "stream").relay != OBJECT_RELAY
    assert len(plan.warnings) == 2 and all("tensor-parallel thinker" in w for w in plan.warnings)


# -- environment -----------------------------------------------------------------------------------


def test_placement_ids_index_into_the_operators_cuda_visible_devices(registry):
    plan = plan_for(registry, {"name": "a", "gpu": 0}, {"name": "t", "tp_size": 2, "gpu": 1}, gpus=3,
                    environ={"CUDA_VISIBLE_DEVICES": "4, 6,GPU-8f2c"})
    assert [(p.name, p.gpu, p.physical_gpu) for p in plan.processes] == [
        ("a", 0, "4"), ("t.0", 1, "6"), ("t.1", 2, "GPU-8f2c"),
    ]
    assert plan.process("t.1").forced_env == {"CUDA_VISIBLE_DEVICES": "GPU-8f2c", "OMNI_GPU_ID": "2"}


def test_without_cuda_visible_devices_the_placement_id_is_the_physical_id(registry):
    plan = plan_for(registry, {"name": "a", "gpu": 1}, gpus=2)
    assert plan.process("a").forced_env == {"CUDA_VISIBLE_DEVICES": "1", "OMNI_GPU_ID": "1"}


def test_a_placement_beyond_the_operators_visible_devices_is_an_error(registry):
    with pytest.raises(ConfigError) as caught:
        plan_for(registry, {"name": "a"}, {"name": "b", "gpu": 2}, gpus=4, environ={"CUDA_VISIBLE_DEVICES": "0,1"})
    (issue,) = caught.value.issues
    assert issue.path == "stages[1].gpu"
    assert issue.message == "stage 'b' is placed on GPU 2, but CUDA_VISIBLE_DEVICES='0,1' makes only 2 GPUs visible"


def test_a_cpu_process_sees_no_gpu(registry):
    plan = plan_for(registry, {"name": "a"}, gpus=2, environ={"CUDA_VISIBLE_DEVICES": "0,1"})
    proc = plan.process("a")
    assert (proc.gpu, proc.device, proc.forced_env) == (None, "cpu", {"CUDA_VISIBLE_DEVICES": ""})


def test_environment_precedence_config_then_operator_then_placement(registry):
    plan = plan_for(
        registry,
        {"name": "a", "gpu": 0, "env": {"HF_HOME": "/stage", "MODE": "stage"}},
        env_defaults={"HF_HOME": "/defaults", "LOG": "info"},
    )
    proc = plan.process("a")
    assert proc.env == {"HF_HOME": "/stage", "LOG": "info", "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "12",
                        "MODE": "stage"}
    full = proc.environment({"MODE": "operator", "CUDA_VISIBLE_DEVICES": "3"})
    assert (full["MODE"], full["LOG"], full["CUDA_VISIBLE_DEVICES"]) == ("operator", "info", "0")


def test_threads_default_to_cores_per_process_unless_the_stage_sets_them(registry):
    plan = plan_for(registry, {"name": "a"}, {"name": "t", "tp_size": 2}, {"name": "b", "threads": 5}, gpus=0)
    assert [(p.name, p.threads, p.env["OMP_NUM_THREADS"]) for p in plan.processes] == [
        ("a", 3, "3"), ("t.0", 3, "3"), ("t.1", 3, "3"), ("b", 5, "5"),
    ]


def test_injected_factory_values_follow_device_and_rank(registry):
    plan = plan_for(registry, {"name": "cpu"}, {"name": "t", "tp_size": 2, "gpu": 0}, gpus=2)
    assert plan.process("cpu").injected_args("c") == {
        "stage_name": "c", "device": "cpu", "gpu_id": None, "tp_rank": 0, "tp_size": 1, "tp_init_method": None}
    assert plan.process("t.1").injected_args("t", "tcp://h:1") == {
        "stage_name": "t", "device": "cuda:0", "gpu_id": 0, "tp_rank": 1, "tp_size": 2, "tp_init_method": "tcp://h:1"}


@pytest.mark.parametrize(("value", "entries"), [
    (None, None), ("", []), ("0", ["0"]), ("2, 3,", ["2", "3"]), ("MIG-a,MIG-b", ["MIG-a", "MIG-b"]),
])
def test_visible_devices_reads_the_cuda_visible_devices_list(value, entries):
    environ = {} if value is None else {"CUDA_VISIBLE_DEVICES": value}
    assert visible_devices(environ) == entries


def test_build_processes_reads_no_environment_unless_given_one(registry, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    cfg = structure(pipeline({"name": "a", "gpu": 0}))
    (proc,) = build_processes(cfg, {"a": (0,)}, cores=1)
    assert proc.physical_gpu == "0"


# -- devices and endpoints -------------------------------------------------------------------------


def test_placement_gpus_in_the_config_simulates_devices(registry):
    cfg = structure(pipeline({"name": "a"}, {"name": "b"}, strategy="spread", gpus=3, memory_per_gpu=40 * GIB))
    plan = build_plan(cfg, registry, cores=1, environ={})
    assert plan.simulated
    assert [(d.index, d.memory) for d in plan.devices] == [(0, 40 * GIB), (1, 40 * GIB), (2, 40 * GIB)]
    assert plan.placement == {"a": (0,), "b": (1,)}


def test_gpus_argument_overrides_the_config(registry):
    cfg = structure(pipeline({"name": "a"}, strategy="pack", gpus=3))
    assert build_plan(cfg, registry, gpus=0, cores=1, environ={}).placement == {"a": (None,)}


def test_every_process_and_the_coordinator_get_their_own_endpoint(registry):
    plan = plan_for(registry, {"name": "a", "process": "p"}, {"name": "b", "process": "p"},
                    {"name": "t", "tp_size": 2}, gpus=0)
    addresses = endpoints(plan, "/run/x")
    assert addresses == {"": "ipc:///run/x/coordinator", "p": "ipc:///run/x/p0", "t.0": "ipc:///run/x/p1",
                         "t.1": "ipc:///run/x/p2"}

"""Without a cluster: the ``launch:`` mapping's validation, node assignment from a described
inventory, endpoint and relay choice by node, and ``omni plan --launcher ray --cluster``."""

from __future__ import annotations

import json

import pytest
import yaml
from omni_core.cli import app
from omni_core.config import load_config
from omni_core.errors import ConfigError
from omni_core.plan import build_plan
from omni_core.plan.topology import cross_node_relay, endpoint_views, place_on_nodes, tcp_receivers
from omni_core.plugins import get_registry
from typer.testing import CliRunner

from omni_ray.launcher import RayLauncher
from omni_ray.placement import assign_nodes, load_inventory

CLUSTER = {"nodes": [
    {"name": "head", "cpus": 4, "resources": {"head": 1}},
    {"name": "a", "cpus": 8, "gpus": 2, "gpu_memory": 80 * 2**30, "resources": {"node_a": 4}},
    {"name": "b", "cpus": 8, "gpus": 2, "gpu_memory": 80 * 2**30, "resources": {"node_b": 4}},
]}


def st(name, **fields):
    return {"name": name, "factory": "ray_test_stages:Where", **fields}


def config(*stages, **fields):
    return {"name": "p", "launcher": "ray", "stages": list(stages), **fields}


def plan_of(cfg, gpus=None):
    return build_plan(load_config(cfg, validate=False), get_registry(), gpus=gpus, environ={})


def test_unknown_launch_keys_are_rejected_at_their_path():
    cfg = config(st("a", terminal=True, launch={"resources": {"node_a": 1}, "num_cpu": 1, "num_gpus": -1}))
    with pytest.raises(ConfigError) as exc:
        load_config(cfg)
    text = str(exc.value)
    assert "stages[0].launch.num_cpu: unknown launch option 'num_cpu'" in text
    assert "stages[0].launch.num_gpus" in text
    load_config(config(st("a", terminal=True, launch={"resources": {"node_a": 1}, "num_cpus": 0.5})))


def test_unknown_launcher_option_is_a_config_error():
    with pytest.raises(ConfigError, match="adress"):
        RayLauncher({"adress": "auto"})


def test_tp_ranks_share_a_node_replicas_spread_and_resources_pin():
    cfg = config(
        st("enc", next="llm", replicas=2, memory=0.2),
        st("llm", next="voc", tp_size=2, gpu=None, memory=0.5),
        st("voc", terminal=True, memory=0.3, launch={"resources": {"node_b": 1}}),
        placement={"strategy": "ray", "gpus": 4},
    )
    plan = plan_of(cfg)
    nodes = assign_nodes(plan, load_inventory(CLUSTER))
    assert nodes["enc#0"] != nodes["enc#1"]
    assert nodes["llm.0"] == nodes["llm.1"] in ("a", "b")
    assert nodes["voc"] == "b"
    assert nodes[""] == "head"


def test_a_group_that_fits_nowhere_names_its_stage():
    plan = plan_of(config(st("a", terminal=True, launch={"resources": {"node_c": 1}})))
    with pytest.raises(ConfigError, match=r"stages\[0\].launch.*fits on no node"):
        assign_nodes(plan, load_inventory(CLUSTER))


def test_tcp_only_where_a_sender_is_on_another_node_and_views_use_ipc_on_the_node():
    plan = plan_of(config(st("a", next="b"), st("b", next="c"), st("c", terminal=True)))
    nodes = {"": "n0", "a": "n0", "b": "n0", "c": "n1"}
    need = tcp_receivers(plan, nodes)
    assert need == {"", "b", "c"}  # c sends results and credits to b and the coordinator; a hears only from n0
    views = endpoint_views(plan, "/run", nodes, {n: f"tcp://h:{i}" for i, n in enumerate(sorted(need))})
    assert views["a"]["b"].startswith("ipc://") and views["b"]["c"].startswith("tcp://")
    assert views["c"]["b"].startswith("tcp://") and views["c"][""].startswith("tcp://")
    assert views[""]["a"].startswith("ipc://") and views[""]["c"].startswith("tcp://")
    assert views["c"]["a"].startswith("unreachable://")  # c never sends to a


def test_cross_node_edges_take_inline_and_a_forced_node_relay_is_refused():
    plan = plan_of(config(st("a", next="b"), st("b", terminal=True)))
    placed = place_on_nodes(plan, {"": "x", "a": "x", "b": "y"}, get_registry())
    assert [(e.relay, e.crosses_nodes) for e in placed.edges] == [("inline", True)]
    same = place_on_nodes(plan, {"": "x", "a": "x", "b": "x"}, get_registry())
    assert [(e.relay, e.crosses_nodes) for e in same.edges] == [("shm", False)]
    cfg = load_config(config(st("a", next="b"), st("b", terminal=True), relay="shm"), validate=False)
    with pytest.raises(ConfigError, match="cannot cross nodes"):
        cross_node_relay(cfg, cfg.stage("a"), get_registry())


def test_omni_plan_with_launcher_ray_and_a_cluster_shows_nodes_and_crossing_edges(tmp_path):
    cfg = config(
        st("a", next="b", launch={"resources": {"head": 1}}),
        st("b", next="c", launch={"resources": {"node_a": 1}}),
        st("c", terminal=True, launch={"resources": {"node_a": 1}}),
    )
    cfg["launcher"] = "local"
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(CLUSTER))
    runner = CliRunner()
    out = runner.invoke(app, ["plan", str(tmp_path / "p.yaml"), "--launcher", "ray", "--cluster", str(tmp_path / "cluster.yaml")])
    assert out.exit_code == 0, out.output
    assert "crosses nodes" in out.output
    lines = [line.split() for line in out.output.splitlines()]
    inline_cost = get_registry().get("relay", "inline").capabilities.ms_per_mib
    assert ["a", "b", "next", "inline", "yes", f"{inline_cost:g}", "ms"] in lines  # the bench's cost per MiB
    assert ["b", "c", "next", "shm", "no", "-"] in lines
    assert ["b", "a"] in lines and ["c", "a"] in lines
    data = json.loads(runner.invoke(app, ["plan", str(tmp_path / "p.yaml"), "--launcher", "ray", "--json",
                                          "--cluster", str(tmp_path / "cluster.yaml")]).output)
    assert data["nodes"] == {"coordinator": "head", "a": "head", "b": "a", "c": "a"}
    assert data["crossing_edges"] == [{"src": "a", "dst": "b", "kind": "next", "relay": "inline",
                                       "ms_per_mib": inline_cost}]
    bad = runner.invoke(app, ["plan", str(tmp_path / "p.yaml"), "--cluster", str(tmp_path / "cluster.yaml")])
    assert bad.exit_code != 0 and "--cluster needs a launcher" in bad.output

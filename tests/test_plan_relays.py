"""The ``auto`` relay per edge: objects inside a process, a GPU relay between GPU stages when one
is installed, the best host relay otherwise; forced backends win."""

from __future__ import annotations

import types

from omni_core.config import structure
from omni_core.plan import build_plan
from omni_core.plugins import hookimpl, load_plugins
from omni_core.relay.base import Relay, RelayCapabilities


class FakeCudaRelay(Relay):
    name = "fake_cuda"
    capabilities = RelayCapabilities(devices=frozenset({"cuda"}), scopes=frozenset({"node"}), priority=20)

    async def put(self, request_id, tensors, target):  # pragma: no cover - never called
        raise NotImplementedError

    async def get(self, handle, frames=()):  # pragma: no cover
        raise NotImplementedError


def _registry(with_cuda: bool):
    plugin = types.SimpleNamespace()

    @hookimpl
    def omni_register_relays(register):
        register("fake_cuda", FakeCudaRelay)

    plugin.omni_register_relays = omni_register_relays
    extra = [("fakecuda", plugin)] if with_cuda else []
    return load_plugins(env={"OMNI_LOAD_PLUGINS": ""}, extra=extra).registry


def _config(**pipeline):
    return structure({
        "name": "relays",
        "stages": [
            {"name": "enc", "factory": "x:Y", "gpu": 0, "next": ["llm", "cpu_post"]},
            {"name": "llm", "factory": "x:Y", "gpu": 1, "next": "voc"},
            {"name": "voc", "factory": "x:Y", "gpu": 1, "process": "speech", "terminal": True},
            {"name": "cpu_post", "factory": "x:Y", "terminal": True},
        ],
        **pipeline,
    })


def _relays(plan):
    return {(e.src, e.dst): e.relay for e in plan.edges}


def test_gpu_edges_take_the_gpu_relay_and_host_edges_take_shm():
    plan = build_plan(_config(), _registry(with_cuda=True), gpus=2)
    assert _relays(plan) == {("enc", "llm"): "fake_cuda", ("enc", "cpu_post"): "shm", ("llm", "voc"): "fake_cuda"}


def test_without_a_gpu_relay_gpu_edges_go_through_shm():
    plan = build_plan(_config(), _registry(with_cuda=False), gpus=2)
    assert set(_relays(plan).values()) == {"shm"}


def test_a_forced_backend_wins_over_auto_and_a_stage_overrides_the_pipeline():
    cfg = _config(relay="inline")
    plan = build_plan(cfg, _registry(with_cuda=True), gpus=2)
    assert set(_relays(plan).values()) == {"inline"}
    data = {"name": "r", "relay": "inline", "stages": [
        {"name": "a", "factory": "x:Y", "next": "b", "relay": {"backend": "shm"}},
        {"name": "b", "factory": "x:Y", "next": "c"},
        {"name": "c", "factory": "x:Y", "terminal": True},
    ]}
    plan = build_plan(structure(data), _registry(with_cuda=False), gpus=0)
    assert _relays(plan) == {("a", "b"): "shm", ("b", "c"): "inline"}


def test_edges_inside_one_process_pass_objects():
    cfg = structure({
        "name": "local",
        "stages": [
            {"name": "a", "factory": "x:Y", "process": "p", "next": "b"},
            {"name": "b", "factory": "x:Y", "process": "p", "terminal": True},
        ],
    })
    plan = build_plan(cfg, _registry(with_cuda=False), gpus=0)
    assert [(e.relay, e.local) for e in plan.edges] == [("object", True)]

"""The generic stages called directly (one process, a stand-in context): contrib.torch_module,
contrib.function, contrib.tee, contrib.collect. Through real stage processes: test_pipelines.py."""

from __future__ import annotations

import asyncio
import inspect

import pytest
import torch
from conftest import arun
from omni_contrib_stages.stages import Collect, Tee, TorchModule, function_stage

from omni_core.kits import BatcherClosed

H = "contrib_test_helpers"


class FakeCtx:
    """What a stage sees of a request, without a pipeline: emitted chunks are recorded and
    ``stream_from`` yields the given chunks."""

    def __init__(self, streams: dict | None = None, payload=None):
        self.emitted: list = []
        self._payload = payload
        self.streams = streams or {}
        self.aborted = False
        self.loop = asyncio.get_running_loop()

    async def emit(self, chunk):
        self.emitted.append(chunk)

    def emit_threadsafe(self, chunk, timeout=None):
        asyncio.run_coroutine_threadsafe(self.emit(chunk), self.loop).result(timeout)

    async def _iterate(self, chunks):
        for chunk in chunks:
            yield chunk

    def stream_from(self, stage):
        return self._iterate(self.streams[stage])

    async def payload(self):
        return self._payload


async def call(stage, payload, **streams):
    """Call a stage as the runtime does: async ones awaited, plain ones in a worker thread."""
    ctx = FakeCtx(streams, payload)
    if inspect.iscoroutinefunction(type(stage).__call__):
        result = await stage(payload, ctx)
    else:
        result = await asyncio.to_thread(stage, payload, ctx)
    return result, ctx.emitted


# -- contrib.torch_module ---------------------------------------------------------------------------


def test_concurrent_requests_are_batched_and_each_gets_its_own_row():
    from contrib_test_helpers import Affine

    xs = [torch.randn(3, generator=torch.Generator().manual_seed(i)) for i in range(6)]

    async def body():
        stage = TorchModule(f"{H}:Affine", {"n": 3, "out": 2}, seed=7, max_batch_size=4, max_wait_ms=50)
        Affine.seen.clear()
        results = await asyncio.gather(*(stage(x, FakeCtx()) for x in xs))
        stats = stage.batcher.stats
        await stage.close()
        return stage, results, stats

    stage, results, stats = arun(body())
    assert stats.sizes == {4: 1, 2: 1} and Affine.seen == [4, 2]
    for x, y in zip(xs, results, strict=True):
        assert y.shape == (2,)
        assert torch.allclose(y, stage.model(x.unsqueeze(0))[0].detach())
        assert not y.is_inference() and not y.requires_grad


def test_seed_makes_the_weights_reproducible_without_touching_the_global_generator():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = TorchModule(f"{H}:Affine", seed=1)
    assert torch.equal(torch.rand(1), expected_next)  # the process's random state is untouched
    b = TorchModule(f"{H}:Affine", seed=1)
    c = TorchModule(f"{H}:Affine", seed=2)
    assert torch.equal(a.model.linear.weight, b.model.linear.weight)
    assert not torch.equal(a.model.linear.weight, c.model.linear.weight)


def test_input_and_output_keys_lists_and_dtype():
    async def body():
        stage = TorchModule(f"{H}:Affine", {"n": 2, "out": 1}, input_key="x", output_key="y", dtype="bfloat16", seed=0)
        result, _ = await call(stage, {"x": [1.0, 2.0], "keep": "me"})
        await stage.close()
        return result

    result = arun(body())
    assert set(result) == {"keep", "y"}  # the input is consumed, the rest travels along
    assert result["keep"] == "me"
    assert result["y"].dtype == torch.bfloat16 and result["y"].shape == (1,)


def test_structured_outputs_are_split_per_request():
    async def body():
        stage = TorchModule(f"{H}:Parts", max_wait_ms=20)
        results = await asyncio.gather(stage(torch.tensor([1.0, 2.0]), FakeCtx()), stage(torch.tensor([3.0, 5.0]), FakeCtx()))
        stats = stage.batcher.stats
        await stage.close()
        return results, stats

    (first, second), stats = arun(body())
    assert stats.sizes == {2: 1}
    assert first["double"].tolist() == [2.0, 4.0] and second["double"].tolist() == [6.0, 10.0]
    assert isinstance(first["pair"], tuple)
    assert (first["pair"][0].item(), first["pair"][1].item()) == (3.0, 1.5)
    assert (second["pair"][0].item(), second["pair"][1].item()) == (8.0, 4.0)


def test_samples_of_different_shapes_run_apart_and_fail_apart():
    async def body():
        stage = TorchModule(f"{H}:FailsOnNegative", max_wait_ms=50)
        results = await asyncio.gather(
            stage(torch.tensor([-1.0]), FakeCtx()),
            stage(torch.tensor([1.0, 2.0]), FakeCtx()),
            stage(torch.tensor([3.0, 4.0]), FakeCtx()),
            return_exceptions=True,
        )
        await stage.close()
        return results

    bad, ok1, ok2 = arun(body())
    assert isinstance(bad, ValueError) and "negative input" in str(bad)
    assert ok1.tolist() == [2.0, 3.0] and ok2.tolist() == [4.0, 5.0]


def test_weights_file_is_loaded(tmp_path):
    from contrib_test_helpers import Affine

    torch.manual_seed(5)
    reference = Affine(3, 2)
    torch.save(reference.state_dict(), tmp_path / "w.pt")

    async def body():
        stage = TorchModule(f"{H}:Affine", {"n": 3, "out": 2}, weights=str(tmp_path / "w.pt"), seed=99)
        result, _ = await call(stage, torch.ones(3))
        await stage.close()
        return result

    assert torch.allclose(arun(body()), reference(torch.ones(1, 3))[0].detach())


def test_a_factory_function_can_build_the_module():
    stage = TorchModule(f"{H}:make_affine", {"n": 4})
    assert stage.model.linear.in_features == 4 and not stage.model.training


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"module": f"{H}:not_a_module"}, TypeError, "built a object, not a torch.nn.Module"),
        ({"module": f"{H}:Affine", "module_args": {"width": 3}}, TypeError, r"cannot build .*Affine' with module_args \{'width': 3\}"),
        ({"module": "Affine"}, ValueError, "module must be a 'package.module:attr' path"),
        ({"module": f"{H}:Affine", "dtype": "float8"}, ValueError, "unknown dtype 'float8'"),
        ({"module": "no_such_module_xyz:Thing"}, Exception, "cannot import module 'no_such_module_xyz'"),
    ],
)
def test_construction_errors_say_what_is_wrong(kwargs, error, message):
    with pytest.raises(error, match=message):
        TorchModule(stage_name="enc", **kwargs)


def test_call_errors_say_what_is_wrong():
    async def body():
        keyed = TorchModule(f"{H}:Affine", input_key="x", stage_name="enc")
        scalar = TorchModule(f"{H}:NoBatchDim", stage_name="sum")
        with pytest.raises(KeyError, match=r"stage 'enc': the payload has no key 'x' \(input_key\); it has \['y'\]"):
            await keyed({"y": 1}, FakeCtx())
        with pytest.raises(TypeError, match=r"payload\['x'\] is not a tensor and cannot become one"):
            await keyed({"x": "text"}, FakeCtx())
        with pytest.raises(ValueError, match=r"tensor of shape \(\) for a batch of 1; its first dimension must be the batch"):
            await scalar(torch.ones(2), FakeCtx())
        await keyed.close()
        with pytest.raises(BatcherClosed):
            await keyed({"x": [1.0, 2.0, 3.0]}, FakeCtx())
        await scalar.close()

    arun(body())


# -- contrib.function -------------------------------------------------------------------------------


def test_a_plain_function_runs_in_a_worker_thread_and_an_async_one_on_the_loop():
    sync_stage = function_stage(f"{H}:upper", {"suffix": "!"})
    async_stage = function_stage(f"{H}:async_upper", {"suffix": "?"})
    assert not inspect.iscoroutinefunction(type(sync_stage).__call__)
    assert inspect.iscoroutinefunction(type(async_stage).__call__)

    async def body():
        return (await call(sync_stage, "hi"))[0], (await call(async_stage, "ho"))[0]

    assert arun(body()) == ("HI!", "HO?")
    thread = arun(call(function_stage(f"{H}:thread_name"), None))[0]
    assert thread != "MainThread"


def test_function_input_and_output_keys():
    stage = function_stage(f"{H}:upper", input_key="text", output_key="shout")
    result, _ = arun(call(stage, {"text": "abc", "id": 3}))
    assert result == {"id": 3, "shout": "ABC"}


@pytest.mark.parametrize("fn", ["words_with_ctx", "async_words_with_ctx"])
def test_a_function_declaring_ctx_can_stream(fn):
    result, emitted = arun(call(function_stage(f"{H}:{fn}"), "one two three"))
    assert result == 3
    assert emitted == [{"word": "one"}, {"word": "two"}, {"word": "three"}]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"function": f"{H}:gen"}, TypeError, "is a generator; write a stage class"),
        ({"function": f"{H}:upper", "kwargs": {"prefix": "x"}}, TypeError, r"cannot be called with one value and kwargs \['prefix'\]"),
        ({"function": f"{H}:words_with_ctx", "kwargs": {"ctx": 1}}, ValueError, "'ctx' cannot be set in kwargs"),
        ({"function": "upper"}, ValueError, "function must be a 'package.module:attr' path"),
    ],
)
def test_function_stage_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        function_stage(stage_name="fn", **kwargs)


# -- contrib.tee and contrib.collect ------------------------------------------------------------------


def test_tee_passes_the_payload_and_re_emits_a_stream():
    assert arun(call(Tee(), {"a": 1})) == ({"a": 1}, [])
    result, emitted = arun(call(Tee(stream_from="src"), {"a": 1}, src=[1, 2, 3]))
    assert (result, emitted) == ({"a": 1}, [1, 2, 3])


def test_collect_gathers_a_stream():
    assert arun(call(Collect("src"), {"a": 1}, src=["x", "y"]))[0] == {"a": 1, "chunks": ["x", "y"]}
    assert arun(call(Collect("src", output_key="got"), None, src=[1]))[0] == {"got": [1]}
    assert arun(call(Collect("src", output_key=None), {"a": 1}, src=[1, 2]))[0] == [1, 2]

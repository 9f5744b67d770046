"""The wiring functions: merges, projections, routes, and the builders for your own."""

from __future__ import annotations

import pytest
import torch
from omni_contrib_stages import functions as fx

# -- merge ---------------------------------------------------------------------------------------


def test_concat_tensors_joins_tensors_in_wait_for_order_and_keeps_the_rest():
    a = {"embeds": torch.ones(2, 3), "text": "hi", "ids": [1, 2], "only_a": 1}
    b = {"embeds": torch.zeros(4, 3), "text": "hi", "ids": [1, 2], "only_b": torch.tensor([5])}
    merged = fx.concat_tensors({"audio": a, "image": b})
    assert merged["embeds"].shape == (6, 3)
    assert merged["embeds"][:2].eq(1).all() and merged["embeds"][2:].eq(0).all()
    assert (merged["text"], merged["ids"], merged["only_a"]) == ("hi", [1, 2], 1)
    assert merged["only_b"].tolist() == [5]
    # the other order puts image first
    assert fx.concat_tensors({"image": b, "audio": a})["embeds"][0].eq(0).all()


def test_stack_tensors_adds_a_source_dimension():
    merged = fx.stack_tensors({"x": {"v": torch.tensor([1, 2])}, "y": {"v": torch.tensor([3, 4])}})
    assert merged["v"].tolist() == [[1, 2], [3, 4]]


def test_merge_errors_name_the_key_and_the_sources():
    with pytest.raises(ValueError, match=r"key 'text' differs between 'a' \('x'\) and 'b' \('y'\)"):
        fx.concat_tensors({"a": {"text": "x"}, "b": {"text": "y"}})
    with pytest.raises(ValueError, match=r"cannot join the tensors under key 'e' \(a: \(2, 3\).*b: \(2, 4\)"):
        fx.concat_tensors({"a": {"e": torch.ones(2, 3)}, "b": {"e": torch.ones(2, 4)}})
    with pytest.raises(TypeError, match="key 'e' holds tensors in some sources and not in others"):
        fx.stack_tensors({"a": {"e": torch.ones(2)}, "b": {"e": [1, 2]}})
    with pytest.raises(TypeError, match="stage 'b' sent list"):
        fx.concat_tensors({"a": {}, "b": [1]})


# -- project_payload ---------------------------------------------------------------------------------


PAYLOAD = {"x": torch.arange(3), "mask": torch.ones(3), "text": "hi", "_to": ["a"], "n": 2}


def test_fixed_projections():
    assert set(fx.tensors_only(PAYLOAD)) == {"x", "mask"}
    assert fx.drop_tensors(PAYLOAD) == {"text": "hi", "_to": ["a"], "n": 2}
    assert set(fx.drop_private(PAYLOAD)) == {"x", "mask", "text", "n"}
    with pytest.raises(TypeError, match="contrib.tensors_only needs a dict payload, got list"):
        fx.tensors_only([1])


def test_split_gives_a_branch_its_part_with_the_shared_entries():
    payload = {"audio": {"features": 1, "text": "own"}, "image": {"pixels": 2}, "shared": {"text": "hi", "n": 3}, "_to": "x"}
    assert fx.split_audio(payload) == {"features": 1, "text": "own", "n": 3}  # the part wins a clash
    assert fx.split_image(payload) == {"pixels": 2, "text": "hi", "n": 3}
    assert fx.split("image", shared=None)(payload) == {"pixels": 2}
    with pytest.raises(KeyError, match=r"contrib.split.video: the payload has no part 'video'; it has \['_to', 'audio'"):
        fx.split_video(payload)
    with pytest.raises(TypeError, match="part 'text' must be a dict"):
        fx.split_text({"text": "plain"})


def test_keep_and_drop_keys_builders():
    keep = fx.keep_keys("x", "n")
    assert set(keep(PAYLOAD)) == {"x", "n"}
    assert keep.__name__ == "keep_keys('x', 'n')"
    with pytest.raises(KeyError, match=r"has no key\(s\) \['missing'\]"):
        fx.keep_keys("x", "missing")(PAYLOAD)
    assert set(fx.drop_keys("x", "absent")(PAYLOAD)) == {"mask", "text", "_to", "n"}
    with pytest.raises(ValueError, match="needs at least one key"):
        fx.keep_keys()


# -- route -------------------------------------------------------------------------------------------


def test_route_to_reads_the_private_field_and_defaults_to_every_stage():
    assert fx.route_to("r", {"_to": "talker"}) == ["talker"]
    assert fx.route_to("r", {"_to": ["a", "b"]}) == ["a", "b"]
    assert fx.route_to("r", {"x": 1}) == fx.ALL_TARGETS == "*"
    assert fx.route_to("r", {"_to": None}) == "*"
    assert fx.route_to("r", "not a dict") == "*"
    with pytest.raises(TypeError, match="'_to' must be a stage name or a list of names, got 3"):
        fx.route_to("r", {"_to": 3})


def test_route_by_field_builder():
    direct = fx.route_by_field("task")
    assert direct("r", {"task": "asr"}) == ["asr"]
    with pytest.raises(KeyError, match="the payload has no 'task' key"):
        direct("r", {})

    table = fx.route_by_field("task", {"tts": "talker", "both": ["talker", "decoder"]}, default="decoder")
    assert table("r", {"task": "tts"}) == ["talker"]
    assert table("r", {"task": "both"}) == ["talker", "decoder"]
    assert table("r", {"task": "other"}) == "decoder"
    assert table("r", {}) == "decoder"
    assert fx.route_by_field("task", {"a": "x"}, default="*")("r", {"task": "zzz"}) == "*"

    strict = fx.route_by_field("task", {"tts": "talker"})
    with pytest.raises(ValueError, match=r"task='zzz' is not one of 'tts' \(and the route has no default\)"):
        strict("r", {"task": "zzz"})

"""Fixtures: one tiny random checkpoint per test session, and the reference answer of
``Qwen2_5OmniForConditionalGeneration.generate(..., return_audio=True)`` for it."""

from __future__ import annotations

import os

import pytest
import torch

# The reference generate runs in the test process next to the stage processes: one thread, or
# OpenMP workers of several processes fight over the cores.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    from omni_transformers.tiny import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path_factory.mktemp("qwen2_5_omni_tiny") / "ckpt")
    old = os.environ.get("OMNI_TRANSFORMERS_MODEL")
    os.environ["OMNI_TRANSFORMERS_MODEL"] = str(path)
    yield path
    if old is None:
        os.environ.pop("OMNI_TRANSFORMERS_MODEL", None)
    else:
        os.environ["OMNI_TRANSFORMERS_MODEL"] = old


@pytest.fixture(scope="session")
def reference(tiny_model):
    """``reference(input_ids, max_new_tokens, seed=0, speaker="Chelsie", **generate_kwargs)`` →
    ``{"token_ids", "codes", "audio", "unchunked"}`` from transformers' own generate, in this process
    (``unchunked``: its token2wav on the codes with the noise drawn after ``torch.manual_seed(seed)``)."""
    from transformers import Qwen2_5OmniForConditionalGeneration, Qwen2_5OmniTalkerConfig  # noqa: F401

    model = Qwen2_5OmniForConditionalGeneration.from_pretrained(tiny_model).eval()
    codes_seen: list = []

    def capture(module, args, kwargs):
        codes_seen.append(args[0] if args else kwargs["code"])

    model.token2wav.register_forward_pre_hook(capture, with_kwargs=True)
    cache: dict = {}

    def run(input_ids, max_new_tokens, seed=0, speaker="Chelsie", talker_max_new_tokens=4096, **kwargs):
        key = (tuple(input_ids), max_new_tokens, seed, speaker, talker_max_new_tokens, tuple(sorted(kwargs.items())))
        if key not in cache:
            codes_seen.clear()
            ids = torch.tensor([input_ids])
            torch.manual_seed(seed)
            sequences, audio = model.generate(ids, speaker=speaker, thinker_max_new_tokens=max_new_tokens,
                                              talker_max_new_tokens=talker_max_new_tokens, **kwargs)
            codes = codes_seen[0][0].tolist()
            # What streamed token2wav is compared with: the unchunked synthesis of the same codes, its
            # noise drawn right after torch.manual_seed(seed) (generate's own audio when the talker is greedy).
            torch.manual_seed(seed)
            params = model.speaker_map[speaker]
            with torch.inference_mode():
                unchunked = model.token2wav(torch.tensor([codes]), conditioning=params["cond"].float()[None],
                                            reference_mel=params["ref_mel"].float()).reshape(-1).float()
            cache[key] = {"token_ids": sequences[0, len(input_ids):].tolist(), "codes": codes, "audio": audio,
                          "unchunked": unchunked}
        return cache[key]

    return run


@pytest.fixture(scope="session")
def fake_checkpoint(tmp_path_factory):
    """A checkpoint folder for a fake family (a ``config.json`` of model type ``fake`` and nothing
    else): what the kit's ``resolve_model_path`` asks of a folder; the fake builds its own model."""
    import json

    path = tmp_path_factory.mktemp("fake_family")
    (path / "config.json").write_text(json.dumps({"model_type": "fake"}))
    return path

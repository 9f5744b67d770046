"""The omni plugin of omni-transformers: names only; nothing heavy is imported here."""

from __future__ import annotations

import omni_core

PREFIX = "transformers.qwen2_5_omni"


def no_payload(request_id, payload):
    """Route function: send the result nowhere (the stage's output travels in its stream)."""
    return []


@omni_core.hookimpl
def omni_register_stages(register):
    register(f"{PREFIX}.processor", "omni_transformers.processor:Processor",
             description="Qwen2.5-Omni inputs (text or input_ids) -> model inputs")
    register(f"{PREFIX}.thinker", "omni_transformers.thinker:Thinker",
             description="Qwen2.5-Omni thinker: text tokens, streaming each step to the talker")
    register(f"{PREFIX}.talker", "omni_transformers.talker:Talker",
             description="Qwen2.5-Omni talker: codec codes from the thinker's live stream")
    register(f"{PREFIX}.token2wav", "omni_transformers.token2wav:Token2Wav",
             description="Qwen2.5-Omni token2wav: codes -> waveform (DiT + BigVGAN)")


@omni_core.hookimpl
def omni_register_functions(register):
    register(f"{PREFIX}.no_payload", no_payload, kind="route", description=no_payload.__doc__)


@omni_core.hookimpl
def omni_register_pipelines(register):
    register("qwen2_5_omni", "omni_transformers:pipelines/qwen2_5_omni.yaml",
             description="Qwen2.5-Omni: thinker in one process, talker + token2wav in another")
    register("qwen2_5_omni.split", "omni_transformers:pipelines/qwen2_5_omni_split.yaml",
             description="Qwen2.5-Omni: processor, thinker, talker and token2wav in a process each")

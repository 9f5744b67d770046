"""The omni plugin of omni-transformers: names only; nothing heavy is imported here."""

from __future__ import annotations

import omni_core

from .kit.wiring import (
    audio_inputs,
    image_inputs,
    no_payload,
    route_encoded,
    route_inputs,
    speech_inputs,
    terminal_stages,
    text_inputs,
    thinker_text,
    wait_for_encoders,
)
from .qwen3_omni import wiring as qwen3_wiring

PREFIX = "transformers.qwen2_5_omni"
_Q = "omni_transformers.qwen2_5_omni"


@omni_core.hookimpl
def omni_register_stages(register):
    check = "omni_transformers.kit.checks:check_model"  # every stage loads a part of the checkpoint
    register(f"{PREFIX}.processor", f"{_Q}.processor:Processor",
             description="Qwen2.5-Omni inputs (chat messages with text, audio, images) -> model inputs", check=check)
    register(f"{PREFIX}.audio_encoder", f"{_Q}.encoders:AudioEncoder",
             description="Qwen2.5-Omni audio tower: audio features -> embeddings, micro-batched", check=check)
    register(f"{PREFIX}.vision_encoder", f"{_Q}.encoders:VisionEncoder",
             description="Qwen2.5-Omni vision tower: image patches -> embeddings, micro-batched", check=check)
    register(f"{PREFIX}.thinker", f"{_Q}.thinker:Thinker",
             description="Qwen2.5-Omni thinker: text tokens, streaming each step to the talker", check=check)
    register(f"{PREFIX}.talker", f"{_Q}.talker:Talker",
             description="Qwen2.5-Omni talker: codec codes from the thinker's live stream", check=check)
    register(f"{PREFIX}.token2wav", f"{_Q}.token2wav:Token2Wav",
             description="Qwen2.5-Omni token2wav: codes -> waveform (DiT + BigVGAN)",
             check="omni_transformers.kit.checks:check_vocoder")  # the checkpoint and the chunk mode
    register("transformers.qwen3_omni.processor", "omni_transformers.qwen3_omni.processor:Processor",
             description="Qwen3-Omni inputs (chat messages with text, audio, images) -> model inputs",
             check=check)
    register("transformers.qwen3_omni.audio_encoder", "omni_transformers.qwen3_omni.encoders:AudioEncoder",
             description="Qwen3-Omni audio tower: audio features -> embeddings, micro-batched", check=check)
    register("transformers.qwen3_omni.vision_encoder", "omni_transformers.qwen3_omni.encoders:VisionEncoder",
             description="Qwen3-Omni vision tower: image patches -> embeddings and deepstack features, micro-batched",
             check=check)
    register("transformers.qwen3_omni.thinker", "omni_transformers.qwen3_omni.thinker:Thinker",
             description="Qwen3-Omni MoE thinker: text tokens, batched across requests, streaming to the talker",
             check=check)
    register("transformers.qwen3_omni.talker", "omni_transformers.qwen3_omni.talker:Talker",
             description="Qwen3-Omni talker: frames of 16 codes (code0 + code predictor) from the thinker's stream",
             check=check)
    register("transformers.qwen3_omni.code2wav", "omni_transformers.qwen3_omni.code2wav:Code2Wav",
             description="Qwen3-Omni code2wav: frames of 16 codes -> waveform, streamed in chunks", check=check)
    register("transformers.whisper.asr", "omni_transformers.whisper.asr:Transcriber",
             description="Whisper: audio -> text, concurrent requests batched, text streamed", check=check)
    register("transformers.csm.processor", "omni_transformers.csm.tts:Processor",
             description="CSM inputs (text, voice, sampling) -> the prompt and settings", check=check)
    register("transformers.csm.talker", "omni_transformers.csm.tts:Talker",
             description="CSM backbone + depth decoder: frames of codes, concurrent requests batched", check=check)
    register("transformers.csm.vocoder", "omni_transformers.csm.tts:MimiVocoder",
             description="CSM's Mimi: frames -> 24 kHz audio, streamed with left context", check=check)


@omni_core.hookimpl
def omni_register_functions(register):
    register(f"{PREFIX}.no_payload", no_payload, kind="route", description=no_payload.__doc__)
    register(f"{PREFIX}.route_encoded", route_encoded, kind="route", description=route_encoded.__doc__)
    register(f"{PREFIX}.terminal_stages", terminal_stages, kind="terminal_stages",
             description=terminal_stages.__doc__)
    register(f"{PREFIX}.route_inputs", route_inputs, kind="route", description=route_inputs.__doc__)
    register(f"{PREFIX}.wait_for_encoders", wait_for_encoders, kind="wait_for", description=wait_for_encoders.__doc__)
    for fn in (text_inputs, speech_inputs, audio_inputs, image_inputs):
        register(f"{PREFIX}.{fn.__name__}", fn, kind="project_payload", description=fn.__doc__)
    register(f"{PREFIX}.thinker_text", thinker_text, kind="project_stream", description=thinker_text.__doc__)
    register("transformers.qwen3_omni.route_inputs", qwen3_wiring.route_inputs, kind="route",
             description=qwen3_wiring.route_inputs.__doc__)
    register("transformers.qwen3_omni.terminal_stages", qwen3_wiring.terminal_stages, kind="terminal_stages",
             description=qwen3_wiring.terminal_stages.__doc__)


@omni_core.hookimpl
def omni_register_pipelines(register):
    register("qwen2_5_omni", "omni_transformers:pipelines/qwen2_5_omni.yaml",
             description="Qwen2.5-Omni: thinker in one process, talker + token2wav in another")
    register("qwen2_5_omni.split", "omni_transformers:pipelines/qwen2_5_omni_split.yaml",
             description="Qwen2.5-Omni: processor, thinker, talker and token2wav in a process each")
    register("qwen2_5_omni.gpu", "omni_transformers:pipelines/qwen2_5_omni_gpu.yaml",
             description="qwen2_5_omni placed on the GPUs there are (spread: thinker and speech on different GPUs)")
    register("qwen2_5_omni.split.gpu", "omni_transformers:pipelines/qwen2_5_omni_split_gpu.yaml",
             description="qwen2_5_omni.split placed on the GPUs there are (spread)")
    for name, what in (
            ("qwen3_omni", "Qwen3-Omni: processor, encoders + MoE thinker in one process, talker + code2wav in another"),
            ("qwen3_omni.split", "Qwen3-Omni: processor, encoders, thinker, talker and code2wav in a process each"),
            ("qwen3_omni.gpu", "qwen3_omni placed on the GPUs there are (spread: thinker and speech on different GPUs)"),
            ("qwen3_omni.split.gpu", "qwen3_omni.split placed on the GPUs there are (spread)")):
        register(name, f"omni_transformers:pipelines/{name.replace('.', '_')}.yaml", description=what)
    register("whisper", "omni_transformers:pipelines/whisper.yaml",
             description="Whisper speech recognition (served as OpenAI's /v1/audio/transcriptions)")
    register("csm", "omni_transformers:pipelines/csm.yaml",
             description="CSM text to speech (served as OpenAI's /v1/audio/speech)")


@omni_core.hookimpl
def omni_register_families(register):
    register("qwen2_5_omni", "omni_transformers.qwen2_5_omni:FAMILY", model_types=["qwen2_5_omni"],
             pipeline="qwen2_5_omni", description="Qwen2.5-Omni: thinker, talker (one code per frame), DiT + BigVGAN")
    register("qwen3_omni", "omni_transformers.qwen3_omni:FAMILY", model_types=["qwen3_omni_moe"],
             pipeline="qwen3_omni", description="Qwen3-Omni: MoE thinker, talker with code predictor (16 codes a frame), code2wav")
    register("whisper", "omni_transformers.whisper:FAMILY", model_types=["whisper"], pipeline="whisper",
             description="Whisper: speech recognition (encoder + decoder, batched)")
    register("csm", "omni_transformers.csm:FAMILY", model_types=["csm"], pipeline="csm",
             description="CSM: text to speech (backbone + depth decoder, Mimi streamed)")

"""omni-transformers: a model-agnostic kit (``omni_transformers.kit``) and model families on it;
the first, Qwen2.5-Omni (thinker, talker, token2wav, ``omni_transformers.qwen2_5_omni``), equal to
``Qwen2_5OmniForConditionalGeneration.generate(..., return_audio=True)``.

Stages ``transformers.qwen2_5_omni.{processor,audio_encoder,vision_encoder,thinker,talker,token2wav}``, pipelines
``qwen2_5_omni`` and ``qwen2_5_omni.split``; the checkpoint comes from ``args.model`` or
``$OMNI_TRANSFORMERS_MODEL``. ``python -m omni_transformers.tiny DIR [--family NAME]`` writes a tiny random one.
"""

__version__ = "0.1.0"

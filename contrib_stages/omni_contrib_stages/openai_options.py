"""The options schema of the ``openai`` API (``serve.options.openai``), declared with its
registration so that ``omni validate`` checks a config's adapter options without importing the
API; :func:`omni_contrib_stages.openai_api.adapter_options` parses them with the same schema.
Imports nothing but :mod:`omni_core.options`."""

from __future__ import annotations

from omni_core.options import Option

OPTIONS: dict[str, Option] = {
    "prompt_key": Option("str", "text", "the prompt goes to inputs[prompt_key]"),
    "max_tokens_key": Option("str", None, "max_tokens / max_completion_tokens go to inputs[max_tokens_key] "
                             "(null: ignored)", nullable=True),
    "inputs": Option("mapping", {}, "merged into every request's inputs"),
    "text_inputs": Option("mapping", {}, "merged when the client asked for text only"),
    "audio_inputs": Option("mapping", {}, "merged when the client asked for audio too"),
    "text_stage": Option("str", None, "the stage whose chunks carry text (null: the first terminal stage)",
                         nullable=True),
    "text_field": Option("str", "text", "chunk[text_field] is one piece of text"),
    "text_joiner": Option("str", " ", "put between two pieces of text"),
    "result_text_field": Option("str", "text", "result[text_stage][result_text_field] is the whole text"),
    "audio_stage": Option("str", None, "the stage whose chunks carry audio (null: the pipeline has none)",
                          nullable=True),
    "audio_field": Option("str", "pcm16", "chunk[audio_field]: mono audio, PCM16 bytes or float samples"),
    "sample_rate": Option("positive_int", 24000, "the audio's sample rate in Hz, unless the chunk says"),
    "sample_rate_field": Option("str", "sample_rate", "chunk[sample_rate_field], when present, is its rate",
                                nullable=True),
    "voices": Option("any", None, "a list of accepted voice names (null: any)"),
    "voice_key": Option("str", None, "the voice goes to inputs[voice_key] (null: not passed on)", nullable=True),
}

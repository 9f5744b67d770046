"""The toy speech pipelines of these tests, served by the ``openai`` API, as config text: one
home for the ASR pipeline (``audio_stages:Transcriber``) and the TTS pipeline
(``audio_stages:Speaker``) that several test files serve, each with the options its tests need."""

from __future__ import annotations

from typing import Any

import yaml


def _config(name: str, stage: dict[str, Any], openai: dict[str, Any], serve: dict[str, Any] | None) -> str:
    return yaml.safe_dump({"name": name, "stages": [stage],
                           "serve": {"apis": ["openai"], **(serve or {}), "options": {"openai": openai}}},
                          sort_keys=False)


def asr_config(name: str = "asr", *, args: dict[str, Any] | None = None, audio: dict[str, Any] | None = None,
               serve: dict[str, Any] | None = None) -> str:
    """Pipeline ``name`` of one stage of that name (the toy transcriber, given ``args``), served as
    ``kind: asr`` joining text with a space; ``audio``: more of ``options.openai.audio``;
    ``serve``: more of the ``serve`` section."""
    stage = {"name": name, "factory": "audio_stages:Transcriber", **({"args": args} if args else {}), "terminal": True}
    openai = {"kind": "asr", "text_joiner": " ", "audio": {"text_joiner": " ", **(audio or {})}}
    return _config(name, stage, openai, serve)


def tts_config(name: str = "tts", *, args: dict[str, Any] | None = None, audio: dict[str, Any] | None = None,
               sample_rate: int = 24000) -> str:
    """Pipeline ``name`` of one stage of that name (the toy speaker, given ``args``), served as
    ``kind: tts`` at ``sample_rate`` with voices "0" and "1" (``voice`` key); ``audio``: its
    ``options.openai.audio``."""
    stage = {"name": name, "factory": "audio_stages:Speaker", **({"args": args} if args else {}), "terminal": True}
    openai = {"kind": "tts", "audio_stage": name, "voices": ["0", "1"], "voice_key": "voice", "sample_rate": sample_rate,
              **({"audio": audio} if audio else {})}
    return _config(name, stage, openai, None)

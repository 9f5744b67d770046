"""The processor stage: a request's inputs -> the thinker's model inputs."""

from __future__ import annotations

from typing import Any

from .common import DEFAULT_SPEAKER, DEFAULT_SYSTEM_PROMPT, request_seed
from .models import resolve_model_path


class Processor:
    """Inputs → model inputs. ``{"text": str}`` (put through the tokenizer's chat template, with the
    system prompt Qwen2.5-Omni needs for speech) or ``{"input_ids": [int, ...]}`` (used as given),
    plus optional ``max_new_tokens``, ``speaker``, ``seed``, ``system_prompt``, ``talker_max_new_tokens``,
    ``talker_do_sample`` and ``wav_path``."""

    def __init__(self, model: str | None = None, system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
                 chat_template: bool = True):
        from transformers import AutoTokenizer

        self.path = resolve_model_path(model)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        self.system_prompt = system_prompt
        self.chat_template = chat_template and self.tokenizer.chat_template is not None

    def encode(self, text: str, system_prompt: str | None) -> list[int]:
        if not self.chat_template:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": text})
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(i) for i in ids]

    def __call__(self, payload: Any, ctx) -> dict:
        if not isinstance(payload, dict):
            raise TypeError(f"inputs must be a mapping like {{'text': 'hello'}}, got {type(payload).__name__}")
        for key in ("audio", "audios", "image", "images", "video", "videos"):
            if key in payload:
                raise ValueError(f"input {key!r} is not supported yet: give 'text' or 'input_ids'")
        if "input_ids" in payload:
            ids = payload["input_ids"]
            if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
                raise ValueError("input_ids must be a non-empty list of ints")
        elif isinstance(payload.get("text"), str):
            ids = self.encode(payload["text"], payload.get("system_prompt", self.system_prompt))
        else:
            raise ValueError("inputs need 'text' (a string) or 'input_ids' (a list of ints)")
        out = {"input_ids": [int(i) for i in ids], "seed": request_seed(payload),
               "speaker": payload.get("speaker", DEFAULT_SPEAKER)}
        if payload.get("max_new_tokens") is not None:
            out["max_new_tokens"] = int(payload["max_new_tokens"])
        if payload.get("talker_max_new_tokens") is not None:
            out["talker_max_new_tokens"] = int(payload["talker_max_new_tokens"])
        if payload.get("talker_do_sample") is not None:
            out["talker_do_sample"] = bool(payload["talker_do_sample"])
        if "wav_path" in payload:
            out["wav_path"] = payload["wav_path"]
        return out


"""The processor stage: a request's inputs (Qwen's chat format, with audio and images) -> the
model inputs of the thinker and of the audio and vision encoders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omni_core.errors import InvalidInput
from omni_core.files import local_path

from ..kit.media import MediaError, load_audio, load_image
from ..kit.sampling import request_sampling, resolve_model_path
from .common import DEFAULT_SPEAKER, DEFAULT_SYSTEM_PROMPT, request_seed

# The special tokens Qwen2_5OmniProcessor reads off the tokenizer, with the real checkpoint's strings
# for tokenizers that do not name them.
_TOKENS = {"audio_token": "<|AUDIO|>", "image_token": "<|IMAGE|>", "video_token": "<|VIDEO|>",
           "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>",
           "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>"}


def omni_processor_class():
    """``Qwen2_5OmniProcessor`` without its video part: the library's own ``__call__`` (feature
    extraction, image processing, placeholder expansion, tokenisation), built from the feature
    extractor, the image processor and the tokenizer alone. (``Qwen2_5OmniProcessor`` itself
    insists on a video processor, which needs torchvision; videos are not taken here.)"""
    from transformers import Qwen2_5OmniProcessor
    from transformers.processing_utils import ProcessorMixin

    class OmniProcessor(Qwen2_5OmniProcessor):
        def __init__(self, image_processor=None, feature_extractor=None, tokenizer=None, chat_template=None):
            ProcessorMixin.__init__(self, image_processor, feature_extractor, tokenizer, chat_template=chat_template)
            for name, default in _TOKENS.items():
                token = getattr(tokenizer, name, None) or default
                setattr(self, name, token)
                if name in ("audio_token", "image_token", "video_token"):
                    setattr(self, f"{name}_id", tokenizer.convert_tokens_to_ids(token))

        @property
        def model_input_names(self):
            return ["input_ids", "attention_mask", "input_features", "feature_attention_mask", "pixel_values",
                    "image_grid_thw"]

    return OmniProcessor


def load_chat_template(path: Path, tokenizer) -> str | None:
    """The checkpoint's chat template: the processor's (``chat_template.jinja`` or
    ``chat_template.json``), else the tokenizer's."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    if (path / "chat_template.json").is_file():
        return json.loads((path / "chat_template.json").read_text()).get("chat_template")
    return tokenizer.chat_template


def wants_audio(inputs: Any) -> bool:
    """The request's ``return_audio`` (default true; false: text only, no talker or token2wav)."""
    value = inputs.get("return_audio", True) if isinstance(inputs, dict) else True
    if not isinstance(value, bool):
        raise InvalidInput(f"return_audio must be true or false, got {value!r}", field="return_audio")
    return value


class Processor:
    """Inputs → model inputs, as ``Qwen2_5OmniProcessor`` prepares them.

    A request gives ``messages`` (Qwen's chat format: ``[{role, content}]``, content a string or a
    list of parts ``{"type": "text", "text"}``, ``{"type": "audio", "audio": PATH | bytes | 1-D
    float tensor, "sample_rate"}``, ``{"type": "image", "image": PATH | bytes | H x W x 3 uint8
    tensor}``), or the shorthand ``text`` with optional ``audio`` (+ ``sample_rate``) and ``image``
    (one user turn: audio, image, then text), or ``input_ids`` (used as given). Messages without a
    system message get the system prompt Qwen2.5-Omni needs for speech. Optional: ``max_new_tokens``,
    ``speaker``, ``seed``, ``temperature`` / ``top_p`` / ``top_k`` (the thinker's sampling for this
    request; a temperature of 0 is greedy), ``system_prompt``, ``talker_max_new_tokens``,
    ``talker_do_sample``, ``wav_path``.

    The output has ``input_ids`` and the request's options; with audio, ``audio_features`` (one
    [mel bins, frames] tensor per audio) and ``audio_seqlens`` (their frame counts); with images,
    ``pixel_values`` ([patches, C·T·P·P]) and ``image_grid_thw`` (one ``[t, h, w]`` per image).
    """

    #: The multimodal processor's class (built from the image processor, the feature extractor, the tokenizer).
    processor_class = staticmethod(omni_processor_class)

    def __init__(self, model: str | None = None, system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
                 chat_template: bool = True):
        from transformers import AutoTokenizer

        self.path = resolve_model_path(model)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
        self.system_prompt = system_prompt
        self.template = load_chat_template(self.path, self.tokenizer) if chat_template else None
        self._mm = None

    @property
    def mm(self):
        """The multimodal processor, built on first use (a text-only checkpoint folder needs none)."""
        if self._mm is None:
            from transformers import WhisperFeatureExtractor
            from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
                Qwen2VLImageProcessorPil,
            )

            if not (self.path / "preprocessor_config.json").is_file():
                raise ValueError(f"{self.path} has no preprocessor_config.json: audio and image inputs need the "
                                 "checkpoint's feature extractor and image processor settings")
            self._mm = type(self).processor_class()(
                Qwen2VLImageProcessorPil.from_pretrained(self.path, local_files_only=True),
                WhisperFeatureExtractor.from_pretrained(self.path, local_files_only=True),
                self.tokenizer,
            )
        return self._mm

    # -- messages ----------------------------------------------------------------------------
    def messages_of(self, payload: dict) -> list[dict]:
        """The request's conversation in Qwen's chat format (the shorthand made into one user turn)."""
        if "messages" in payload:
            messages = payload["messages"]
            if not isinstance(messages, list) or not messages:
                raise InvalidInput("messages must be a non-empty list of {'role', 'content'} objects", field="messages")
        else:
            parts: list[dict] = []
            if payload.get("audio") is not None:
                parts.append({"type": "audio", "audio": payload["audio"], "sample_rate": payload.get("sample_rate"),
                              "where": "audio"})
            if payload.get("image") is not None:
                parts.append({"type": "image", "image": payload["image"], "where": "image"})
            text = payload.get("text")
            if text is not None and not isinstance(text, str):
                raise InvalidInput(f"text must be a string, got {type(text).__name__}", field="text")
            if not parts:
                if text is None:
                    raise InvalidInput("inputs need 'messages', 'text' (a string, with optional 'audio' and 'image') "
                                     "or 'input_ids' (a list of ints)")
                messages = [{"role": "user", "content": text}]
            else:
                if text:
                    parts.append({"type": "text", "text": text})
                messages = [{"role": "user", "content": parts}]
        system = payload.get("system_prompt", self.system_prompt)
        if system is not None and not isinstance(system, str):
            raise InvalidInput(f"system_prompt must be a string, got {type(system).__name__}", field="system_prompt")
        if system and not any(isinstance(m, dict) and m.get("role") == "system" for m in messages):
            messages = [{"role": "system", "content": system}, *messages]
        return messages

    def media_of(self, messages: list[dict], origin=None, inserted: int = 0) -> tuple[list[dict], list, list]:
        """The messages as the chat template sees them (media values left out), and the decoded
        audios (16 kHz mono float32) and images (RGB), each in the order it appears. ``origin``:
        the request's context, for the local-file rule (:func:`omni_core.files.local_path`);
        ``inserted``: messages put before the caller's (the system prompt), left out of the
        indices errors name, so they count the caller's messages."""
        fe = self.mm.feature_extractor if self._has_media(messages) else None
        shown, audios, images = [], [], []
        for k, message in enumerate(messages):
            i = k - inserted
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
                raise InvalidInput(f"messages[{i}] must be an object with 'role' (a string) and 'content'",
                                   field=f"messages[{i}]")
            content = message["content"]
            if isinstance(content, str):
                shown.append({"role": message["role"], "content": content})
                continue
            if not isinstance(content, list):
                raise InvalidInput(f"messages[{i}].content must be a string or a list of parts",
                                   field=f"messages[{i}].content")
            parts = []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                where = f"messages[{i}].content[{j}]"
                if kind in ("audio", "image"):  # the shorthand's parts are named after their input key
                    where = part.get("where") or f"{where} ({kind})"
                if kind == "text":
                    if not isinstance(part.get("text"), str):
                        raise InvalidInput(f"{where}: a text part needs 'text' (a string)", field=where)
                    parts.append({"type": "text", "text": part["text"]})
                elif kind == "audio":
                    audios.append(load_audio(part.get("audio"), where, sample_rate=part.get("sample_rate"),
                                             target_rate=fe.sampling_rate, max_samples=fe.n_samples, origin=origin))
                    parts.append({"type": "audio", "audio": ""})
                elif kind == "image":
                    images.append(load_image(part.get("image"), where, origin=origin))
                    parts.append({"type": "image", "image": ""})
                else:
                    raise InvalidInput(field=where, message=f"{where}: a part must be {{'type': 'text' | 'audio' | 'image', ...}}, got "
                                     f"type {kind!r} (videos are not supported)")
            shown.append({"role": message["role"], "content": parts})
        return shown, audios, images

    @staticmethod
    def _has_media(messages: list) -> bool:
        return any(isinstance(m, dict) and isinstance(m.get("content"), list)
                   and any(isinstance(p, dict) and p.get("type") in ("audio", "image") for p in m["content"])
                   for m in messages)

    def render(self, messages: list[dict]) -> str:
        if self.template is None:  # no chat template: the text parts as they are
            return "".join(m["content"] if isinstance(m["content"], str) else
                           "".join(p.get("text", "") for p in m["content"]) for m in messages
                           if m["role"] != "system")
        return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=True)

    def model_inputs(self, payload: dict, origin=None) -> dict[str, Any]:
        messages = self.messages_of(payload)
        given = payload.get("messages")
        inserted = len(messages) - len(given) if isinstance(given, list) else 0
        shown, audios, images = self.media_of(messages, origin, inserted)
        text = self.render(shown)
        if not audios and not images:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            return {"input_ids": [int(i) for i in ids]}
        try:
            out = self.mm(text=[text], audio=audios or None, images=images or None, return_tensors="pt")
        except MediaError:
            raise
        except ValueError as exc:  # e.g. a template that renders no placeholder for a part
            raise InvalidInput(f"the processor could not prepare these inputs: {exc}") from None
        result: dict[str, Any] = {"input_ids": [int(i) for i in out["input_ids"][0].tolist()]}
        if audios:
            lengths = out["feature_attention_mask"].sum(-1).tolist()
            feats = out["input_features"]
            result["audio_features"] = [feats[k, :, :n].contiguous() for k, n in enumerate(lengths)]
            result["audio_seqlens"] = [int(n) for n in lengths]
        if images:
            result["pixel_values"] = out["pixel_values"].contiguous()
            result["image_grid_thw"] = [[int(x) for x in row] for row in out["image_grid_thw"].tolist()]
        return result

    def __call__(self, payload: Any, ctx) -> dict:
        if not isinstance(payload, dict):
            raise InvalidInput(f"inputs must be a mapping like {{'text': 'hello'}}, got {type(payload).__name__}")
        for key in ("audios", "images", "video", "videos"):
            if key in payload:
                raise InvalidInput(field=key, message=f"input {key!r} is not supported: give 'messages' with audio/image parts, or 'text' "
                                 "with one 'audio' and one 'image'")
        if "input_ids" in payload:
            ids = payload["input_ids"]
            vocab = len(self.tokenizer)
            if not isinstance(ids, list) or not ids or not all(
                    isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids):
                raise InvalidInput(f"input_ids must be a non-empty list of token ids (ints from 0 to {vocab - 1})",
                                   field="input_ids")
            out: dict[str, Any] = {"input_ids": [int(i) for i in ids]}
        else:
            out = self.model_inputs(payload, ctx)
        speaker = payload.get("speaker", DEFAULT_SPEAKER)
        if not isinstance(speaker, str):
            raise InvalidInput(f"speaker must be a string (a voice's name), got {type(speaker).__name__}", field="speaker")
        out.update(seed=request_seed(payload), speaker=speaker)
        for key in ("max_new_tokens", "talker_max_new_tokens"):
            value = payload.get(key)
            if value is not None:
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise InvalidInput(f"{key} must be a positive integer, got {value!r}", field=key)
                out[key] = value
        out.update(request_sampling(payload))  # the thinker's sampling for this request, checked here first
        if payload.get("talker_do_sample") is not None:
            out["talker_do_sample"] = bool(payload["talker_do_sample"])
        if payload.get("wav_path") is not None:  # a file the request asks token2wav to write
            out["wav_path"] = str(local_path(ctx, payload["wav_path"], "wav_path", write=True))
        elif "wav_path" in payload:
            out["wav_path"] = None
        out["return_audio"] = wants_audio(payload)
        return out

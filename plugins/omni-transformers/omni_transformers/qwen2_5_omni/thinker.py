"""Qwen2.5-Omni's thinker on the kit's skeleton: its part of the checkpoint, M-RoPE positions
(4 axes), audio/image features spliced into the prompt, and the talker's conditioning (input
embedding + last hidden state per position; the speaker's text bos, the text end and pad)."""

from __future__ import annotations

import torch
from omni_core.errors import InvalidInput

from ..kit.thinker import PrefillInputs, ThinkerEngine
from ..kit.thinker import Thinker as KitThinker
from .common import DEFAULT_SPEAKER, omni_config
from .inputs import prefill_inputs
from .parts import load_part, load_speakers


class QwenThinkerEngine(ThinkerEngine):
    position_axes = 4  # the text axis, then M-RoPE's three
    hands_off = True

    def load_model(self, path, *, dtype: str, device: str):
        return load_part(path, "thinker", dtype=dtype, device=device)

    def decode_mask(self, n: int):
        return {"full_attention": None}

    def step_conditioning(self, out) -> torch.Tensor:
        # generate adds the thinker's input embedding and last hidden state for the talker
        # (in the thinker's dtype: bfloat16 stays bfloat16).
        return (out.hidden_states[0] + out.hidden_states[-1])[:, 0]

    def prompt_conditioning(self, out, state, start: int, end: int) -> torch.Tensor:
        embeds = out.hidden_states[0]
        if state.pre.media_mask is not None:  # generate zeroes the audio/image positions of the embeddings
            embeds = embeds.masked_fill(state.pre.media_mask[start:end].to(embeds.device)[None, :, None], 0)
        return (embeds + out.hidden_states[-1])[0]


ThinkerEngine = QwenThinkerEngine  # the name tests and subclasses import


class Thinker(KitThinker):
    __doc__ = KitThinker.__doc__
    engine_class = QwenThinkerEngine
    head_keys = ("text_bos", "text_eos", "text_pad")

    def __init__(self, *args, speech: bool = True, **kwargs):
        super().__init__(*args, speech=speech, **kwargs)

    def setup_speech(self) -> None:
        config = omni_config(self.path)
        if config is None:
            raise ValueError(f"{self.path} holds the thinker alone; speech needs the whole checkpoint's "
                             "talker ids and spk_dict.pt (or set speech: false)")
        self.text_eos_id = config.talker_config.tts_text_end_token_id
        self.text_pad_id = config.talker_config.tts_text_pad_token_id
        self.speakers = {name: int(p["bos_token"]) for name, p in load_speakers(self.path).items()}

    def speech_head(self, payload: dict) -> int:
        bos = self.speakers.get(payload.get("speaker", DEFAULT_SPEAKER))
        if bos is None:
            raise InvalidInput(f"speaker {payload.get('speaker')!r} is not in spk_dict.pt; "
                               f"available: {sorted(self.speakers)}", field="speaker")
        return bos

    def head_extra(self, payload: dict, head: int) -> dict[str, torch.Tensor]:
        special = self.engine.embeds([head, self.text_eos_id, self.text_pad_id])
        return {"text_bos": special[0], "text_eos": special[1], "text_pad": special[2]}

    def prefill_inputs(self, payload: dict) -> PrefillInputs:
        return prefill_inputs(self.model, payload, self.device)

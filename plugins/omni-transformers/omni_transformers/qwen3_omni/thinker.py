"""Qwen3-Omni's MoE thinker on the kit's skeleton: its part of the checkpoint, M-RoPE positions (4 axes:
the text axis, then the three rotary ones) and what its talker reads (``speech: true``).

The talker's hand-offs, as ``Qwen3OmniMoeForConditionalGeneration.generate`` builds them: over the prompt,
the thinker's input embeddings (hidden state 0) at text positions and its hidden state ``accept_hidden_layer``
at audio/image positions; per generated token, its input embedding (streamed one step later, when it is fed
back); in the first chunk, which prompt positions are user turns and which are media, the embeddings of
``<tts_text_bos>``, ``<tts_text_eod>`` and ``<tts_pad>``, and the speaker's codec id (``speaker``: ``chelsie``,
``ethan`` or ``aiden``, from the config; any case), and for the talker's M-RoPE positions the prompt's ids and
its audios' feature lengths and images' grids. Audio and images in the prompt: the encoders' embeddings spliced in
at their placeholders, and the vision tower's deepstack features added to the first layers' hidden states at the
image positions (as the thinker's forward does with pixel values)."""

from __future__ import annotations

import attrs
import torch
from omni_core.errors import InvalidInput

from ..kit.sampling import torch_dtype
from ..kit.thinker import PrefillInputs, ThinkerEngine
from ..kit.thinker import Thinker as KitThinker
from ..qwen2_5_omni.inputs import prefill_inputs

DEFAULT_SPEAKER = "ethan"  # generate's


def omni_config(path):
    import transformers

    return transformers.Qwen3OmniMoeConfig.from_pretrained(path, local_files_only=True)


def load_thinker(path, *, dtype: str | None = "auto", device: str = "cpu"):
    """The thinker of a whole ``qwen3_omni_moe`` checkpoint (only its weights are read), in eval mode."""
    import transformers

    transformers.logging.set_verbosity_error()  # the report of the other parts' weights, not loaded here
    config = omni_config(path)
    want = torch_dtype(dtype)
    model = transformers.Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(
        path, config=config.thinker_config, key_mapping={r"^thinker\.": ""}, local_files_only=True,
        dtype=want if want is not None else "auto")
    return model.to(device).eval()


@attrs.frozen
class ImagePrefill(PrefillInputs):
    """A prompt with images: also the vision tower's deepstack features ``deepstack`` [layers, n, H] and the
    image positions ``image_mask`` [L] they are added at (in the first layers' hidden states)."""

    deepstack: torch.Tensor | None = None
    image_mask: torch.Tensor | None = None


class Qwen3ThinkerEngine(ThinkerEngine):
    position_axes = 4  # the text axis, then M-RoPE's three
    hands_off = True

    def load_model(self, path, *, dtype: str, device: str):
        self.accept_layer = omni_config(path).talker_config.accept_hidden_layer
        model = load_thinker(path, dtype=dtype, device=device)
        self._deepstack: tuple | None = None
        model.model.language_model.register_forward_pre_hook(self._add_deepstack, with_kwargs=True)
        return model

    def _add_deepstack(self, module, args, kwargs):
        """The deepstack features of the prompt chunk being prefilled (``prefill`` sets them; the forward
        from embeddings passes none of its own)."""
        if self._deepstack is not None:
            kwargs["visual_pos_masks"], kwargs["deepstack_visual_embeds"] = self._deepstack
        return args, kwargs

    def prefill(self, state, start: int, end: int):
        pre = state.pre
        if not isinstance(pre, ImagePrefill) or pre.deepstack is None:
            return super().prefill(state, start, end)
        mask = pre.image_mask[start:end]
        first, count = int(pre.image_mask[:start].sum()), int(mask.sum())
        if count:
            self._deepstack = (mask[None].to(self.device), list(pre.deepstack[:, first:first + count]))
        try:
            return super().prefill(state, start, end)
        finally:
            self._deepstack = None

    def step_conditioning(self, out) -> torch.Tensor:
        return out.hidden_states[0][:, 0]  # the fed token's input embedding

    def prompt_conditioning(self, out, state, start: int, end: int) -> torch.Tensor:
        embeds = out.hidden_states[0][0]
        if state.pre.media_mask is None:
            return embeds
        media = state.pre.media_mask[start:end].to(embeds.device)[:, None]
        return torch.where(media, out.hidden_states[self.accept_layer][0], embeds)


class Thinker(KitThinker):
    __doc__ = KitThinker.__doc__
    engine_class = Qwen3ThinkerEngine
    head_keys = ("user", "media", "tts", "speaker", "ids", "audio_seqlens", "image_grid")

    def __init__(self, *args, speech: bool = True, **kwargs):
        super().__init__(*args, speech=speech, **kwargs)

    def setup_speech(self) -> None:
        config = omni_config(self.path)
        if not config.enable_audio_output:
            raise ValueError(f"{self.path} has no talker (enable_audio_output: false); set speech: false")
        self.speakers = {str(name).lower(): int(i) for name, i in config.talker_config.speaker_id.items()}
        self.tts_ids = [config.tts_bos_token_id, config.tts_eos_token_id, config.tts_pad_token_id]
        self.im_start, self.user_id, self.assistant_id = (config.im_start_token_id, config.user_token_id,
                                                          config.assistant_token_id)

    def speech_head(self, payload: dict) -> int:
        name = payload.get("speaker") or DEFAULT_SPEAKER
        codec = self.speakers.get(name.lower()) if isinstance(name, str) else None
        if codec is None:
            raise InvalidInput(f"speaker {name!r} is not one of this model's voices: {', '.join(sorted(self.speakers))}",
                               field="speaker")
        return codec

    def head_extra(self, payload: dict, head: int) -> dict[str, torch.Tensor]:
        ids = payload["input_ids"]
        # The reply follows "<|im_start|>assistant\n": the talker's prefill reads those 3 positions.
        if len(ids) < 3 or ids[-3] != self.im_start or ids[-2] != self.assistant_id:
            raise InvalidInput("a spoken reply needs the prompt to end with the assistant's turn start "
                               "(<|im_start|>assistant and a newline, as add_generation_prompt renders it)",
                               field="input_ids")
        # A position is in a user turn when the turn's role token (after its <|im_start|>) is the user's.
        user, role = [], None
        for k, token in enumerate(ids):
            if token == self.im_start:
                role = ids[k + 1] if k + 1 < len(ids) else None
            user.append(role == self.user_id)
        return {"user": torch.tensor(user, dtype=torch.bool), "media": torch.zeros(len(ids), dtype=torch.bool),
                "tts": self.engine.embeds(self.tts_ids), "speaker": torch.tensor([head], dtype=torch.long),
                "ids": torch.tensor(ids, dtype=torch.long),
                "audio_seqlens": torch.tensor(payload.get("audio_seqlens") or [], dtype=torch.long),
                "image_grid": torch.tensor(payload.get("image_grid_thw") or [], dtype=torch.long).reshape(-1, 3)}

    def prefill_inputs(self, payload: dict) -> PrefillInputs:
        """The prompt with the encoders' embeddings spliced in at their placeholders, M-RoPE positions from the
        model's own ``get_rope_index`` (as for Qwen2.5-Omni), and the images' deepstack features."""
        pre = prefill_inputs(self.model, payload, self.device)
        deepstack = payload.get("image_deepstack")
        if deepstack is None:
            return pre
        image_mask = torch.tensor(pre.input_ids, device=self.device) == self.model.config.image_token_id
        if not isinstance(deepstack, torch.Tensor) or deepstack.dim() != 3 or deepstack.shape[1] != int(image_mask.sum()):
            raise ValueError(f"image_deepstack must be [layers, {int(image_mask.sum())}, H] (one row per image "
                             f"placeholder), got {getattr(deepstack, 'shape', type(deepstack).__name__)}")
        return ImagePrefill(**attrs.asdict(pre, recurse=False),
                            deepstack=deepstack.to(self.device, pre.inputs_embeds.dtype), image_mask=image_mask)

    def _prepare(self, payload: dict, head) -> tuple[PrefillInputs, dict]:
        pre, extra = super()._prepare(payload, head)
        if self.speech and pre.media_mask is not None:  # the talker reads media positions through hidden_projection
            extra["media"] = pre.media_mask.cpu()
        return pre, extra

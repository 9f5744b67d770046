"""The token2wav stage: codec codes -> waveform (DiT flow matching + BigVGAN)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from .common import DEFAULT_SPEAKER, request_seed, sample_rate_of
from .models import (
    load_part,
    load_speakers,
    make_generator,
    resolve_model_path,
    speaker_params,
    torch_dtype,
)


class Token2Wav:
    """Codes → waveform (DiT flow matching + BigVGAN), one chunk once the talker's codes are all in
    (the sliding-window DiT is not split here: chunked synthesis would not equal ``generate``).
    Forwards the text chunks to the caller as they come; returns the whole result."""

    def __init__(self, model: str | None = None, device: str = "cpu", dtype: str = "float32", num_steps: int = 10,
                 guidance_scale: float = 0.5, sway_coefficient: float = -1.0, sample_rate: int | None = None,
                 wav_path: str | None = None, source: str = "talker"):
        self.path = resolve_model_path(model)
        self.device = torch.device(device)
        if torch_dtype(dtype, torch.float32) != torch.float32:
            raise ValueError("token2wav runs in float32 (as transformers runs it); set dtype: float32")
        self.model = load_part(self.path, "token2wav", device=device)
        self.speakers = load_speakers(self.path)
        self.options = {"num_steps": num_steps, "guidance_scale": guidance_scale, "sway_coefficient": sway_coefficient}
        self.sample_rate = sample_rate or sample_rate_of(self.path)
        self.wav_path = wav_path
        self.source = source

    def _write_wav(self, path: str, audio: torch.Tensor) -> str:
        """16-bit mono PCM, written next to ``path`` then renamed (concurrent writers never mix)."""
        import os
        import tempfile
        import wave

        target = Path(path).expanduser().resolve()
        target.parent.mkdir(parents=True, exist_ok=True)
        pcm = (audio.clamp(-1, 1) * 32767).round().to(torch.int16).numpy().tobytes()
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        try:
            with os.fdopen(fd, "wb") as fh, wave.open(fh, "wb") as out:
                out.setnchannels(1)
                out.setsampwidth(2)
                out.setframerate(self.sample_rate)
                out.writeframes(pcm)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return str(target)

    def _synthesize(self, codes: list[int], speaker: dict, generator: torch.Generator) -> torch.Tensor:
        from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import RungeKutta4ODESolver

        with torch.inference_mode():
            dit = self.model.code2wav_dit_model
            code = torch.tensor([codes], dtype=torch.long, device=self.device)
            cond = speaker["cond"].to(self.device).float().expand(1, -1)
            ref_mel = speaker["ref_mel"].to(self.device).float().expand(1, -1, -1)
            # Qwen2_5OmniToken2WavDiTModel.sample, with the initial noise from this request's generator.
            duration = code.shape[1] * dit.repeats
            if duration > dit.config.max_position_embeddings:
                raise ValueError(f"{len(codes)} codes make a mel of {duration} frames, more than the DiT's "
                                 f"max_position_embeddings ({dit.config.max_position_embeddings})")
            noise = torch.randn([1, duration, dit.mel_dim], dtype=ref_mel.dtype, device=self.device,
                                generator=generator)
            cond = cond.unsqueeze(1).repeat(1, duration, 1)
            guidance = self.options["guidance_scale"]

            def ode_function(time_step, hidden_states):
                if guidance < 1e-5:
                    return dit(hidden_states=hidden_states, speaker_embedding=cond, condition_vector=ref_mel,
                               quantized_code=code, time_step=time_step, drop_audio_conditioning=False,
                               drop_code=False, apply_cfg=False)
                out = dit(hidden_states=hidden_states, quantized_code=code, speaker_embedding=cond,
                          condition_vector=ref_mel, time_step=time_step, apply_cfg=True)
                guided, null = torch.chunk(out, 2, dim=0)
                return guided + (guided - null) * guidance

            times = torch.linspace(0, 1, self.options["num_steps"], device=self.device, dtype=cond.dtype)
            sway = self.options["sway_coefficient"]
            if sway is not None:
                times += sway * (torch.cos(torch.pi / 2 * times) - 1 + times)
            trajectory = RungeKutta4ODESolver(function=ode_function, initial_value=noise).integrate(times)
            mel = trajectory[-1].permute(0, 2, 1)
            return self.model.code2wav_bigvgan_model(mel).reshape(-1).float().cpu()

    async def __call__(self, payload: dict, ctx) -> dict:
        speaker = speaker_params(self.speakers, payload.get("speaker", DEFAULT_SPEAKER))
        generator = make_generator(request_seed(payload), self.device)
        text: list[str] = []
        token_ids: list[int] = []
        codes: list[int] = []
        finished = False
        async for chunk in ctx.stream_from(self.source):
            if "text" in chunk:
                text.append(chunk["text"])
                token_ids.extend(chunk["token_ids"])
                await ctx.emit({"text": chunk["text"], "token_ids": list(chunk["token_ids"])})
            if "codes" in chunk:
                codes.extend(int(c) for c in chunk["codes"])
            if chunk.get("final"):
                finished = True
                if chunk.get("rng_state") is not None:  # continue the talker's RNG, as generate's global one
                    generator.set_state(torch.frombuffer(bytearray(chunk["rng_state"]), dtype=torch.uint8))
        if not finished:
            raise RuntimeError(f"the {self.source} stream ended without its final chunk")
        if codes:
            audio = await asyncio.to_thread(self._synthesize, codes, speaker, generator)
        else:  # the talker ended at once; generate would fail on an empty code sequence
            audio = torch.zeros(0)
        await ctx.emit({"audio": audio, "sample_rate": self.sample_rate})
        result = {"text": "".join(text), "token_ids": token_ids, "codes": codes, "audio": audio,
                  "sample_rate": self.sample_rate}
        wav_path = payload.get("wav_path", self.wav_path)
        if wav_path:
            result["wav_path"] = await asyncio.to_thread(self._write_wav, str(wav_path), audio)
        return result

"""A toy model family on the kit, as a third-party package would ship one: a tiny random Llama
thinker (the kit's thinker skeleton, no hook of its own) and a trivial codec (each token a frame of
two codes, each frame a short tone). It is an omni plugin: its hooks register the family, its
stages and its pipeline; its stage processes import it by path (the tests folder is on theirs)."""

from __future__ import annotations

import math
from pathlib import Path

import omni_core
import torch

from omni_transformers.kit.chunks import AudioChunk, CodesChunk, TextChunk
from omni_transformers.kit.family import Family
from omni_transformers.kit.sampling import resolve_model_path
from omni_transformers.kit.streams import request_seed
from omni_transformers.kit.thinker import Thinker

SAMPLE_RATE = 8000
SAMPLES_PER_FRAME = 80
CODEBOOKS = 2
EOS = 256

FAMILY = Family(name="toy", model_types=("llama",), default_pipeline="toy", write_tiny="toy_family:write_tiny",
                stages={"processor": "toy.processor", "thinker": "toy.thinker", "codec": "toy.codec"},
                description="a tiny random Llama thinker + a trivial codec")

PIPELINE = {
    "name": "toy",
    "stages": [
        {"name": "processor", "factory": "toy_family:Processor", "next": ["thinker", "codec"]},
        {"name": "thinker", "factory": "toy_family:Thinker", "stream_to": ["codec"], "next": ["codec"],
         "route_fn": "omni_transformers.kit.wiring:no_payload"},
        {"name": "codec", "factory": "toy_family:Codec", "terminal": True},
    ],
}


def write_tiny(path, *, seed: int = 0) -> Path:
    """A random 2-layer Llama over bytes (ids 0-255, end 256) with a byte-level tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=EOS + 1, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=EOS, bos_token_id=EOS, pad_token_id=EOS)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight[EOS] *= 3.0  # a reply ends after some steps
    model.save_pretrained(path)
    table = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(table, key=lambda c: ord(c) if ord(c) < 256 else 1000 + ord(c)))}
    vocab["</s>"] = EOS
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["</s>"])
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>").save_pretrained(path)
    return path


class Processor:
    """``{"text"}`` → ``{"input_ids"}`` with the checkpoint's tokenizer."""

    def __init__(self, model: str | None = None):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(model), local_files_only=True)

    def __call__(self, payload: dict, ctx) -> dict:
        text = payload.get("text")
        if not isinstance(text, str) or not text:
            raise omni_core.InvalidInput("inputs need 'text', a non-empty string", field="text")
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return {"input_ids": ids, "max_new_tokens": payload.get("max_new_tokens", 8), "seed": request_seed(payload)}


def tone(frame: list[int]) -> torch.Tensor:
    """A frame of codes as samples: a tone whose pitch and loudness the two codes set."""
    t = torch.arange(SAMPLES_PER_FRAME, dtype=torch.float32) / SAMPLE_RATE
    return (0.1 + frame[1] / 40) * torch.sin(2 * math.pi * (200 + 50 * frame[0]) * t)


class Codec:
    """Reads the thinker's text chunks: passes the text on, makes each token a frame of two codes
    (a talker with one step per token) and each frame a tone (a streaming vocoder)."""

    def __init__(self, model: str | None = None, source: str = "thinker"):
        self.source = source

    async def __call__(self, payload: dict, ctx) -> dict:
        text, ids, codes, audio = [], [], [], []
        async for wire in ctx.stream_from(self.source):
            chunk = TextChunk.from_wire(wire)
            frames = CodesChunk([c for t in chunk.token_ids for c in (t % 16, t // 16 % 16)], CODEBOOKS)
            text.append(chunk.text)
            ids += chunk.token_ids
            codes += frames.codes
            await ctx.emit(TextChunk(chunk.text, chunk.token_ids).to_wire())
            if frames.codes:
                samples = torch.cat([tone(f) for f in frames.frames])
                audio.append(samples)
                await ctx.emit(AudioChunk(samples, SAMPLE_RATE).to_wire())
        wave = torch.cat(audio) if audio else torch.zeros(0)
        return {"text": "".join(text), "token_ids": ids, "codes": codes, "audio": wave, "sample_rate": SAMPLE_RATE}


@omni_core.hookimpl
def omni_register_families(register):
    register("toy", "toy_family:FAMILY", model_types=["llama"], pipeline="toy", description=FAMILY.description)


@omni_core.hookimpl
def omni_register_stages(register):
    register("toy.processor", Processor)
    register("toy.thinker", Thinker)
    register("toy.codec", Codec)


@omni_core.hookimpl
def omni_register_pipelines(register):
    register("toy", PIPELINE, description="the toy family: Llama thinker ==> codec")

"""The per-request decoding helpers every family shares: the checkpoint folder, dtypes, a request's
generator, the sampler and incremental detokenisation.

Nothing here keeps per-request state on a module: caches, positions, RNG and logits
processors live in objects made per request, so one loaded model serves many requests at once.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
from omni_core import InvalidInput

MODEL_ENV = "OMNI_TRANSFORMERS_MODEL"

def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """The checkpoint folder: ``model`` if given, else ``$OMNI_TRANSFORMERS_MODEL``."""
    if model in (None, ""):
        model = os.environ.get(MODEL_ENV)
        if not model:
            raise ValueError(
                f"no checkpoint given: set args.model to a local checkpoint folder or set {MODEL_ENV} "
                "(a tiny one for tests: python -m omni_transformers.tiny DIR [--family NAME])"
            )
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"{path} is not a checkpoint folder (no config.json); give a local folder written by save_pretrained "
            "(this plugin never downloads)"
        )
    return path


def torch_dtype(dtype: str | None, default: torch.dtype | None = None) -> torch.dtype | None:
    """``"auto"``/None → ``default`` (the checkpoint's dtype); else ``float32``, ``bfloat16``, ``float16``."""
    if dtype in (None, "auto"):
        return default
    try:
        value = getattr(torch, str(dtype))
    except AttributeError:
        value = None
    if not isinstance(value, torch.dtype):
        raise ValueError(f"dtype {dtype!r} is not a torch dtype; use auto, float32, bfloat16 or float16")
    return value


def make_generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(int(seed))


#: The sampling settings a request may give (each overrides the stage's own for that request).
REQUEST_SAMPLING = ("temperature", "top_p", "top_k")


def request_sampling(payload: dict) -> dict[str, Any]:
    """The sampling settings ``payload`` gives, checked (``InvalidInput`` naming the key): a
    ``temperature`` of 0 means greedy, above 0 sampling at that temperature; ``top_p`` in (0, 1] and
    ``top_k`` ≥ 0 (0: off) sample too, at the stage's temperature unless the request gives one.
    Absent or null keys are left out."""
    out: dict[str, Any] = {}
    for key in REQUEST_SAMPLING:
        value = payload.get(key)
        if value is None:
            continue
        if key == "top_k":
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise InvalidInput(f"top_k must be an integer of at least 0 (0: off), got {value!r}", field=key)
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise InvalidInput(f"{key} must be a number, got {value!r}", field=key)
        elif key == "temperature" and not 0 <= value <= 2:
            raise InvalidInput(f"temperature must be between 0 and 2 (0: greedy), got {value!r}", field=key)
        elif key == "top_p" and not 0 < value <= 1:
            raise InvalidInput(f"top_p must be above 0 and at most 1, got {value!r}", field=key)
        out[key] = value if key == "top_k" else float(value)
    return out


def sampling_for(request: dict[str, Any], *, do_sample: bool, temperature: float | None, top_k: int | None,
                 top_p: float | None) -> dict[str, Any]:
    """The stage's settings (``do_sample`` …) with a request's checked ones (:func:`request_sampling`)
    over them: the keyword arguments of :class:`Sampler` for that request."""
    if not request:
        return {"do_sample": do_sample, "temperature": temperature, "top_k": top_k, "top_p": top_p}
    temperature = request.get("temperature", temperature)
    return {"do_sample": temperature != 0 if "temperature" in request else True,
            "temperature": temperature if temperature != 0 else None,
            "top_k": request.get("top_k", top_k), "top_p": request.get("top_p", top_p)}


class Sampler:
    """Chooses the next token the way ``GenerationMixin.generate`` does for one sequence: the same
    logits processors in the same order, argmax or ``torch.multinomial`` with a per-request
    generator instead of the global RNG."""

    def __init__(
        self,
        *,
        do_sample: bool,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        repetition_penalty: float | None = None,
        suppress_tokens: list[int] | None = None,
        generator: torch.Generator | None = None,
        device: str | torch.device = "cpu",
    ):
        from transformers.generation import logits_process as lp

        self.do_sample = bool(do_sample)
        self.generator = generator
        # Samplers with equal settings run their processors on several rows at once (sample_rows).
        self.settings = (self.do_sample, temperature, top_k, top_p, repetition_penalty,
                         tuple(suppress_tokens or ()), str(device))
        procs = []
        if repetition_penalty is not None and repetition_penalty != 1.0:
            procs.append(lp.RepetitionPenaltyLogitsProcessor(repetition_penalty))
        if suppress_tokens:
            procs.append(lp.SuppressTokensLogitsProcessor(suppress_tokens, device=device))
        if self.do_sample:
            if temperature is not None and temperature != 1.0:
                procs.append(lp.TemperatureLogitsWarper(temperature))
            if top_k is not None and top_k != 0:
                procs.append(lp.TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
            if top_p is not None and top_p < 1.0:
                procs.append(lp.TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
        self.processors = procs

    def __call__(self, sequence: torch.Tensor, logits: torch.Tensor) -> int:
        """``sequence``: [1, n] ids so far (prompt included); ``logits``: [1, vocab] of the last position."""
        scores = logits.to(copy=True, dtype=torch.float32)
        for proc in self.processors:
            scores = proc(sequence, scores)
        if self.do_sample:
            probs = torch.nn.functional.softmax(scores, dim=-1)
            return int(torch.multinomial(probs, num_samples=1, generator=self.generator)[0, 0])
        return int(torch.argmax(scores, dim=-1)[0])


def sample_rows(samplers: list[Sampler], ids: list[list[int]], logits: torch.Tensor) -> list[int | Exception]:
    """One token per row (``logits`` [B, vocab], row i drawn by ``samplers[i]`` with ``ids[i]`` as
    its sequence so far): equal, token for token, to calling each row's sampler alone.

    Rows whose samplers have equal settings go through the logits processors as one [rows, vocab]
    batch (each row's ids padded with its own first id, which the repetition penalty reads as
    once more the same id); greedy rows take one argmax. A sampled row draws from its own
    generator what ``torch.multinomial`` draws for one sample (``q ~ Exp(1)`` per token, then
    the argmax of ``p / q``), so the per-request seeds keep their meaning; only those draws are
    per row. A batch with a non-finite probability goes row by row: the row at fault gets
    ``torch.multinomial``'s own error in its place, the others their tokens."""
    picks: list[int | Exception] = [0] * len(samplers)
    groups: dict[tuple, list[int]] = {}
    for i, sampler in enumerate(samplers):
        groups.setdefault((sampler.settings, bool(ids[i])), []).append(i)
    for rows in groups.values():
        sampler = samplers[rows[0]]
        index = torch.tensor(rows, device=logits.device)
        scores = logits.index_select(0, index).to(dtype=torch.float32)
        width = max(len(ids[i]) for i in rows)
        sequence = torch.tensor([ids[i] + ids[i][:1] * (width - len(ids[i])) for i in rows], device=logits.device)
        for proc in sampler.processors:
            scores = proc(sequence, scores)
        if not sampler.do_sample:
            chosen = torch.argmax(scores, dim=-1)
        else:
            probs = torch.nn.functional.softmax(scores, dim=-1)
            if not bool(torch.isfinite(probs).all()):
                for j, i in enumerate(rows):
                    try:
                        picks[i] = samplers[i](sequence[j:j + 1, :len(ids[i])], logits[i:i + 1])
                    except Exception as exc:  # this row's alone
                        picks[i] = exc
                continue
            q = torch.empty_like(probs)
            for j, i in enumerate(rows):
                q[j].exponential_(1, generator=samplers[i].generator)
            chosen = torch.argmax(probs / q, dim=-1)
        for i, token in zip(rows, chosen.tolist(), strict=True):
            picks[i] = int(token)
    return picks


class TextDecoder:
    """Incremental detokenisation: ``push(id)`` returns the new text, never half a character."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""
        # A fast tokenizer's own decoder gives the same text as tokenizer.decode(...,
        # clean_up_tokenization_spaces=False) without re-checking every id on each call.
        backend = getattr(tokenizer, "_tokenizer", None)
        self._backend = backend if callable(getattr(backend, "decode", None)) else None

    def text(self) -> str:
        if self._backend is not None:
            return self._backend.decode(self.ids, skip_special_tokens=True)
        return self.tokenizer.decode(self.ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        text = self.text()
        if text.endswith("\ufffd") or not text.startswith(self.emitted):
            return ""
        delta, self.emitted = text[len(self.emitted):], text
        return delta

    def flush(self) -> str:
        text = self.text()
        delta = text[len(self.emitted):] if text.startswith(self.emitted) else ""
        self.emitted = text
        return delta

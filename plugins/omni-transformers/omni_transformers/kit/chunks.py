"""The typed chunks the stage skeletons stream to each other (and to the caller).

Each class is what a stage builds and reads; on the wire a chunk is its :meth:`to_wire` mapping
(plain keys, tensors as tensors: the relays carry them), and a reader turns a mapping back into
the class with :func:`thinker_chunk`, :func:`codes_chunk` or the class's ``from_wire``, which say
what is wrong with a malformed one. ``WIRE_VERSION`` is the version of these mappings
(docs/models.md lists their keys): a change of keys is a new version.

- thinker → talker: one :class:`ThinkerHead` (step 0: the prompt's conditioning and the family's
  extra tensors), a :class:`ThinkerStep` per next token, then :class:`ThinkerEnd`.
- thinker → caller, talker → vocoder → caller: :class:`TextChunk`.
- talker → vocoder: :class:`CodesChunk`, frames of ``codebooks`` codes each (1 for a one-code
  talker, 16 for a 16-codebook one), frame-major.
- vocoder → caller: :class:`AudioChunk`.
"""

from __future__ import annotations

from typing import Any

import attrs

WIRE_VERSION = 1

#: The usage counts a thinker's end (and a text chunk that carries them) may hold.
USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "finish_reason")


class ChunkError(ValueError):
    """A stream chunk that is not what its reader expects (a bug in the stage that sent it)."""


def _need(wire: Any, key: str, kind: str) -> Any:
    if not isinstance(wire, dict):
        raise ChunkError(f"a {kind} chunk must be a mapping, got {type(wire).__name__}")
    if key not in wire:
        raise ChunkError(f"a {kind} chunk has no {key!r} (keys: {sorted(wire)})")
    return wire[key]


@attrs.frozen
class TextChunk:
    """New text and the token ids it came from; ``usage`` (the thinker's counts) on the last one."""

    text: str
    token_ids: list[int] = attrs.field(factory=list)
    usage: dict[str, Any] = attrs.field(factory=dict)

    def to_wire(self) -> dict:
        return {"text": self.text, "token_ids": list(self.token_ids), **self.usage}

    @classmethod
    def from_wire(cls, wire: dict) -> TextChunk:
        """A text chunk; one with the usage counts alone has no ``text``."""
        usage = {k: wire[k] for k in USAGE_FIELDS if k in wire} if isinstance(wire, dict) else {}
        text = wire.get("text", "") if usage else _need(wire, "text", "text")
        return cls(text, list(wire.get("token_ids", ())), usage)


@attrs.frozen
class ThinkerHead:
    """Step 0: the first token, and what the talker's prefill needs: ``prompt`` [L, H] (the prompt's
    conditioning, the thinker's input embedding + last hidden state per position) and the
    family's ``extra`` tensors (for example the speaker's and the text end's embeddings)."""

    token_id: int
    text: str
    prompt: Any
    extra: dict[str, Any] = attrs.field(factory=dict)
    step: int = 0

    def to_wire(self) -> dict:
        return {"step": 0, "token_id": self.token_id, "text": self.text, **self.extra, "prompt": self.prompt}


@attrs.frozen
class ThinkerStep:
    """Step k ≥ 1: the token and ``reply`` [H], the conditioning of the token fed at this step."""

    step: int
    token_id: int
    text: str
    reply: Any

    def to_wire(self) -> dict:
        return {"step": self.step, "token_id": self.token_id, "text": self.text, "reply": self.reply}


@attrs.frozen
class ThinkerEnd:
    """The reply ended: the text held back by incremental detokenisation, and the usage counts."""

    text: str
    usage: dict[str, Any] = attrs.field(factory=dict)

    def to_wire(self) -> dict:
        return {"final": True, "text": self.text, **self.usage}


def thinker_chunk(wire: dict, head_keys: tuple[str, ...] = ()) -> ThinkerHead | ThinkerStep | ThinkerEnd:
    """A thinker chunk from the wire; ``head_keys`` are the family's extra tensors of step 0."""
    if isinstance(wire, dict) and wire.get("final"):
        return ThinkerEnd(wire.get("text", ""), {k: wire[k] for k in USAGE_FIELDS if k in wire})
    step = _need(wire, "step", "thinker")
    token_id, text = _need(wire, "token_id", "thinker"), _need(wire, "text", "thinker")
    if step == 0:
        return ThinkerHead(token_id, text, _need(wire, "prompt", "thinker head"),
                           {k: _need(wire, k, "thinker head") for k in head_keys})
    return ThinkerStep(step, token_id, text, _need(wire, "reply", "thinker step"))


@attrs.frozen
class CodesChunk:
    """Codec codes: ``frames`` frames of ``codebooks`` codes each, frame-major in ``codes``; the
    last chunk of a stream has ``final`` (and the talker's generator state, ``rng_state``)."""

    codes: list[int]
    codebooks: int = 1
    final: bool = False
    rng_state: bytes | None = None

    def __attrs_post_init__(self) -> None:
        if self.codebooks < 1 or len(self.codes) % self.codebooks:
            raise ChunkError(f"{len(self.codes)} codes are not whole frames of {self.codebooks} codebooks")

    @property
    def frames(self) -> list[list[int]]:
        n = self.codebooks
        return [self.codes[i:i + n] for i in range(0, len(self.codes), n)]

    def to_wire(self) -> dict:
        wire: dict[str, Any] = {"codes": list(self.codes)}
        if self.codebooks != 1:
            wire["codebooks"] = self.codebooks
        if self.final:
            wire["final"] = True
            if self.rng_state is not None:
                wire["rng_state"] = self.rng_state
        return wire

    @classmethod
    def from_wire(cls, wire: dict) -> CodesChunk:
        return cls(list(_need(wire, "codes", "codes")), int(wire.get("codebooks", 1)), bool(wire.get("final")),
                   wire.get("rng_state"))


def codes_chunk(wire: dict) -> CodesChunk | TextChunk:
    """What a vocoder reads from its talker: codes, or text passed on to the caller."""
    if isinstance(wire, dict) and "codes" in wire:
        return CodesChunk.from_wire(wire)
    return TextChunk.from_wire(wire)


@attrs.frozen
class AudioChunk:
    """Samples of speech (1-D float) at ``sample_rate``."""

    audio: Any
    sample_rate: int

    def to_wire(self) -> dict:
        return {"audio": self.audio, "sample_rate": self.sample_rate}

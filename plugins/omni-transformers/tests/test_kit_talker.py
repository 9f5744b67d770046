"""The kit's codec-LM talker skeleton (kit/talker.py CodecTalker) driven in-process by a fake family:
a tiny random Llama as the codec LM, the thinker's stream played by a fake context. No Qwen part.

What is checked: a request's codes equal a plain greedy loop over the same model (full recompute,
no cache); rows stepping together (greedy and seeded sampling, one batched sampler call per step)
equal each request alone; the batched sampler equals each row's own sampler token for token; the
chunks go out at 1, 2, 4, 8 ... frames, then every ``codes_per_chunk``; bad options are refused
naming the option."""

from __future__ import annotations

import asyncio

import pytest
import torch

from omni_transformers.kit.chunks import CodesChunk, ThinkerEnd, ThinkerHead, ThinkerStep
from omni_transformers.kit.sampling import Sampler, make_generator, sample_rows
from omni_transformers.kit.talker import CodecTalker

pytestmark = pytest.mark.timeout(300)

HIDDEN = 16
CODES = 48
EOS = 47
NEVER = 46  # a code the sampler never draws (suppress)


def fake_lm():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    config = LlamaConfig(vocab_size=CODES, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight[EOS] *= 0.0  # the reply runs to its most frames
    return model


class FakeTalker(CodecTalker):
    """A fake family on the skeleton: the prompt is the thinker's conditioning plus reply 0; a step's
    input is its last code's embedding plus the thinker's reply; past the reply, zeros."""

    def load_model(self, path, *, dtype, device):
        return fake_lm()

    def setup(self, model) -> None:
        self.eos = {EOS}
        self.suppress = [NEVER]

    def prefill_inputs(self, head, reply0):
        prefix = torch.cat([head["prompt"], (torch.zeros(HIDDEN) if reply0 is None else reply0)[None]])
        return prefix, [0] * prefix.shape[0]

    def tail_input(self, state, step):
        return torch.zeros(HIDDEN)

    def step_embeds(self, states, replies):
        codes = torch.tensor([s.last[0] for s in states], dtype=torch.long)
        return (self.model.get_input_embeddings()(codes) + replies)[:, None, :]

    def forward_step(self, embeds, positions, cache):
        out = self.model.model(inputs_embeds=embeds, position_ids=positions, cache=cache,
                               attention_mask=torch.ones(len(positions), 1, 1, 1, dtype=torch.bool),
                               use_cache=True, return_dict=True)
        return self.model.lm_head(out.last_hidden_state)[:, -1, :].float()


def thinker_stream(seed: int, prompt_len: int, steps: int) -> list[dict]:
    """What a thinker streams to a talker: the head, ``steps`` replies, the end."""
    g = torch.Generator().manual_seed(seed)
    wire = [ThinkerHead(1, "a", torch.randn(prompt_len, HIDDEN, generator=g)).to_wire()]
    wire += [ThinkerStep(k, 1 + k, "b", torch.randn(HIDDEN, generator=g)).to_wire() for k in range(1, steps + 1)]
    return [*wire, ThinkerEnd("", {"completion_tokens": steps + 1}).to_wire()]


class FakeCtx:
    """The talker's context: the thinker's stream from a list, emitted chunks kept."""

    def __init__(self, wire: list[dict]):
        self.wire = wire
        self.emitted: list[dict] = []

    async def stream_from(self, source):
        for chunk in self.wire:
            await asyncio.sleep(0)  # other requests' readers run in between
            yield chunk

    async def emit(self, chunk):
        self.emitted.append(chunk)


def talk(talker, requests: list[tuple[dict, list[dict]]]) -> list[tuple[dict, list[dict]]]:
    """Run the requests at once through ``talker``: (result, emitted chunks) each."""
    async def go():
        ctxs = [FakeCtx(wire) for _, wire in requests]
        results = await asyncio.gather(*(talker(dict(p), c) for (p, _), c in zip(requests, ctxs, strict=True)))
        await talker.close()
        return [(r, c.emitted) for r, c in zip(results, ctxs, strict=True)]

    return asyncio.run(go())


def greedy_reference(model, wire: list[dict], max_new: int) -> list[int]:
    """The same talker as a plain loop: the whole sequence through the model at every step, no cache."""
    head = wire[0]
    replies = [w["reply"] for w in wire[1:-1]]
    seq = torch.cat([head["prompt"], replies[0][None]])
    codes: list[int] = []
    with torch.inference_mode():
        for step in range(1, max_new + 1):
            logits = model(inputs_embeds=seq[None]).logits[0, -1].float()
            logits[NEVER] = -float("inf")
            code = int(torch.argmax(logits))
            if code == EOS:
                break
            codes.append(code)
            reply = replies[step] if step < len(replies) else torch.zeros(HIDDEN)
            seq = torch.cat([seq, (model.get_input_embeddings()(torch.tensor([code]))[0] + reply)[None]])
    return codes


def test_a_fake_familys_codes_equal_a_plain_greedy_loop_over_its_model(fake_checkpoint):
    talker = FakeTalker(str(fake_checkpoint), do_sample=False, repetition_penalty=1.0, max_new_tokens=20)
    wire = thinker_stream(1, 6, 8)
    [(result, emitted)] = talk(talker, [({"seed": 0}, wire)])
    assert result["codes"] == greedy_reference(fake_lm(), wire, 20)
    assert len(result["codes"]) == 20
    # the thinker's text goes on to the vocoder; the codes in chunks at 1, 2, 4, 8, 16 frames so far
    codes = [CodesChunk.from_wire(c) for c in emitted if "codes" in c]
    assert [len(c.codes) for c in codes] == [1, 1, 2, 4, 8, 4] and codes[-1].final
    assert [c for chunk in codes for c in chunk.codes] == result["codes"]
    assert [c["text"] for c in emitted if "text" in c][:2] == ["a", "b"]


def test_rows_stepping_together_equal_each_request_alone_greedy_and_seeded(fake_checkpoint):
    requests = [({"seed": n, "talker_do_sample": n % 3 != 0, "talker_max_new_tokens": 10 + n},
                 thinker_stream(n, 4 + n % 3, 5 + n)) for n in range(6)]
    alone = [talk(FakeTalker(str(fake_checkpoint), codes_per_chunk=4), [r])[0] for r in requests]
    together = talk(FakeTalker(str(fake_checkpoint), codes_per_chunk=4), requests)
    for n, ((one, _), (many, emitted)) in enumerate(zip(alone, together, strict=True)):
        assert many["codes"] == one["codes"], n
        assert 0 < len(many["codes"]) <= 10 + n and NEVER not in many["codes"]
        sizes = [len(c["codes"]) for c in emitted if "codes" in c]
        assert sizes[:3] == [1, 1, 2] and all(s <= 4 for s in sizes), sizes
    assert len({tuple(r["codes"]) for r, _ in together}) > 1  # the rows differ: the test compares something


def test_the_batched_sampler_equals_each_rows_own_sampler():
    vocab = 300
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, vocab, generator=g) * 4
    ids = [torch.randint(0, vocab, (1 + 3 * i,), generator=g).tolist() for i in range(12)]

    def samplers():
        return [Sampler(do_sample=i % 4 != 0, top_k=(20, 0)[i % 2], top_p=(0.8, 1.0)[i % 3 == 0],
                        temperature=(0.9, 1.3)[i % 2], repetition_penalty=1.1, suppress_tokens=[5],
                        generator=make_generator(100 + i)) for i in range(12)]

    one, many = samplers(), samplers()
    for _ in range(5):  # the generators advance alike step after step
        alone = [one[i](torch.tensor([ids[i]]), logits[i:i + 1]) for i in range(12)]
        assert sample_rows(many, ids, logits) == alone
        logits = logits.roll(7, dims=1)
    assert len(set(alone)) > 1
    # a row whose probabilities are not finite fails alone, with multinomial's own error
    broken = logits.clone()
    broken[3] = float("nan")
    drawn = sample_rows(samplers(), ids, broken)
    assert isinstance(drawn[3], RuntimeError) and "probability tensor" in str(drawn[3])
    fresh = samplers()
    assert [d for i, d in enumerate(drawn) if i != 3] == [
        fresh[i](torch.tensor([ids[i]]), broken[i:i + 1]) for i in range(12) if i != 3]


@pytest.mark.parametrize(("option", "value", "words"), [
    ("codes_per_chunk", 0, "codes_per_chunk must be a positive int"),
    ("first_codes_per_chunk", 1.5, "first_codes_per_chunk must be a positive int"),
    ("yield_to_first_audio", -1, "yield_to_first_audio must be seconds"),
])
def test_bad_chunking_options_are_refused_naming_the_option(fake_checkpoint, option, value, words):
    with pytest.raises(ValueError, match=words):
        FakeTalker(str(fake_checkpoint), **{option: value})


def test_the_talker_yields_to_first_chunks_on_cpu_by_default(fake_checkpoint):
    assert FakeTalker(str(fake_checkpoint)).yield_to_first_audio == 0.25
    assert FakeTalker(str(fake_checkpoint), yield_to_first_audio=0).yield_to_first_audio == 0


def test_first_codes_per_chunk_equal_to_codes_per_chunk_gives_equal_chunks(fake_checkpoint):
    talker = FakeTalker(str(fake_checkpoint), codes_per_chunk=4, first_codes_per_chunk=4)
    assert [e for e, _ in zip(talker.chunk_ends(), range(4), strict=False)] == [4, 8, 12, 16]
    ramp = FakeTalker(str(fake_checkpoint), codes_per_chunk=16)
    assert [e for e, _ in zip(ramp.chunk_ends(), range(7), strict=False)] == [1, 2, 4, 8, 16, 32, 48]

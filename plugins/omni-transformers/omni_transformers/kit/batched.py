"""The KV cache of batched decode steps: one row per request, each at its own length.

transformers' decoder layers are kept as they are; two things are swapped in:

- :class:`RowsCache`, the ``cache`` of one batched decode step: layer l's ``update`` writes each
  row's new key/value at that row's own position in the row's own buffers and returns, per row,
  a view of exactly its filled length (a list, not a padded tensor);
- the attention function ``omni_rows`` (registered with transformers' ``AttentionInterface``):
  given such lists it runs SDPA row by row on those exact lengths, so no row ever attends over
  padding and each row's attention is the very computation it gets alone; given tensors (a
  prompt) it is transformers' own ``sdpa``.

So a row's result depends on its neighbours only through the batched matrix products of the
projections and MLPs (on CPU, float32: the last bits; a single row is bit-equal to transformers'
own decode step).
"""

from __future__ import annotations

import torch

ATTENTION = "omni_rows"
_registered = False


def _rows_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    if not isinstance(key, list):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    # One query per row, no mask: what transformers' sdpa does for a lone decode step (GQA inside
    # SDPA). Rows of the same length go in one call (the same numbers as row by row, without padding).
    groups: dict[int, list[int]] = {}
    for i, k in enumerate(key):
        groups.setdefault(k.shape[2], []).append(i)
    gqa = query.shape[1] != key[0].shape[1]
    out = query.new_empty(query.shape)
    for rows in groups.values():
        if len(rows) == 1:
            i = rows[0]
            q, k, v = query[i:i + 1], key[i], value[i]
        else:
            index = torch.tensor(rows, device=query.device)
            q = query.index_select(0, index)
            k = torch.cat([key[i] for i in rows])
            v = torch.cat([value[i] for i in rows])
        res = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.0, scale=scaling,
                                                               is_causal=False, enable_gqa=gqa)
        if len(rows) == 1:
            out[rows[0]:rows[0] + 1] = res
        else:
            out.index_copy_(0, index, res)
    return out.transpose(1, 2).contiguous(), None


def use_row_attention(model, config) -> None:
    """Switch the decoder layers of ``model`` that read ``config`` (its text model's config, not
    the encoders') from ``sdpa`` to ``omni_rows``: prompts run as with ``sdpa``; batched decode
    steps take a :class:`RowsCache`."""
    global _registered
    if not _registered:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
        from transformers.modeling_utils import AttentionInterface

        AttentionInterface.register(ATTENTION, _rows_attention)
        AttentionMaskInterface.register(ATTENTION, sdpa_mask)
        _registered = True
    if config._attn_implementation != "sdpa":
        raise ValueError(f"batched decoding needs the model's sdpa attention, not {config._attn_implementation!r}")
    if not any(getattr(m, "config", None) is config for m in model.modules()):
        raise ValueError("the config given is not the one the model's layers read")
    config._attn_implementation = ATTENTION


class RowKV:
    """One request's keys and values, per layer ``[1, kv_heads, capacity, head_dim]``, filled up to
    ``length``. Made from the prompt's ``DynamicCache``; ``capacity`` is what the request reserved
    (prompt + most new tokens)."""

    __slots__ = ("keys", "values", "length", "capacity")

    def __init__(self, cache, capacity: int):
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        length = 0
        for layer in cache.layers:
            k, v = layer.keys, layer.values
            length = k.shape[2]
            capacity = max(capacity, length + 1)
            bk = k.new_empty(1, k.shape[1], capacity, k.shape[3])
            bv = v.new_empty(1, v.shape[1], capacity, v.shape[3])
            bk[:, :, :length] = k
            bv[:, :, :length] = v
            self.keys.append(bk)
            self.values.append(bv)
        self.length = length
        self.capacity = capacity

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


class RowsCache:
    """The ``cache`` argument of one batched decode step over ``rows`` (one new token each).

    ``update`` writes at each row's ``length`` (the same place again if the step is repeated) and
    returns lists of per-row views; the rows' lengths advance only in :meth:`advance`, once the
    step succeeded."""

    def __init__(self, rows: list[RowKV]):
        self.rows = rows
        for row in rows:
            if row.length >= row.capacity:
                raise RuntimeError(f"a row's KV cache is full ({row.capacity} tokens): it reserved too few")

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values, dst_k, dst_v = [], [], [], []
        for row in self.rows:
            n = row.length
            bk, bv = row.keys[layer_idx], row.values[layer_idx]
            dst_k.append(bk[0].select(1, n))
            dst_v.append(bv[0].select(1, n))
            keys.append(bk.narrow(2, 0, n + 1))
            values.append(bv.narrow(2, 0, n + 1))
        # [B, kv, 1, d] -> per row [kv, d], written at each row's own position
        torch._foreach_copy_(dst_k + dst_v, list(key_states[:, :, 0].unbind(0)) + list(value_states[:, :, 0].unbind(0)))
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise RuntimeError("a batched decode step needs explicit position_ids (rows have different lengths)")

    def advance(self) -> None:
        for row in self.rows:
            row.length += 1


def crop_to(cache, length: int) -> None:
    """Drop what a ``DynamicCache`` holds past ``length`` (a prompt chunk run again)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def run_rows(rows, decode, prefill) -> tuple[list, list]:
    """The model part of a decode-loop step (``omni_core.DecodeLoop``): first ``decode(rows)``, one
    batched forward for every decoding row, returning one output per row (the only part that may
    raise, so it must leave nothing a retry would see differently); then ``prefill(state, start,
    end)`` for each prompt chunk, alone (its failure is its row's). Returns ``(results, outs)``:
    ``results[i]`` is ``NO_OUTPUT`` or row i's exception, ``outs`` the ``(i, output)`` of every row
    that has one this step."""
    from omni_core.kits import NO_OUTPUT

    results = [NO_OUTPUT] * len(rows)
    decoding = [i for i, row in enumerate(rows) if row.prefill is None]
    outs = list(zip(decoding, decode([rows[i] for i in decoding]), strict=True)) if decoding else []
    for i, row in enumerate(rows):
        if row.prefill is None:
            continue
        try:
            out = prefill(row.state, *row.prefill)
        except Exception as exc:  # this request's prompt failed: it alone
            results[i] = exc
            continue
        if out is not NO_OUTPUT:
            outs.append((i, out))
    return results, outs


def sample(state, logits, device):
    """One row's next token with its own sampler (logits processors and generator)."""
    return state.sampler(torch.tensor([state.ids], device=device), logits)


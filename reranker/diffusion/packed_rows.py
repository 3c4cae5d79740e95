"""A forward whose rows run different numbers of columns, with no padding through the layers.

In a batch whose rows move through their blocks independently, a step writes the finished block's
clean window for some rows and not for others. A rectangular (b, columns) input makes the others run
as many padding columns through every layer (18% of a Beauty decode's column-rows at batch 8). Here
the step's columns are packed into one sequence (1, N), so the embeddings, projections, MLPs and
vocabulary head (nearly all of a small model's work) run exactly the real columns; only attention
is per row. The attention function below scatters each layer's new keys and values into the rows'
KV buffers (kv_cache.InPlaceLayer.write_rows) at per-row columns, then runs one scaled-dot-product
attention for every row's noisy window and one for the writing rows' clean windows over the rows'
buffers, under an additive mask; no query is padding. Rows therefore keep cache lengths of their
own, which the decoder tracks (independent_decoder.py). A padded batch's prompt prefill takes this
route one row at a time (a PromptRow plan; prompt_prefill.py): each prompt's own tokens, causal, its
keys written into its row.

The function is registered with transformers' AttentionInterface under PACKED_ROWS_ATTENTION (a new
name: no existing implementation changes) and is only picked inside `packed_rows_attention(model)`,
which switches that model's attention implementation for the decode and back after it. A forward
given no `packed_rows` plan runs Hugging Face's sdpa attention unchanged (with the mask it is given;
with none, causal: Hugging Face builds no mask for an implementation it does not know).
"""
import contextlib
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

PACKED_ROWS_ATTENTION = "dgr2_packed_rows"
# The implementations a packed scope may switch from: they compute the same attention (flash and flex
# are untested), and a forward given no plan inside the scope runs sdpa.
PACKABLE = ("sdpa", "eager")


@dataclass
class PackedRows:
    """A packed step's layout (independent_decoder.packed_block_step): input columns [every row's
    noisy window, row by row (batch x block) ; the writing rows' clean windows (len(writers) x
    block)]. cache: the decode's KV cache (in-place layers); rows, cols: (N,) each column's batch row
    and cache column; writers: (n,) the rows that write a clean window, or None; kv_len: key columns
    attention reads (every row's cache length plus its new columns, at most). The step's
    attention mask is (batch + n, 1, block, kv_len): the noisy windows' queries, then the clean ones'."""
    cache: object
    batch: int
    block: int
    rows: torch.Tensor
    cols: torch.Tensor
    writers: torch.Tensor | None
    kv_len: int


@dataclass
class PromptRow:
    """One row's prompt prefilled alone into a batch's cache (prompt_prefill.py): its n columns go
    to batch row `row`, cache columns kv_len - n .. kv_len (the left-padded layout), and attend
    causally to each other."""
    cache: object
    batch: int
    row: int
    n: int
    kv_len: int


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, packed_rows=None, **kwargs):
    if packed_rows is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    plan = packed_rows
    layer = plan.cache.layers[module.layer_idx]
    gqa = query.shape[1] != key.shape[1]  # grouped-query attention inside the kernel: a third faster on this
    # CPU than repeating the keys first, as Hugging Face's sdpa path does under a mask
    if isinstance(plan, PromptRow):  # one prompt, causal: the kernel's own causal path, no mask
        cols = torch.arange(plan.kv_len - plan.n, plan.kv_len, device=key.device)
        keys, values = layer.write_rows(torch.full_like(cols, plan.row), cols, key[0], value[0], plan.kv_len,
                                        plan.batch)
        k, v = keys[plan.row:plan.row + 1, :, -plan.n:], values[plan.row:plan.row + 1, :, -plan.n:]
        out = F.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2), None
    # query (1, heads, N, dim); key / value (1, kv_heads, N, dim): this layer's new columns, not yet cached
    keys, values = layer.write_rows(plan.rows, plan.cols, key[0], value[0], plan.kv_len, plan.batch)
    b, B = plan.batch, plan.block

    def rows_attend(q, keys, values, mask):  # q (heads, rows * B, dim) -> (rows * B, heads, dim)
        q = q.unflatten(1, (-1, B)).transpose(0, 1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling, enable_gqa=gqa)
        return out.transpose(1, 2).flatten(0, 1)

    out = rows_attend(query[0, :, :b * B], keys, values, attention_mask[:b])
    if plan.writers is not None:  # the clean windows: only their rows' keys, no padded queries
        w = plan.writers
        if len(w) < b:  # (a copy of those rows' keys; at batch 1 every step that writes is all rows)
            keys, values = keys[w], values[w]
        out = torch.cat([out, rows_attend(query[0, :, b * B:], keys, values, attention_mask[b:])])
    return out[None], None


AttentionInterface.register(PACKED_ROWS_ATTENTION, _attention)


def takes_packed_rows(model) -> bool:
    """Whether packed_rows_attention(model) can be entered (or is entered already, on another thread)."""
    return model.config._attn_implementation in PACKABLE + (PACKED_ROWS_ATTENTION,)


# Models inside packed_rows_attention, by id(config): [decodes inside, the implementation to set back]. The
# service's decode workers share one model, so two decodes may overlap; the last one out sets it back.
_INSIDE: dict = {}
_INSIDE_LOCK = threading.Lock()


@contextlib.contextmanager
def packed_rows_attention(model):
    """Inside the block, the model's attention layers take a `packed_rows` plan (above); without one
    they run sdpa (an eager model's prefill then runs sdpa: the same attention), so a decode of
    another kind that overlaps on another thread is unchanged. The model's own attention
    implementation is set back when the last overlapping decode leaves; no other model is affected."""
    config = model.config
    with _INSIDE_LOCK:
        entry = _INSIDE.get(id(config))
        if entry is None:
            previous = config._attn_implementation
            if previous not in PACKABLE:
                raise ValueError(f"packed rows need one of the attention implementations {PACKABLE}, the model "
                                 f"has {previous!r}")
            entry = _INSIDE[id(config)] = [0, previous]
            config._attn_implementation = PACKED_ROWS_ATTENTION
        entry[0] += 1
    try:
        yield
    finally:
        with _INSIDE_LOCK:
            entry[0] -= 1
            if entry[0] == 0:
                del _INSIDE[id(config)]
                config._attn_implementation = entry[1]

"""The prompt prefill every decoder (AR, lookup, diffusion) starts with: the prompts' columns into
an empty KV cache, causally, pad keys masked, in the cheapest exact way this stack offers.

No mask is built where it can be avoided. A batch without padding (batch 1) runs causal attention
with no mask, which sdpa runs as is_causal, skipping the keys after each query instead of reading a
mask that blocks them: a Beauty prefill 7% faster, the same logits and keys. A padded batch runs
that way one row at a time, each prompt's own tokens only (a packed_rows.PromptRow plan writes its
keys into its row of the batch's cache, in the left-padded layout, pad columns zero, which every
decoder masks): Beauty batches of 8 prefill 9% faster than through one padded, masked forward
(interleaved, 64 prompts). Packing the 8 prompts into one forward of ~4,000 columns was slower on
this CPU: its activations outgrow the caches, and in a profile of the same batches its elementwise
ops took twice as long as row by row.

Both run inside packed_rows_attention: with the model's implementation named there, Hugging Face
builds no mask, and the attention function runs sdpa causally. An eager model then computes the
same attention, and a decode on another thread that leaves its own packed scope cannot switch the
model back to eager in the middle of this forward, which would leave it with no causal mask.
"""
import torch

from .forward import forward
from .kv_cache import InPlaceLayer
from .masks import block_causal_mask, position_ids_for
from .packed_rows import PromptRow, packed_rows_attention, takes_packed_rows


def prompt_prefill(model, ids, plen, n_cols, cache):
    """Run the first n_cols columns of left-padded prompts (ids (b, P), lengths plen) into the empty
    `cache`, causally, pad keys masked; returns the logits of each row's last column, (b, V). A batch
    with a row that has no column to prefill (a one-token prompt of a diffusion decode), a model
    whose attention implementation packed rows do not take, or a cache of other layers runs the
    padded forward under the block-causal mask instead."""
    if cache.get_seq_length() != 0:
        raise ValueError(f"prompt_prefill fills an empty cache; this one holds {cache.get_seq_length()} columns")
    P = ids.shape[1]
    pads = (P - plen).tolist()  # each row's pad columns (one host read, here rather than per test below)
    if (takes_packed_rows(model) and max(pads) < n_cols
            and all(isinstance(layer, InPlaceLayer) for layer in cache.layers)):  # (rows are written into those)
        with packed_rows_attention(model):
            if not any(pads):
                return forward(model, ids[:, :n_cols], position_ids_for(plen, P, n_cols), None, cache,
                               logits_to_keep=1)[:, -1]
            return torch.cat([_prefill_row(model, ids, r, p, n_cols, cache) for r, p in enumerate(pads)])
    one_token_blocks = torch.arange(n_cols, device=ids.device)  # causal = blocks of one token
    group = torch.zeros_like(one_token_blocks)
    valid = one_token_blocks[None] >= (P - plen)[:, None]
    mask = block_causal_mask(one_token_blocks, group, one_token_blocks, group, valid)
    return forward(model, ids[:, :n_cols], position_ids_for(plen, P, n_cols), mask, cache, logits_to_keep=1)[:, -1]


def _prefill_row(model, ids, row, pad, n_cols, cache):
    """Row `row`'s prompt columns (those after its `pad` pad columns) alone: (1, V) logits of its last."""
    n = n_cols - pad
    plan = PromptRow(cache, ids.shape[0], row, n, n_cols)
    return forward(model, ids[row:row + 1, pad:n_cols], torch.arange(n, device=ids.device)[None], None,
                   logits_to_keep=1, packed_rows=plan)[:, -1]

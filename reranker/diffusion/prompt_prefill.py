"""The prompt prefill every decoder (AR, lookup, diffusion) starts with: the prompts' columns into
the KV cache, causally, pad keys masked, in the cheapest exact way this stack offers."""
import torch

from .forward import forward
from .kv_cache import InPlaceLayer
from .masks import block_causal_mask, position_ids_for
from .packed_rows import PACKABLE, PACKED_ROWS_ATTENTION, row_by_row_prefill


def prompt_prefill(model, ids, plen, n_cols, cache):
    """Run the first n_cols columns of left-padded prompts (ids (b, P), lengths plen) into `cache`,
    causally, pad keys masked; returns the logits of each row's last column, (b, V). Every decoder's
    prefill (AR, lookup, diffusion) is this call. No mask is built where it can be avoided: a batch
    without padding (batch 1) runs the model's own causal path, the attention kernel skipping the keys
    after each query (a Beauty prefill 7% faster, the same logits and keys); a padded batch runs that
    way row by row (packed_rows.row_by_row_prefill: no padding columns; 9% faster at batch 8). A row
    with no column to prefill (a one-token prompt of a diffusion decode), an attention implementation
    packed rows do not take, or a cache of other layers keeps the padded forward under the
    block-causal mask."""
    b, P = ids.shape
    pad = P - plen
    if not bool(pad.any()):
        return forward(model, ids[:, :n_cols], position_ids_for(plen, P, n_cols), None, cache, logits_to_keep=1)[:, -1]
    if (bool((pad < n_cols).all()) and model.config._attn_implementation in PACKABLE + (PACKED_ROWS_ATTENTION,)
            and all(isinstance(layer, InPlaceLayer) for layer in cache.layers)):  # (it writes rows of those)
        return row_by_row_prefill(model, ids, plen, n_cols, cache)
    one_token_blocks = torch.arange(n_cols, device=ids.device)  # causal = blocks of one token
    group = torch.zeros_like(one_token_blocks)
    valid = one_token_blocks[None] >= pad[:, None]
    mask = block_causal_mask(one_token_blocks, group, one_token_blocks, group, valid)
    return forward(model, ids[:, :n_cols], position_ids_for(plen, P, n_cols), mask, cache, logits_to_keep=1)[:, -1]

"""Packed steps (packed_rows.py): the attention implementation is switched for one decode only, a
forward given no plan inside that scope is plain sdpa, and an eager model decodes as an sdpa one."""
import pytest
import torch

from reranker.diffusion.forward import forward, new_cache
from reranker.diffusion.independent_decoder import diffusion_decode_independent
from reranker.diffusion.masks import block_causal_mask
from reranker.diffusion.packed_rows import PACKED_ROWS_ATTENTION, packed_rows_attention
from tiny_decoder import MASK, frequent_token, model_for, prompts_for

torch.set_num_threads(1)


def test_the_attention_implementation_is_switched_for_the_block_only():
    model = model_for("sdpa")
    with pytest.raises(KeyError):
        with packed_rows_attention(model):
            assert model.config._attn_implementation == PACKED_ROWS_ATTENTION
            assert model.model.layers[0].self_attn.config._attn_implementation == PACKED_ROWS_ATTENTION
            raise KeyError("a decode that fails")
    assert model.config._attn_implementation == "sdpa"  # set back, also after an error


def test_other_attention_implementations_are_refused_by_name():
    model = model_for("sdpa")
    model.config._attn_implementation = "flex_attention"
    with pytest.raises(ValueError, match="'flex_attention'"):
        with packed_rows_attention(model):
            pass
    assert model.config._attn_implementation == "flex_attention"


def test_a_forward_without_a_plan_is_plain_sdpa():
    model = model_for("sdpa")
    ids = torch.tensor(prompts_for(1, lens=(7,)))
    pos = torch.arange(7)[None]
    blk = torch.arange(7)
    mask = block_causal_mask(blk, torch.zeros_like(blk), blk, torch.zeros_like(blk))
    with torch.no_grad():
        want = forward(model, ids, pos, mask, new_cache(model))
        with packed_rows_attention(model):
            got = forward(model, ids, pos, mask, new_cache(model))
    assert torch.equal(got, want)


def test_an_eager_model_decodes_independent_rows_as_an_sdpa_one():
    sdpa, eager = model_for("sdpa"), model_for("eager")
    prompts = prompts_for(4, lens=(5, 9, 1, 7, 3, 11))
    eos = frequent_token(sdpa, prompts)
    kw = dict(tau=0.3, commit_rule="prefix", hold_eos=True)
    a = diffusion_decode_independent(sdpa, prompts, 19, 4, MASK, eos, **kw)
    b = diffusion_decode_independent(eager, prompts, 19, 4, MASK, eos, **kw)
    assert a.tokens == b.tokens and a.steps_per_block == b.steps_per_block
    assert eager.config._attn_implementation == "eager"


def test_overlapping_decodes_set_the_implementation_back_when_the_last_one_leaves():
    """The service's decode workers share a model: a decode that ends while another is still inside
    must not set the implementation back under it."""
    model = model_for("sdpa")
    first, second = packed_rows_attention(model), packed_rows_attention(model)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert model.config._attn_implementation == PACKED_ROWS_ATTENTION
    second.__exit__(None, None, None)
    assert model.config._attn_implementation == "sdpa"

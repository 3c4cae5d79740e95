"""Attention-mask layout: the rule written out by hand, padding, and B = 1 == causal."""
import pytest
import torch

from reranker.diffusion.forward import forward
from reranker.diffusion.masks import (block_causal_mask, diffusion_training_mask, left_pad, pack_prompt_response,
                            position_ids_for)
from reranker.model import SIZES, build_model

torch.set_num_threads(1)


def rule(P, L, B, C):
    """The attention rule, position by position, for one unpadded row: [clean ; C noisy copies]."""
    n = -(-L // B)
    n_clean = P - 1 + n * B
    cols = [("clean", c) for c in range(n_clean)] + [(cp, P - 1 + i) for cp in range(C) for i in range(n * B)]

    def win(c):  # window index of a clean/noisy column, None for the prefix
        return None if c < P - 1 else (c - (P - 1)) // B

    def valid(c):  # prefix, or a window column whose target exists
        return c < P - 1 or c - (P - 1) < L

    T = len(cols)
    allowed = torch.zeros(T, T, dtype=torch.bool)
    for i, (ki, ci) in enumerate(cols):
        for j, (kj, cj) in enumerate(cols):
            if i == j:
                allowed[i, j] = True
            elif not valid(cj):
                continue
            elif ki == "clean" and kj == "clean":
                allowed[i, j] = cj <= ci if win(ci) is None else (win(cj) is None or win(cj) <= win(ci))
            elif ki != "clean" and kj == "clean":
                allowed[i, j] = win(cj) is None or win(cj) < win(ci)
            elif ki != "clean" and kj == ki:
                allowed[i, j] = win(cj) == win(ci)
    return allowed


@pytest.mark.parametrize("P,L,B,C", [(4, 8, 4, 1), (3, 7, 2, 2), (1, 5, 4, 1), (5, 3, 1, 1)])
def test_training_mask_matches_rule(P, L, B, C):
    mask, pos = diffusion_training_mask(torch.tensor([P]), torch.tensor([L]), B, C)
    assert mask.dtype == torch.float32 and mask.shape[:2] == (1, 1)
    assert torch.equal(mask[0, 0] == 0, rule(P, L, B, C))
    n = -(-L // B)
    clean_pos = torch.arange(P - 1 + n * B)
    assert torch.equal(pos[0], torch.cat([clean_pos] + [clean_pos[P - 1:]] * C))


def test_block_size_one_is_causal():
    mask, _ = diffusion_training_mask(torch.tensor([5]), torch.tensor([6]), 1, 0)
    assert torch.equal(mask[0, 0] == 0, torch.ones(10, 10, dtype=torch.bool).tril())


def test_padding_rows_and_keys():
    plen, rlen = torch.tensor([2, 5]), torch.tensor([6, 3])
    mask, pos = diffusion_training_mask(plen, rlen, 4, 1)
    allowed = mask[:, 0] == 0
    assert allowed.any(-1).all()  # no fully blocked query row (NaN guard)
    # row 0: prompt left-padded by 3, so columns 0..2 are pad keys seen only by themselves
    off_diag = allowed[0] & ~torch.eye(allowed.shape[-1], dtype=torch.bool)
    assert not off_diag[:, :3].any()
    assert pos[0, 3].item() == 0 and pos[1, 0].item() == 0 and pos[0, 4].item() == 1
    # row 1: targets 3.. of its response are padding -> those window columns are dead keys
    assert not (allowed[1] & ~torch.eye(allowed.shape[-1], dtype=torch.bool))[:, 4 + 3:4 + 8].any()


def test_cached_query_mask_is_tail_of_full_mask():
    blk = torch.tensor([0, 1, 2, 2, 3, 3, 3])
    grp = torch.tensor([0, 0, 0, 0, 0, 0, 1])
    full = block_causal_mask(blk, grp, blk, grp)
    tail = block_causal_mask(blk[-3:], grp[-3:], blk, grp)
    assert torch.equal(full[:, :, -3:], tail)


def test_pack_and_left_pad():
    ids, plen, rlen = pack_prompt_response([[5, 6], [7, 8, 9]], [[1], [2, 3, 4]], pad_id=0, block_size=4, fill_id=9)
    assert ids.tolist() == [[0, 5, 6, 1, 9, 9, 9], [7, 8, 9, 2, 3, 4, 9]]
    assert plen.tolist() == [2, 3] and rlen.tolist() == [4, 4]
    z, lens = left_pad([[1, 2], []], 0, width=3)
    assert z.tolist() == [[0, 1, 2], [0, 0, 0]] and lens.tolist() == [2, 0]
    assert position_ids_for(torch.tensor([2]), 3, 5).tolist() == [[0, 0, 1, 2, 3]]


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_padding_invariance_under_both_backends(attn):
    """A left-padded row gives the same logits as the row alone, and no NaNs anywhere."""
    model = build_model(30, SIZES["tiny"], attn_implementation=attn).eval()
    prompts, resps = [[3, 4, 5, 6, 7], [8, 9]], [[10, 11, 12], [13, 14, 15, 16, 17]]
    ids, plen, rlen = pack_prompt_response(prompts, resps, pad_id=0)
    B = 2
    mask, pos = diffusion_training_mask(plen, rlen, B, 1)
    n_clean = 5 - 1 + 6
    x = torch.cat([ids[:, :n_clean], ids[:, 4:4 + 6]], 1)  # noisy copy = clean windows (no masking)
    with torch.no_grad():
        logits = forward(model, x, pos, mask)
        m1, p1 = diffusion_training_mask(plen[1:], rlen[1:], B, 1)
        ids1 = torch.tensor([prompts[1] + resps[1]])
        alone = forward(model, torch.cat([ids1, ids1[:, 1:]], 1), p1, m1)  # 1 prefix + 6 window cols
    assert torch.isfinite(logits).all()
    # row 1 padded by 3 columns: its real columns are 3.. (clean) and the whole noisy copy
    torch.testing.assert_close(logits[1, 3:n_clean], alone[0, :7], atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[1, n_clean:], alone[0, 7:], atol=1e-5, rtol=0)

"""A tiny random Qwen3, prompts and an EOS choice for the decoding tests (test_decoding, test_replay,
test_lookup_decoding, test_kv_cache): the same vocabulary, special tokens and seeds, so every file
tests the decoders on the same model."""
import torch

from reranker.diffusion import ar_decode
from reranker.model import SIZES, build_model

V, PAD, EOS, MASK = 40, 0, 1, 39


def model_for(attn):
    # a larger init makes the random model's distributions peaked: no near-ties in greedy tests
    return build_model(V, dict(SIZES["tiny"], initializer_range=0.3), pad_token_id=PAD, eos_token_id=EOS,
                       attn_implementation=attn).eval()


def frequent_token(model, prompts, n=12):
    """A token the random model emits often (over n greedy tokens a row): used as EOS, it stops some
    rows early, so the decoders' dropping of finished rows is exercised."""
    out = ar_decode(model, prompts, n, eos_token_id=-1).tokens
    return torch.tensor(sum((t[2:] for t in out), [])).mode().values.item()


def prompts_for(seed=0, lens=(5, 9, 1, 7)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, MASK, (n,), generator=g).tolist() for n in lens]

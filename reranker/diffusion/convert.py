"""AR -> block-diffusion conversion: same weights, one added mask token, a few config fields.

Nothing in the network changes: block diffusion is a different attention MASK and input layout
(masks.py) over the same causal-LM weights, and the AR token shift is kept (the logit at column t
predicts token t+1), so with block size 1 the converted model decodes exactly like the AR one.
The fields live in config.json under "diffusion" (a plain custom config attribute, which
save_pretrained / from_pretrained round-trip), so any HF checkpoint directory works. The converted
model also records the decode settings it is meant for (config.json "decode_settings", see
reranker.decoding): decoder "diffusion" plus any given, kept by every later stage's save.
"""

from reranker.decoding import record
from reranker.model import load_model, resize_for_tokenizer, save_model
from reranker.text.tokenizer import load_tokenizer


def convert_to_diffusion(ar_dir, out_dir, block_size=32, mask_token="<|mask|>", decode=None):
    """Load the AR model + tokenizer from ar_dir, add `mask_token` if absent (growing the embedding
    matrix only if needed), record the diffusion fields and the decode settings (`decode`: tau,
    commit_rule, ...; None values left out) and save to out_dir (safetensors)."""
    model = load_model(ar_dir)  # first: it names a missing or damaged model dir
    tok = load_tokenizer(ar_dir)
    if mask_token not in tok.get_vocab():
        if tok.mask_token is None:
            tok.add_special_tokens({"mask_token": mask_token})
        else:  # the tokenizer has another mask token (e.g. BERT-style): leave its role alone
            tok.add_tokens([mask_token], special_tokens=True)
    mask_id = tok.convert_tokens_to_ids(mask_token)
    resize_for_tokenizer(model, tok)
    model.config.diffusion = {"block_size": int(block_size), "mask_token_id": int(mask_id),
                              "mask_token": mask_token, "ar_token_shift": True}
    record(model.config, {**(decode or {}), "decoder": "diffusion"})
    save_model(model, tok, out_dir)
    return model, tok


def load_diffusion_config(model_or_config):
    """The diffusion fields ({block_size, mask_token_id, mask_token, ar_token_shift}) or None for a
    plain AR checkpoint."""
    config = getattr(model_or_config, "config", model_or_config)
    info = getattr(config, "diffusion", None)
    return dict(info) if info else None

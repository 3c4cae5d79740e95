"""Mixed precision for the training stages: fp32 weights, gradients and optimizer state, with the
matmuls of the forward (and so of the backward) in bfloat16 under torch.autocast.

On CPUs with AVX512-BF16 (the development machine) a training step of the "cpu" model runs about
2x faster this way; the loss and the softmax stay float32 (the stages cast logits up before any
log-softmax). Validation and decoding are untouched: they run in the model's own dtype, so model
selection and every reported number mean the same thing with or without it.
"""
from __future__ import annotations

import contextlib

import torch

AUTOCAST_DTYPES = {"none": None, "bf16": torch.bfloat16}


def check_autocast(value) -> None:
    if value not in AUTOCAST_DTYPES:
        raise ValueError(f"autocast must be one of {sorted(AUTOCAST_DTYPES)}, got {value!r}")


def autocast(value, device) -> contextlib.AbstractContextManager:
    """The context a training forward runs under: torch.autocast for "bf16", nothing for "none"."""
    check_autocast(value)
    dtype = AUTOCAST_DTYPES[value]
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


def training_step_cost(model, batch_size=8, length=640, iters=5, warmup=1, seed=0, settings=("none", "bf16")) -> dict:
    """Wall time of one optimizer step (forward, backward, AdamW) of `model` on random tokens, per
    autocast setting, interleaved per iteration so both see the same machine noise. The model's
    weights are restored after each step, so every iteration times the same computation.
    Returns {"batch_size", "length", "iters", "rows": [{"autocast", "seconds": stats}], "speedup"}
    with speedup = median "none" / median of the last setting."""
    import copy
    import time

    from ..speed import stats

    vocab = model.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size, length), generator=g).to(model.device)
    state = copy.deepcopy(model.state_dict())
    model.train()
    times = {s: [] for s in settings}
    for it in range(warmup + iters):
        for s in settings:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            t0 = time.perf_counter()
            with autocast(s, model.device):
                logits = model(input_ids=ids, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, vocab), ids[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            dt = time.perf_counter() - t0
            model.load_state_dict(state)
            if it >= warmup:
                times[s].append(dt)
    rows = [{"autocast": s, "seconds": stats(times[s])} for s in settings]
    med = {r["autocast"]: r["seconds"]["median"] for r in rows}
    return {"batch_size": batch_size, "length": length, "iters": iters, "rows": rows,
            "speedup": med[settings[0]] / med[settings[-1]]}

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


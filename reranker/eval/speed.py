"""Decode-speed harness: block diffusion vs AR (and exact AR accelerations), side by side in ONE process.

What it measures (``measure_speed``), all greedy (temperature 0), same threads, same prompts:

* **Main table**, per batch size b and per tau: decode tokens/s, forward passes per generated
  token, mean tokens committed per block step (diffusion), and the speed-up diffusion / AR.
  ``columns_per_token`` (diffusion): the column-rows the model ran (noisy windows and clean
  writes, over every row and step) per generated token; the work a token costs in positions run.
  A *run* decodes every prompt once, in chunks of b (the last chunk may be smaller); its tokens/s
  is (generated tokens) / (wall seconds of the decoder calls). Generated tokens are counted the
  same way for both decoders: each row's tokens up to and including EOS (what ``ARResult.tokens``
  and ``DiffusionResult.tokens`` hold). Prompt tokenization is not timed; prefill is.
  Beside it, the **decode phase** alone (``decode_tokens_per_second``, ``decode_speedup``): the
  same runs with the prompt prefill's wall time (the decoders time it) taken out, and the tokens
  the prefill itself yields (AR: its first token per row; diffusion: none) not counted. The prefill
  is the same call for both decoders (prompt_prefill.py), so it dilutes the end-to-end ratio towards 1 by the share
  of time it takes; the decode-phase ratio is the one the decoders themselves differ in, the
  end-to-end one is what a caller waits for. Both are reported.
  Each *repeat* runs AR, every exact decoder and every tau once, back to back (order reversed on
  odd repeats), so the runs of one repeat see the same machine noise. ``warmup`` repeats run first and are discarded.
  Reported per quantity: median, min, max, quartiles, and the raw values. Two speed-ups:
  ``speedup`` = median diffusion tok/s / median AR tok/s (ratio of medians) and
  ``speedup_paired`` = statistics of the per-repeat ratios (the one that cancels slow drifts).
* **Exact decoders** (``exact_decoders``, each row under ``exact_decoders`` with ``decoder``):
  ``hf_generate``, Hugging Face ``generate`` (greedy, its KV cache, the same left-padded batches
  with an attention mask, the same EOS and budget): the baseline a user already has, so the AR
  decoder the ratios are taken against is shown to be no slower; and ``ar_lookup``, greedy AR with
  exact prompt-lookup drafts (reranker.diffusion.lookup_decoder). Both run on the AR model; each
  has the same fields as a diffusion point (``speedup``, ``speedup_paired``, ``tokens_per_forward``)
  and ``matches_ar``: whether it wrote the AR decoder's greedy tokens on every measured prompt,
  which both must. ``generate`` does not time its prefill apart: its decode-phase figures are None.
  Every point carries ``decoder``: ``ar``, ``hf_generate``, ``ar_lookup`` or ``diffusion``.
* **Output-length curve**: the same, with EOS disabled (``eos_token_id=-1``, which no decoder can
  emit; every decoder accepts it and the harness checks every row got exactly L tokens) and
  ``max_new_tokens = L``. Tokens past the model's natural end are out of distribution for its
  confidence (the model would have stopped), so this curve measures the decoding MECHANICS
  (cost per step vs tokens per step as the cache grows), not the speed at the model's real length.
* **Forward-pass cost** (``forward_cost``): one forward of a one-token step vs a block step of
  8 / 16 / 32 tokens against a KV cache holding `context` columns, at batch 1 and 8 (DESIGN §5:
  speed-up ~= tokens committed per step / cost ratio). Variants are interleaved per iteration.
* **Training-step cost** (``training_step_cost``, `dgr2 train-cost`): one optimizer step with and
  without bf16 autocast, interleaved per iteration.
* Optional accuracy per point: ``reranker.eval.evaluate.evaluate`` with the AR engine and, per tau,
  the diffusion engine on given examples (Recall@1/@3, NDCG@3, valid rate, and the paired
  bootstrap CI of Recall@1 and NDCG@3 against AR).

Forward passes per generated token: ``forward_passes_per_token`` = forward passes / (generated
tokens / rows), i.e. per token of an average row (a batched forward counts once for the whole
batch; the batch waits for its longest row, so uneven lengths push it above the per-row value).
AR's prefill forward yields its first token, so AR with EOS disabled gives exactly L / L = 1;
the diffusion decoder's prefill covers the prompt but the last column and yields no token, so its
value includes one extra pass per chunk (B = 1, tau = 1: (L + 1) / L). The prefill counts as one
pass though a padded batch runs it row by row (prompt_prefill.py), as a batched forward would.
``forward_passes_per_token_batched`` = forward passes / all generated tokens (``evaluate``'s
definition; ~1 / b for AR at batch b).

The machine is shared and noisy: the report carries the load average before and after, and the
spread of every number. Speed claims are ratios of runs made in the same process only.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import json
import math
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from reranker.decoding import DEFAULT_COMMIT_RULE, DEFAULT_COMPUTE_DTYPE, DEFAULT_MAX_NEW_TOKENS, check_compute_dtype
from reranker.diffusion.ar_decoder import ar_decode
from reranker.diffusion.convert import load_diffusion_config
from reranker.diffusion.diffusion_decoder import diffusion_decode, prefill
from reranker.diffusion.forward import compute_precision, crop, forward
from reranker.diffusion.independent_decoder import diffusion_decode_independent
from reranker.diffusion.lookup_decoder import ar_lookup_decode
from reranker.diffusion.masks import block_causal_mask, left_pad
from reranker.training.precision import autocast

DEFAULT_TAUS = (1.0, 0.9, 0.8, 0.6, 0.4)
DEFAULT_BATCH_SIZES = (1, 8)
DEFAULT_LENGTHS = (64, 128, 256)
DEFAULT_LENGTH_TAUS = (0.9, 1.0)
DEFAULT_FORWARD_BLOCKS = (8, 16, 32)
NO_EOS = -1  # a token id no decoder can produce: decoding runs to max_new_tokens
# Decoders whose output must equal the AR decoder's greedy tokens, timed beside it: what a user who
# wants a faster exact AR re-ranker already has (Hugging Face generate) and prompt-lookup drafting.
EXACT_DECODERS = ("hf_generate", "ar_lookup")
# how a batch's rows move through the diffusion blocks: together (diffusion_decoder.py), or each on
# its own (independent_decoder.py: no row waits for the slowest; the same tokens)
SCHEDULES = ("lockstep", "independent")


# --------------------------------------------------------------------------------------------- stats

def stats(values) -> dict:
    """Median, min, max, quartiles (linear interpolation), n and the raw values."""
    a = np.asarray(list(values), dtype=np.float64)
    if a.size == 0:
        return {"median": None, "min": None, "max": None, "q1": None, "q3": None, "n": 0, "values": []}
    q1, med, q3 = np.percentile(a, [25, 50, 75])
    return {"median": float(med), "min": float(a.min()), "max": float(a.max()), "q1": float(q1),
            "q3": float(q3), "n": int(a.size), "values": [float(x) for x in a]}


def machine_info() -> dict:
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    import transformers

    return {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch_interop_threads": torch.get_num_interop_threads(), "torch_version": torch.__version__,
            "transformers_version": transformers.__version__, "python": platform.python_version(),
            "platform": platform.platform(terse=True), "processor": platform.machine(),
            "load_average": [round(x, 2) for x in load] if load else None}


@contextlib.contextmanager
def measured_machine(threads=None):
    """Run a measurement with `threads` torch threads (restored after) and record the machine: yields
    machine_info() with load_average_start; on exit it also holds torch_threads (as measured) and
    load_average_end."""
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(int(threads))
    machine = machine_info()
    machine["load_average_start"] = machine.pop("load_average")
    try:
        yield machine
        machine["torch_threads"] = torch.get_num_threads()
    finally:
        torch.set_num_threads(old)
    machine["load_average_end"] = machine_info()["load_average"]


def _first_id(x):
    if isinstance(x, (list, tuple)):
        return int(x[0]) if x else None
    return None if x is None else int(x)


# --------------------------------------------------------------------------------------------- runs

@dataclasses.dataclass
class GenerateResult:
    tokens: list       # per row: generated ids, up to and including EOS
    n_forward: int     # generate's forward passes: one per position of its longest row
    prefill_seconds: float | None = None  # generate does not time its prefill apart


@torch.no_grad()
def hf_generate(model, prompts, max_new_tokens, eos_token_id, pad_token_id):
    """Greedy Hugging Face `generate` with its KV cache on the same left-padded batch (attention mask
    over the pads) as ar_decode, so its tokens must equal ar_decode's. The generation config is
    built from the model's own config, never fetched; eos_token_id NO_EOS disables EOS."""
    from transformers import GenerationConfig

    ids, plen = left_pad(prompts, pad_token_id)
    P = ids.shape[1]
    attention = (torch.arange(P)[None] >= (P - plen)[:, None]).long()
    config = GenerationConfig.from_model_config(model.config)
    # an empty EOS list stops nothing (None would fall back to the model's own EOS)
    config.update(do_sample=False, num_beams=1, use_cache=True, max_new_tokens=int(max_new_tokens),
                  eos_token_id=[] if eos_token_id == NO_EOS else int(eos_token_id), pad_token_id=int(pad_token_id))
    out = model.generate(input_ids=ids.to(model.device), attention_mask=attention.to(model.device),
                         generation_config=config)[:, P:].tolist()
    # a finished row is filled with pads to the batch's length: keep it through its first EOS
    tokens = [row[:row.index(eos_token_id) + 1] if eos_token_id in row else row for row in out]
    return GenerateResult(tokens, max(len(row) for row in out))


def _draft_variants(lookup_drafts) -> tuple:
    """The diffusion variants timed and scored at each tau: with lookup drafts asked for, the plain
    decoder as well, so the two are compared side by side."""
    return (False, True) if lookup_drafts else (False,)


def _run(kind, model, prompts, batch_size, max_new_tokens, eos, pad, tau=None, block_size=None,
         mask_token_id=None, max_steps_per_block=None, commit_rule=DEFAULT_COMMIT_RULE, hold_eos=False,
         schedule="lockstep", window=None, reuse_settled=False, lookup_drafts=False,
         compute_dtype=DEFAULT_COMPUTE_DTYPE):
    """Decode every prompt once in chunks of batch_size; returns timing and counts (and tokens).
    kind: "ar", "hf_generate", "ar_lookup" or "diffusion"; compute_dtype: the matmul precision
    (forward.compute_precision; entering it, and the weight casts it makes, are timed)."""
    seconds, n_forward, rows_per_tok, tokens, row_steps = 0.0, 0, 0.0, [], 0
    column_rows = 0
    prefill_seconds, drafted, accepted = 0.0, 0, 0
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i:i + batch_size]
        was_enabled = gc.isenabled()
        gc.disable()  # no collector pauses inside the timed decode (collected between calls instead)
        try:
            t0 = time.perf_counter()
            with compute_precision(model.device, compute_dtype):
                if kind == "ar":
                    res = ar_decode(model, chunk, max_new_tokens, eos, pad, temperature=0.0)
                elif kind == "hf_generate":
                    res = hf_generate(model, chunk, max_new_tokens, eos, pad)
                elif kind == "ar_lookup":
                    res = ar_lookup_decode(model, chunk, max_new_tokens, eos, pad)
                else:  # rows in lockstep through each block, or each row through its own (SCHEDULES)
                    approx = (dict(window=window, reuse_settled=reuse_settled, lookup_drafts=lookup_drafts)
                              if schedule == "lockstep" else {})
                    decode = diffusion_decode if schedule == "lockstep" else diffusion_decode_independent
                    res = decode(model, chunk, max_new_tokens, block_size, mask_token_id, eos, pad, tau=tau,
                                 temperature=0.0, max_steps_per_block=max_steps_per_block,
                                 commit_rule=commit_rule, hold_eos=hold_eos, **approx)
            seconds += time.perf_counter() - t0
        finally:
            if was_enabled:
                gc.enable()
        gc.collect(0)
        if res.prefill_seconds is None:
            prefill_seconds = None
        elif prefill_seconds is not None:
            prefill_seconds += res.prefill_seconds
        n_forward += res.n_forward
        if kind == "ar_lookup":
            drafted, accepted = drafted + res.drafted, accepted + res.accepted
        n_tok = sum(len(t) for t in res.tokens)
        rows_per_tok += n_tok / len(chunk)  # mean row length of this chunk
        tokens += [list(map(int, t)) for t in res.tokens]
        if kind == "diffusion":
            row_steps += sum(sum(s) for s in res.steps_per_block)
            column_rows += res.column_rows
    gen = sum(len(t) for t in tokens)
    # the AR decoders' prefill yields each row's first token; the diffusion prefill yields none
    decode_tokens = sum(max(len(t) - (kind != "diffusion"), 0) for t in tokens)
    out = {"seconds": seconds, "generated_tokens": gen, "forward_passes": n_forward,
           "tokens_per_second": gen / max(seconds, 1e-12),
           "prefill_seconds": prefill_seconds,
           "decode_tokens_per_second": (None if prefill_seconds is None
                                        else decode_tokens / max(seconds - prefill_seconds, 1e-12)),
           "forward_passes_per_token": n_forward / max(rows_per_tok, 1e-12),
           "forward_passes_per_token_batched": n_forward / max(gen, 1),
           "tokens_per_step": gen / row_steps if row_steps else None, "tokens": tokens,
           "columns_per_token": column_rows / gen if column_rows else None}  # diffusion (DiffusionResult)
    if kind == "ar_lookup":
        out.update(drafted_tokens=drafted, accepted_tokens=accepted)
    return out


def _interleaved(ar_model, diff_model, prompts, batch_size, taus, max_new_tokens, repeats, warmup, eos, pad,
                 block_size, mask_token_id, max_steps_per_block, exact_length=None, progress=None,
                 commit_rule=DEFAULT_COMMIT_RULE, hold_eos=False, exact_decoders=EXACT_DECODERS,
                 schedule="lockstep", window=None, reuse_settled=False, lookup_drafts=False,
                 compute_dtype=DEFAULT_COMPUTE_DTYPE):
    """AR, every exact decoder (on the AR model) and every tau, once per repeat, back to back;
    returns (ar summary, [exact decoder summaries], [tau summaries], AR summary at compute_dtype or
    None). With lookup_drafts each tau is timed twice, without and with the drafts (each point says
    which). Diffusion runs in compute_dtype; AR and the exact decoders in float32 (the reference, and
    exactness). When compute_dtype is not float32, AR is also timed in it, so the faster AR is known:
    its summary has its speed-up over float32 AR, and each point `speedup_vs_ar_compute_dtype`."""
    variants = _draft_variants(lookup_drafts)
    low = compute_dtype != "float32"
    configs = ([("ar", None, False, "float32")] + [(d, None, False, "float32") for d in exact_decoders]
               + ([("ar", None, False, compute_dtype)] if low else [])
               + [("diffusion", t, v, compute_dtype) for t in taus for v in variants])
    runs = {c: [] for c in configs}
    for r in range(warmup + repeats):
        order = configs if r % 2 == 0 else configs[::-1]
        for kind, tau, drafts, dtype in order:
            m = diff_model if kind == "diffusion" else ar_model
            res = _run(kind, m, prompts, batch_size, max_new_tokens, eos, pad, tau, block_size, mask_token_id,
                       max_steps_per_block, commit_rule, hold_eos, schedule, window, reuse_settled, drafts, dtype)
            if exact_length is not None and any(len(t) != exact_length for t in res["tokens"]):
                got = sorted({len(t) for t in res["tokens"]})
                raise RuntimeError(f"{kind} decoder did not generate exactly {exact_length} tokens per row with "
                                   f"EOS disabled (eos_token_id={eos}); lengths {got}")
            if r >= warmup:
                runs[(kind, tau, drafts, dtype)].append(res)
            if progress:
                progress(f"b={batch_size} L={max_new_tokens} repeat {r - warmup + 1 if r >= warmup else 'warm-up'} "
                         f"{kind}{'' if tau is None else f' tau={tau}'}{' lookup drafts' if drafts else ''}"
                         f"{'' if dtype == 'float32' else f' {dtype}'}: {res['tokens_per_second']:.1f} tok/s")

    def summary(rs, kind):
        first = rs[0]
        decode_tps = [x["decode_tokens_per_second"] for x in rs if x["decode_tokens_per_second"] is not None]
        prefill = [x["prefill_seconds"] for x in rs if x["prefill_seconds"] is not None]
        out = {"decoder": kind,
               "tokens_per_second": stats(x["tokens_per_second"] for x in rs),
               "seconds": stats(x["seconds"] for x in rs),
               "decode_tokens_per_second": stats(decode_tps),
               "prefill_seconds": stats(prefill),
               "generated_tokens": first["generated_tokens"],
               "mean_generated_tokens": first["generated_tokens"] / len(prompts),
               "forward_passes": first["forward_passes"],
               "forward_passes_per_token": first["forward_passes_per_token"],
               "forward_passes_per_token_batched": first["forward_passes_per_token_batched"],
               "tokens_per_forward": 1.0 / first["forward_passes_per_token"],
               # greedy decoding is deterministic: every repeat should emit the same tokens
               "deterministic": all(x["tokens"] == first["tokens"] for x in rs)}
        if kind == "diffusion":
            out["tokens_per_step"] = first["tokens_per_step"]
            out["columns_per_token"] = first["columns_per_token"]
        if kind == "ar_lookup":
            out.update(drafted_tokens=first["drafted_tokens"], accepted_tokens=first["accepted_tokens"],
                       draft_acceptance=first["accepted_tokens"] / max(first["drafted_tokens"], 1))
        return out

    ar_runs = runs[("ar", None, False, "float32")]
    ar = summary(ar_runs, "ar")
    ar_tokens = ar_runs[0]["tokens"]

    def against_ar(p, rs):
        p["speedup"] = p["tokens_per_second"]["median"] / ar["tokens_per_second"]["median"]
        p["speedup_paired"] = stats(d["tokens_per_second"] / a["tokens_per_second"] for d, a in zip(rs, ar_runs))
        if p["decode_tokens_per_second"]["median"] is None:  # hf_generate: no prefill timing
            p["decode_speedup"], p["decode_speedup_paired"] = None, stats([])
        else:
            p["decode_speedup"] = p["decode_tokens_per_second"]["median"] / ar["decode_tokens_per_second"]["median"]
            p["decode_speedup_paired"] = stats(d["decode_tokens_per_second"] / a["decode_tokens_per_second"]
                                               for d, a in zip(rs, ar_runs))
        p["same_tokens_as_ar"] = float(np.mean([d == a for d, a in zip(rs[0]["tokens"], ar_tokens)]))
        return p

    exact = []
    for name in exact_decoders:
        rs = runs[(name, None, False, "float32")]
        p = against_ar(summary(rs, name), rs)
        # an exact decoder must write the AR decoder's greedy tokens on every measured prompt
        p["matches_ar"] = p["same_tokens_as_ar"] == 1.0
        exact.append(p)
    ar_low = None
    if low:
        low_runs = runs[("ar", None, False, compute_dtype)]
        ar_low = against_ar({"compute_dtype": compute_dtype, **summary(low_runs, "ar")}, low_runs)
    points = []
    for tau in taus:
        for drafts in variants:
            rs = runs[("diffusion", tau, drafts, compute_dtype)]
            p = against_ar({"tau": tau, "lookup_drafts": drafts, "compute_dtype": compute_dtype,
                            **summary(rs, "diffusion")}, rs)
            if low:  # against AR in the same precision, per repeat (at batch 8 it is the faster AR)
                p["speedup_vs_ar_compute_dtype"] = stats(d["tokens_per_second"] / a["tokens_per_second"]
                                                         for d, a in zip(rs, low_runs))
            points.append(p)
    return ar, exact, points, ar_low


# ------------------------------------------------------------------------------------ forward cost

@torch.no_grad()
def forward_cost(model, context, batch_sizes=DEFAULT_BATCH_SIZES, block_sizes=DEFAULT_FORWARD_BLOCKS, iters=20,
                 warmup=3, seed=0, fused=False, compute_dtype=DEFAULT_COMPUTE_DTYPE) -> dict:
    """Wall time of ONE forward pass against a KV cache of `context` columns: a one-token step (AR)
    vs a block step of each block size (a diffusion denoising step: B noisy columns, bidirectional
    within the block). Masks are built outside the timed region; the step's KVs are cropped after
    it (untimed), so every iteration sees the same cache. Variants are interleaved per iteration.
    With fused=True each block also gets the fused step of 2B columns ([clean window of the previous
    block ; noisy window], what block_step runs when a block has just finished), as fused_ms and
    fused_ratio. compute_dtype: the block steps' matmul precision (the prefill's too); the one-token
    step stays float32, AR's reference precision, so a ratio is the cost against the AR step the
    speed ratios are taken against. Returns {"context", "iters", "warmup", "compute_dtype", "rows":
    [{"batch_size", "one_token_ms": stats, "blocks": [{"block_size", "ms": stats, "ratio"}]}]} with
    ratio = median block / median one-token."""
    model.eval()
    dev = model.device
    with compute_precision(dev, compute_dtype):  # one context: each weight is cast once (compute_precision)
        rows = _forward_cost_rows(model, context, batch_sizes, block_sizes, iters, warmup, seed, fused)
    return {"context": int(context), "iters": iters, "warmup": warmup, "compute_dtype": compute_dtype, "rows": rows}


def _forward_cost_rows(model, context, batch_sizes, block_sizes, iters, warmup, seed, fused) -> list:
    dev = model.device
    vocab = model.get_input_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(seed)
    full = torch.autocast(dev.type, enabled=False)  # the one-token step: float32 inside any autocast
    rows = []
    for b in batch_sizes:
        P = int(context) + 1  # prefill covers P - 1 = context columns
        ids = torch.randint(0, vocab, (b, P), generator=g).to(dev)
        plen = torch.full((b,), P, dtype=torch.long, device=dev)
        cache, cache_blk, cache_valid, _ = prefill(model, ids, plen)
        pre = P - 1
        variants = {}
        # one-token step: the token at column pre, causal over the cache (as ar_decode builds it)
        kv_blk = torch.cat([cache_blk, torch.tensor([pre], device=dev)])
        valid1 = torch.cat([cache_valid, torch.ones(b, 1, dtype=torch.bool, device=dev)], 1)
        zero1 = torch.zeros(1, dtype=torch.long, device=dev)
        variants[1] = (ids[:, -1:], torch.full((b, 1), pre, device=dev),
                       block_causal_mask(kv_blk[-1:], zero1, kv_blk, torch.zeros_like(kv_blk), valid1))
        for B in block_sizes:
            # a noisy window (as block_step builds it, without a pending clean write) and, if asked, the
            # fused step: the previous block's clean window written to the cache in the same forward
            for width, key in [(1, B)] + ([(2, ("fused", B))] if fused else []):
                n = width * B
                q_blk = torch.cat([torch.full((B,), pre + i, device=dev) for i in range(width)])
                q_grp = torch.cat([torch.full((B,), int(i == width - 1), device=dev) for i in range(width)])
                kvb = torch.cat([cache_blk, q_blk])
                kvg = torch.cat([torch.zeros_like(cache_blk), q_grp])
                kvv = torch.cat([cache_valid, torch.ones(b, n, dtype=torch.bool, device=dev)], 1)
                win = torch.randint(0, vocab, (b, n), generator=g).to(dev)
                pos = (pre + torch.arange(n, device=dev))[None].expand(b, n)
                variants[key] = (win, pos, block_causal_mask(q_blk, q_grp, kvb, kvg, kvv))
        times = {k: [] for k in variants}
        for it in range(warmup + iters):
            for k, (x, pos, mask) in variants.items():
                t0 = time.perf_counter()
                with full if k == 1 else contextlib.nullcontext():
                    forward(model, x, pos, mask, cache)
                dt = time.perf_counter() - t0
                crop(cache, x.shape[1])
                if it >= warmup:
                    times[k].append(dt * 1000.0)
        one = float(np.median(times[1]))
        blocks = []
        for B in block_sizes:
            row = {"block_size": B, "ms": stats(times[B]), "ratio": float(np.median(times[B]) / one)}
            if fused:
                row.update(fused_ms=stats(times[("fused", B)]),
                           fused_ratio=float(np.median(times[("fused", B)]) / one))
            blocks.append(row)
        rows.append({"batch_size": b, "one_token_ms": stats(times[1]), "blocks": blocks})
    return rows


def training_step_cost(model, batch_size=8, length=640, iters=5, warmup=1, seed=0, settings=("none", "bf16")) -> dict:
    """Wall time of one optimizer step (forward, backward, AdamW) of `model` on random tokens, per
    autocast setting, interleaved per iteration so both see the same machine noise. The model's
    weights are restored after each step, so every iteration times the same computation.
    Returns {"batch_size", "length", "iters", "rows": [{"autocast", "seconds": stats}], "speedup"}
    with speedup = median "none" / median of the last setting."""
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


def speedup_ceiling(fc: dict, length: int, steps_per_block=(1, 2)) -> dict:
    """The most an EXACT block-diffusion decoder can gain over AR, from a forward_cost report with
    fused timings, for answers of `length` tokens when every block takes s denoising steps: the first
    block s plain B-column steps, each later one the fused step that also writes the previous
    block's clean KVs (block_step with `pending`) plus s - 1 plain steps; the fewest forwards a
    decoder that caches exact clean blocks can run. s = 1 is a model sure of all B tokens at once;
    s = 2 is about what tau = 0.9 gives (15.4 tokens per step at B = 32 on Beauty). AR pays one
    one-token step per token. Prefill is the same for both and left out, as are per-step Python
    costs and batch rows waiting for each other, which only lower the real figure.

    Returns {"length", "rows": [{"batch_size", "blocks": [{"block_size", "steps_per_block",
    "ceiling"}]}], "concurrency": [{"max_batch", "steps_per_block", "ceiling", "ar_batch",
    "diffusion_batch", "block_size"}]}: per batch size, diffusion / AR tokens per second at that
    batch; per concurrency c (a micro-batcher that may batch up to c requests) and s, the best
    diffusion throughput at any batch <= c and block size over the best AR throughput at any batch <= c."""
    out_rows, ar_tps, diff_tps = [], {}, {}
    for row in fc["rows"]:
        b, one = row["batch_size"], row["one_token_ms"]["median"]
        ar_tps[b] = b / one  # tokens per ms
        blocks = []
        for blk in row["blocks"]:
            if "fused_ms" not in blk:
                raise ValueError("speedup_ceiling needs forward_cost(..., fused=True) timings")
            B, n = blk["block_size"], math.ceil(length / blk["block_size"])
            plain, fused = blk["ms"]["median"], blk["fused_ms"]["median"]
            for st in steps_per_block:
                ms = st * plain + (n - 1) * (fused + (st - 1) * plain)
                diff_tps[(b, B, st)] = b * length / ms
                blocks.append({"block_size": B, "steps_per_block": st, "ceiling": diff_tps[(b, B, st)] / ar_tps[b]})
        out_rows.append({"batch_size": b, "blocks": blocks})
    conc = []
    for st in steps_per_block:
        for c in sorted(ar_tps):
            ar_b = max((b for b in ar_tps if b <= c), key=lambda b: ar_tps[b])
            db, dB, _ = max((k for k in diff_tps if k[0] <= c and k[2] == st), key=lambda k: diff_tps[k])
            conc.append({"max_batch": c, "steps_per_block": st, "ceiling": diff_tps[(db, dB, st)] / ar_tps[ar_b],
                         "ar_batch": ar_b, "diffusion_batch": db, "block_size": dB})
    return {"length": int(length), "steps_per_block": list(steps_per_block), "rows": out_rows, "concurrency": conc}


# ------------------------------------------------------------------------------------------ accuracy

def accuracy_points(engine_ar, engine_diff, examples, taus, block_size=None, max_new_tokens=DEFAULT_MAX_NEW_TOKENS,
                    batch_size=8, progress=False, commit_rule=DEFAULT_COMMIT_RULE, hold_eos=False,
                    lookup=False, window=None, reuse_settled=False, lookup_drafts=False,
                    compute_dtype=DEFAULT_COMPUTE_DTYPE, timed=0) -> dict:
    """Recall@1/@3, NDCG@3, valid rate of AR and of diffusion at each tau (reranker.eval.evaluate on
    `examples`), with the paired bootstrap CI of each diffusion point against AR. lookup: also the
    AR model with decoder ar_lookup ("ar_lookup"), with the share of examples whose target it ranks
    where AR does (1.0 for an exact decoder). timed: the first `timed` examples are the prompts the
    speed runs decoded; every entry then has `timed_valid_rate`, its valid rate on those alone (a
    wrong answer is a slow one for diffusion, so a timed sample richer in them than the whole
    understates its speed)."""
    from reranker.engine import DecodeOptions
    from .evaluate import evaluate
    from .metrics import compare

    keys = ("recall@1", "recall@3", "ndcg@3", "ndcg@5", "valid_rate", "fallback_rate", "tokens_per_second",
            "mean_generated_tokens", "forward_passes_per_token")

    k = min(int(timed), len(examples))

    def pick(rep):
        out = {key: rep.get(key) for key in keys}
        if k:
            out["timed_valid_rate"] = float(np.mean([o["valid"] for o in rep["outputs"][:k]]))
        return out

    def run(engine, opts):
        return evaluate(engine, examples, opts, batch_size, progress=progress, keep_outputs=bool(k))

    ar_rep = run(engine_ar, DecodeOptions(decoder="ar", max_new_tokens=max_new_tokens))
    ar_ranks = np.asarray(ar_rep["ranks"])
    out = {"n": len(examples), "timed_prompts": k, "batch_size": batch_size, "max_new_tokens": max_new_tokens,
           "ar": {**pick(ar_rep), "vs_retriever": ar_rep["vs_retriever"]}, "diffusion": []}
    if lookup:
        rep = run(engine_ar, DecodeOptions(decoder="ar_lookup", max_new_tokens=max_new_tokens))
        out["ar_lookup"] = {**pick(rep), "same_target_rank_as_ar": float(np.mean(np.asarray(rep["ranks"]) == ar_ranks))}
    for tau in taus:
        for drafts in _draft_variants(lookup_drafts):
            opts = DecodeOptions(decoder="diffusion", tau=tau, block_size=block_size, max_new_tokens=max_new_tokens,
                                 commit_rule=commit_rule, hold_eos=hold_eos, window=window,
                                 reuse_settled=reuse_settled, lookup_drafts=drafts, compute_dtype=compute_dtype)
            rep = run(engine_diff, opts)
            cmp = compare(ar_ranks, np.asarray(rep["ranks"]))
            out["diffusion"].append({"tau": tau, "lookup_drafts": drafts, "compute_dtype": compute_dtype, **pick(rep),
                                     "vs_ar": {k: cmp[k] for k in ("recall@1", "ndcg@3")},
                                     "vs_retriever": rep["vs_retriever"]})
    return out


# -------------------------------------------------------------------------------------------- harness

def measure_speed(ar_model, diff_model, prompts, batch_sizes=DEFAULT_BATCH_SIZES, taus=DEFAULT_TAUS,
                  block_size=None, max_new_tokens=DEFAULT_MAX_NEW_TOKENS, repeats=5, warmup=1, threads=None,
                  eos_token_id=None, pad_token_id=None, mask_token_id=None, max_steps_per_block=None,
                  lengths=DEFAULT_LENGTHS, length_taus=DEFAULT_LENGTH_TAUS, length_batch_sizes=None, forward_blocks=DEFAULT_FORWARD_BLOCKS,
                  forward_iters=20, context=None, accuracy=None, accuracy_batch_size=8, progress=None,
                  commit_rule=DEFAULT_COMMIT_RULE, hold_eos=False, exact_decoders=(), schedule="lockstep",
                  window=None, reuse_settled=False, lookup_drafts=False,
                  compute_dtype=DEFAULT_COMPUTE_DTYPE, accuracy_timed=0) -> dict:
    """Side-by-side decode speed of AR (`ar_model`) and block diffusion (`diff_model`) on `prompts`
    (token-id lists). See the module docstring for what each number means.

    block_size: None = the one recorded in diff_model's config. eos/pad/mask ids: None = from the
    models' configs. threads: torch.set_num_threads(threads) for the whole measurement (restored
    after); reported either way. lengths=() skips the output-length curve, forward_blocks=() the
    forward-cost microbenchmark. accuracy: optional (engine_ar, engine_diff, examples) adding
    Recall@1 and valid rate per point. progress: optional callable(str) for one line per run.
    exact_decoders: the decoders (of EXACT_DECODERS) timed on ar_model beside AR, each with its
    speed-up over AR and whether it wrote AR's tokens (matches_ar). None by default, so callers that
    only want the diffusion ratio (the pipeline's batch-1 figure) do not pay for them; `dgr2 speed`
    (run_speed_benchmark) times them all unless told otherwise. compute_dtype: the diffusion
    decode's matmul precision; when it is not float32, AR is timed in it too (_interleaved).
    accuracy_timed: how many of the accuracy examples, from the first, are the timed prompts'
    (speed_benchmark_from_engines builds both from one list); their valid rate is then reported apart.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    if not prompts or min(len(p) for p in prompts) < 1:
        raise ValueError("need at least one non-empty prompt")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: must be one of {SCHEDULES}, got {schedule!r}")
    if schedule != "lockstep" and (window is not None or reuse_settled or lookup_drafts):
        raise ValueError("window, reuse_settled and lookup_drafts are options of the lockstep schedule")
    check_compute_dtype(compute_dtype)
    exact_decoders = tuple(exact_decoders)
    unknown = [d for d in exact_decoders if d not in EXACT_DECODERS]
    if unknown or len(set(exact_decoders)) < len(exact_decoders):
        raise ValueError(f"exact_decoders: each of {EXACT_DECODERS} at most once, got {list(exact_decoders)}")
    if ar_model.device != diff_model.device or ar_model.dtype != diff_model.dtype:
        raise ValueError(f"AR and diffusion models must share device and dtype, got {ar_model.device}/"
                         f"{ar_model.dtype} vs {diff_model.device}/{diff_model.dtype}")
    info = load_diffusion_config(diff_model)
    if info is None and (block_size is None or mask_token_id is None):
        raise ValueError("diff_model has no diffusion config (dgr2 convert); give block_size and mask_token_id")
    block_size = int(block_size or info["block_size"])
    mask_token_id = int(mask_token_id if mask_token_id is not None else info["mask_token_id"])
    if eos_token_id is None:
        eos_token_id = _first_id(getattr(ar_model.generation_config, "eos_token_id", None)) \
            if getattr(ar_model, "generation_config", None) is not None else None
        eos_token_id = eos_token_id if eos_token_id is not None else _first_id(ar_model.config.eos_token_id)
        if eos_token_id is None:
            raise ValueError("no eos_token_id given and none in the AR model's config")
    if pad_token_id is None:
        pad_token_id = _first_id(ar_model.config.pad_token_id)
        pad_token_id = eos_token_id if pad_token_id is None else pad_token_id
    prompts = [list(map(int, p)) for p in prompts]
    ar_model.eval()
    diff_model.eval()
    taus = tuple(float(t) for t in taus)
    kw = dict(eos=eos_token_id, pad=pad_token_id, block_size=block_size, mask_token_id=mask_token_id,
              max_steps_per_block=max_steps_per_block, progress=progress, commit_rule=commit_rule,
              hold_eos=hold_eos, exact_decoders=exact_decoders, schedule=schedule, window=window,
              reuse_settled=reuse_settled, lookup_drafts=lookup_drafts, compute_dtype=compute_dtype)
    t_start = time.perf_counter()
    gc.collect()
    gc.freeze()  # long-lived objects (models, modules) leave the collector: cheap young-generation passes
    try:
        with measured_machine(threads) as machine:
            batches = []
            for b in batch_sizes:
                ar, exact, points, ar_low = _interleaved(ar_model, diff_model, prompts, int(b), taus, max_new_tokens,
                                                         repeats, warmup, **kw)
                batches.append({"batch_size": int(b), "ar": ar, "exact_decoders": exact, "points": points,
                                "ar_compute_dtype": ar_low})
            length_curve = []
            for L in lengths:
                for b in (length_batch_sizes or batch_sizes):
                    ar, exact, points, ar_low = _interleaved(ar_model, diff_model, prompts, int(b),
                                                     tuple(float(t) for t in length_taus), int(L), repeats, warmup,
                                                     **{**kw, "eos": NO_EOS}, exact_length=int(L))
                    length_curve.append({"length": int(L), "batch_size": int(b), "ar": ar, "exact_decoders": exact,
                                         "points": points, "ar_compute_dtype": ar_low})
            fwd = None
            if forward_blocks:
                ctx = int(context or round(float(np.mean([len(p) for p in prompts]))))
                fwd = forward_cost(diff_model, ctx, batch_sizes, forward_blocks, iters=max(forward_iters, repeats),
                                   compute_dtype=compute_dtype)
            acc = None
            if accuracy is not None:
                engine_ar, engine_diff, examples = accuracy
                acc = accuracy_points(engine_ar, engine_diff, examples, taus, block_size, max_new_tokens,
                                      accuracy_batch_size, commit_rule=commit_rule, hold_eos=hold_eos,
                                      lookup="ar_lookup" in exact_decoders, window=window,
                                      reuse_settled=reuse_settled, lookup_drafts=lookup_drafts,
                                      compute_dtype=compute_dtype, timed=accuracy_timed)
                by_tau = {(p["tau"], p["lookup_drafts"]): p for p in acc["diffusion"]}
                for row in batches:
                    row["ar"].update({k: acc["ar"][k] for k in ("recall@1", "valid_rate", "timed_valid_rate")
                                      if k in acc["ar"]})
                    for p in row["exact_decoders"]:
                        if acc.get(p["decoder"]):  # hf_generate has no engine path: its tokens are checked instead
                            p.update({k: acc[p["decoder"]][k] for k in ("recall@1", "valid_rate")})
                    for p in row["points"]:
                        q = by_tau[(p["tau"], p["lookup_drafts"])]
                        p.update({k: q[k] for k in ("recall@1", "valid_rate", "timed_valid_rate") if k in q})
    finally:
        gc.unfreeze()
    return {
        "kind": "diffusion-speed",
        "machine": machine,
        "settings": {"block_size": block_size, "mask_token_id": mask_token_id, "eos_token_id": eos_token_id,
                     "max_new_tokens": max_new_tokens, "max_steps_per_block": max_steps_per_block or block_size,
                     "commit_rule": commit_rule, "hold_eos": bool(hold_eos), "exact_decoders": list(exact_decoders),
                     "schedule": schedule, "window": window, "reuse_settled": bool(reuse_settled),
                     "lookup_drafts": bool(lookup_drafts), "compute_dtype": compute_dtype,
                     "repeats": repeats, "warmup": warmup, "taus": list(taus), "batch_sizes": [int(b) for b in batch_sizes],
                     "lengths": [int(x) for x in lengths], "length_taus": [float(t) for t in length_taus],
                     "n_prompts": len(prompts), "mean_prompt_tokens": float(np.mean([len(p) for p in prompts])),
                     "max_prompt_tokens": max(len(p) for p in prompts), "temperature": 0.0,
                     "model_parameters": sum(p.numel() for p in diff_model.parameters()),
                     "model_dtype": str(diff_model.dtype).replace("torch.", ""), "device": str(diff_model.device)},
        "batches": batches,
        "length_curve": length_curve,
        "forward_cost": fwd,
        "accuracy": acc,
        "wall_seconds": time.perf_counter() - t_start,
        "notes": ("Speed-ups are ratios of runs made in this one process, interleaved per repeat; medians of "
                  f"{repeats} repeats after {warmup} warm-up repeat(s); spread = min/max and quartiles. "
                  "Length curve: EOS disabled (id -1) so both decoders generate exactly L tokens; tokens past the "
                  "model's natural end are out of distribution for its confidence, so that curve measures the "
                  "decoding mechanics, not accuracy-preserving speed. The machine is shared: see load_average."),
    }


# ------------------------------------------------------------------------------------- from dirs / CLI

def _display_path(p) -> str:
    """A path safe to record in committed results: relative to the working directory if inside it,
    else only its last component (never this machine's absolute paths)."""
    p = Path(p)
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return p.name if p.is_absolute() else str(p)


def speed_benchmark_from_engines(engine_ar, engine_diff, examples, n_prompts=8, accuracy=True, accuracy_limit=None,
                                 **kw) -> dict:
    """measure_speed on the prompts of the first n_prompts examples, rendered by the engines (the
    same prompt the service and `dgr2 eval` decode); accuracy (if asked) on all examples or the
    first accuracy_limit. `kw` go to measure_speed."""
    from reranker.eval.evaluate import request_of

    if not examples:
        raise ValueError("no examples to build prompts from")
    reqs = [request_of(r) for r in examples[:n_prompts]]
    prompts = [engine_ar.prompt_ids(r) for r in reqs]
    if [engine_diff.prompt_ids(r) for r in reqs] != prompts:
        raise ValueError("the AR and diffusion tokenizers render different prompt ids; a speed comparison "
                         "needs the same prompts (convert the diffusion model from this AR model)")
    if engine_ar.eos_id != engine_diff.eos_id:
        raise ValueError(f"EOS ids differ: AR {engine_ar.eos_id} vs diffusion {engine_diff.eos_id}")
    acc = None
    if accuracy:
        acc = (engine_ar, engine_diff, examples[:accuracy_limit] if accuracy_limit else examples)
    return measure_speed(engine_ar.model, engine_diff.model, prompts, eos_token_id=engine_ar.eos_id,
                         pad_token_id=engine_ar.pad_id, accuracy=acc, accuracy_timed=len(prompts), **kw)


def run_speed_benchmark(ar_dir, diff_dir, data_dir, out_json=None, n_prompts=8, split="test", command=None,
                        accuracy=True, accuracy_limit=None, device="cpu", **kw) -> dict:
    """Load both engines (`RerankEngine.load`) and the split's examples, measure, and write
    docs/results/diffusion-speed-<name>.json (adds command / commit / date). `kw` go to
    measure_speed (batch_sizes, taus, block_size, max_new_tokens, repeats, warmup, threads, lengths,
    length_taus, length_batch_sizes, forward_blocks, context, progress, exact_decoders (default: all
    of EXACT_DECODERS), ...). Accuracy runs on the whole split unless accuracy_limit is given.

        dgr2 speed --ar DIR --diffusion DIR --data DIR --out docs/results/diffusion-speed-<name>.json
    """
    from reranker.engine import RerankEngine
    from .evaluate import check_list_orders, engine_for_split, load_examples

    kw.setdefault("exact_decoders", EXACT_DECODERS)
    threads = kw.get("threads")
    if threads:  # before loading: some kernels size their pools at first use
        torch.set_num_threads(int(threads))
    data_dir = RerankEngine.data_dir_for(diff_dir, data_dir)  # None: the diffusion model's release bundle
    engine_ar = engine_for_split(ar_dir, data_dir, split, device)
    engine_diff = engine_for_split(diff_dir, data_dir, split, device)
    # settings not given: the diffusion model's recorded ones (reranker.decoding); the taus are a sweep
    given = {k: kw.pop(k, None) for k in ("commit_rule", "hold_eos", "max_new_tokens", "block_size", "window",
                                          "reuse_settled", "lookup_drafts", "compute_dtype")}
    d = engine_diff.decode_options({**given, "decoder": "diffusion"})
    kw.update(commit_rule=d.commit_rule, hold_eos=d.hold_eos, max_new_tokens=d.max_new_tokens,
              block_size=d.block_size, window=d.window, reuse_settled=d.reuse_settled, lookup_drafts=d.lookup_drafts,
              compute_dtype=d.compute_dtype)
    examples = load_examples(Path(data_dir) / f"{split}.jsonl")
    check_list_orders(engine_diff, examples, str(Path(data_dir) / f"{split}.jsonl"))
    rep = speed_benchmark_from_engines(engine_ar, engine_diff, examples, n_prompts, accuracy=accuracy,
                                       accuracy_limit=accuracy_limit, **kw)
    rep["models"] = {"ar": _display_path(ar_dir), "diffusion": _display_path(diff_dir),
                     "data": _display_path(data_dir), "split": split}
    if rep.get("accuracy"):
        rep["accuracy"]["split"] = split
    if out_json is not None:
        from candidate_gen.files import write_result

        command = command or (f"dgr2 speed --ar {_display_path(ar_dir)} --diffusion {_display_path(diff_dir)} "
                              f"--data {_display_path(data_dir)} --out {_display_path(out_json)}")
        write_result(out_json, rep, command)
        return json.loads(Path(out_json).read_text())
    return rep


def run_forward_cost(model, context=403, batch_sizes=(1, 2, 4, 8, 32), block_sizes=(8, 16, 32, 64), length=240,
                     iters=20, warmup=3, threads=None, out_json=None, command=None, model_name=None,
                     steps_per_block=(1, 2)) -> dict:
    """forward_cost with fused steps plus speedup_ceiling: the bound on an exact block-diffusion
    decoder's speed-up over AR that follows from this machine's forward costs alone (no trained model
    needed: a forward's cost depends on the shapes, not on the weights). Writes
    docs/results/forward-cost-<name>.json if out_json is given.

        dgr2 forward-cost --size cpu --vocab 3032 --out docs/results/forward-cost-cpu.json
    """
    t0 = time.perf_counter()
    with measured_machine(threads) as machine:
        fc = forward_cost(model.eval(), context, batch_sizes, block_sizes, iters=iters, warmup=warmup, fused=True)
    rep = {"kind": "forward-cost", "machine": machine,
           "settings": {"context": int(context), "length": int(length), "batch_sizes": [int(b) for b in batch_sizes],
                        "block_sizes": [int(b) for b in block_sizes], "iters": iters, "warmup": warmup,
                        "model": model_name, "model_parameters": sum(p.numel() for p in model.parameters()),
                        "vocab_size": model.get_input_embeddings().weight.shape[0],
                        "model_dtype": str(model.dtype).replace("torch.", ""), "device": str(model.device)},
           "forward_cost": fc, "ceiling": speedup_ceiling(fc, length, steps_per_block), "wall_seconds": time.perf_counter() - t0,
           "notes": ("Ceiling = the speed-up of an exact block-diffusion decoder whose blocks each take s steps "
                     "(each later block's first step fused with the clean write of the block before), over AR at "
                     "the same batch; per-step Python costs are left out, so real decoders stay below it. "
                     "Timings are medians of interleaved iterations on a shared machine: see load_average.")}
    if out_json is not None:
        from candidate_gen.files import write_result

        write_result(out_json, rep, command or f"dgr2 forward-cost --out {_display_path(out_json)}")
        return json.loads(Path(out_json).read_text())
    return rep


def format_forward_cost(rep: dict) -> str:
    """What `dgr2 forward-cost` prints: cost ratios and the speed-up ceilings per batch and block."""
    fc, ceil = rep["forward_cost"], rep["ceiling"]
    lines = [f"forward cost vs a one-token step, cache {fc['context']} columns, {rep['machine']['torch_threads']} "
             f"threads (plain window / fused with the previous block's clean write); speed-up ceiling at "
             f"{ceil['length']} tokens with s steps per block:"]
    by_b = {r["batch_size"]: r["blocks"] for r in ceil["rows"]}
    for row in fc["rows"]:
        cells = ", ".join(f"B={b['block_size']}: {b['ratio']:.2f}x / {b['fused_ratio']:.2f}x" for b in row["blocks"])
        lines.append(f"  batch {row['batch_size']}: one-token {row['one_token_ms']['median']:.2f} ms; {cells}")
        for st in ceil["steps_per_block"]:
            cs = ", ".join(f"B={c['block_size']}: {c['ceiling']:.2f}x" for c in by_b[row["batch_size"]]
                           if c["steps_per_block"] == st)
            lines.append(f"      ceiling, s={st}: {cs}")
    for c in ceil["concurrency"]:
        lines.append(f"  concurrency {c['max_batch']}, s={c['steps_per_block']}: ceiling {c['ceiling']:.2f}x "
                     f"(diffusion batch {c['diffusion_batch']}, B={c['block_size']}; AR batch {c['ar_batch']})")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------- printing

def _fmt_stat(s, digits=1) -> str:
    if not s or s.get("median") is None:
        return "-"
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def timed_validity_line(acc: dict | None) -> str | None:
    """One sentence: the valid rates on the timed prompts beside those on every accuracy example
    (accuracy_points' `timed`), or None when the report has none."""
    if not acc or not acc.get("timed_prompts"):
        return None
    pts = "; ".join(f"diffusion τ {p['tau']:.2f}{' lookup drafts' if p.get('lookup_drafts') else ''} "
                    f"{p['timed_valid_rate']:.3f} ({p['valid_rate']:.3f})" for p in acc["diffusion"])
    return (f"valid rate on the {acc['timed_prompts']} timed prompts (on all {acc['n']} accuracy users): "
            f"AR {acc['ar']['timed_valid_rate']:.3f} ({acc['ar']['valid_rate']:.3f}); {pts}")


def format_speed(rep: dict) -> str:
    """A plain-text summary of a measure_speed report (what `dgr2 speed` prints)."""
    m, s = rep["machine"], rep["settings"]
    dtype = s.get("compute_dtype", "float32")
    lines = [f"decode speed, block size {s['block_size']}, diffusion matmuls in {dtype}, {s['n_prompts']} prompts "
             f"(mean {s['mean_prompt_tokens']:.0f} tokens), max_new_tokens {s['max_new_tokens']}, median [min-max] of "
             f"{s['repeats']} repeats; "
             f"torch threads {m['torch_threads']}, {m['cpu_count']} CPUs, load {m.get('load_average_start')} -> "
             f"{m.get('load_average_end')}"]
    for row in rep["batches"]:
        ar = row["ar"]
        lines.append(f"batch {row['batch_size']}: {'decoder':>14s} {'tok/s':>22s} {'fwd/tok':>8s} {'tok/step':>8s} "
                     f"{'speed-up':>8s} {'paired':>20s} {'decode-phase':>20s} {'R@1':>7s} {'valid':>7s}")
        acc = (lambda p: (f"{p['recall@1']:.4f}" if p.get("recall@1") is not None else "-",
                          f"{p['valid_rate']:.4f}" if p.get("valid_rate") is not None else "-"))
        r1, v = acc(ar)
        lines.append(f"         {'AR':>14s} {_fmt_stat(ar['tokens_per_second']):>22s} "
                     f"{ar['forward_passes_per_token']:8.3f} {'1':>8s} {'1.00':>8s} {'':>20s} {'':>20s} {r1:>7s} {v:>7s}")
        for p in row.get("exact_decoders") or []:  # tok/step: tokens per forward of an average row
            r1, v = acc(p)
            same = "" if p["matches_ar"] else f"  NOT AR's tokens ({p['same_tokens_as_ar']:.2f} of rows)"
            lines.append(f"         {p['decoder']:>14s} {_fmt_stat(p['tokens_per_second']):>22s} "
                         f"{p['forward_passes_per_token']:8.3f} {p['tokens_per_forward']:8.2f} {p['speedup']:8.2f} "
                         f"{_fmt_stat(p['speedup_paired'], 2):>20s} {_fmt_stat(p.get('decode_speedup_paired'), 2):>20s} "
                         f"{r1:>7s} {v:>7s}{same}")
        low = row.get("ar_compute_dtype")
        if low:  # AR in the diffusion's matmul precision: its speed-up over float32 AR
            lines.append(f"         {'AR ' + low['compute_dtype']:>14s} {_fmt_stat(low['tokens_per_second']):>22s} "
                         f"{low['forward_passes_per_token']:8.3f} {'1':>8s} {low['speedup']:8.2f} "
                         f"{_fmt_stat(low['speedup_paired'], 2):>20s} "
                         f"{_fmt_stat(low.get('decode_speedup_paired'), 2):>20s} {'-':>7s} {'-':>7s}"
                         f"  ({low['same_tokens_as_ar']:.2f} of rows AR's tokens)")
        for p in row["points"]:
            r1, v = acc(p)
            name = f"diffusion {p['tau']:.2f}" + ("+lk" if p.get("lookup_drafts") else "")
            vs_low = f"  vs AR {low['compute_dtype']}: {_fmt_stat(p['speedup_vs_ar_compute_dtype'], 2)}" if low else ""
            lines.append(f"         {name:>14s} {_fmt_stat(p['tokens_per_second']):>22s} "
                         f"{p['forward_passes_per_token']:8.3f} {p['tokens_per_step']:8.2f} {p['speedup']:8.2f} "
                         f"{_fmt_stat(p['speedup_paired'], 2):>20s} {_fmt_stat(p.get('decode_speedup_paired'), 2):>20s} "
                         f"{r1:>7s} {v:>7s}{vs_low}")
    timed = timed_validity_line(rep.get("accuracy"))
    if timed:
        lines.append(timed)
    if rep.get("length_curve"):
        lines.append("speed-up vs generated length (EOS disabled; mechanics only):")
        for row in rep["length_curve"]:
            pts = ", ".join([f"{p['decoder']}: {_fmt_stat(p['speedup_paired'], 2)}"
                             for p in row.get("exact_decoders") or []]
                            + [f"tau {p['tau']:.2f}{' lookup drafts' if p.get('lookup_drafts') else ''}: "
                               f"{_fmt_stat(p['speedup_paired'], 2)} ({p['tokens_per_step']:.2f} tok/step)"
                               for p in row["points"]])
            lines.append(f"  L={row['length']:4d} b={row['batch_size']}: AR {_fmt_stat(row['ar']['tokens_per_second'])} "
                         f"tok/s; {pts}")
    if rep.get("forward_cost"):
        fc = rep["forward_cost"]
        lines.append(f"forward cost vs a one-token step, cache {fc['context']} columns:")
        for row in fc["rows"]:
            blocks = ", ".join(f"{b['block_size']}: {b['ratio']:.2f}x" for b in row["blocks"])
            lines.append(f"  batch {row['batch_size']}: one-token {row['one_token_ms']['median']:.2f} ms; {blocks}")
    return "\n".join(lines)

"""Model building, loading and saving: a small Qwen3-architecture causal LM, or any local HF checkpoint.

Everything downstream (SFT, conversion, decoding, RL) only assumes "a Hugging Face causal LM with
full attention that accepts position_ids, a 4D additive mask and a transformers `Cache`", so a real local
Qwen3 directory works unchanged in place of the small default.
"""
import contextlib
import copy
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from candidate_gen.files import write_dir_atomically
from reranker.text.tokenizer import load_tokenizer

# "cpu": ~4-6M parameters (with a few-thousand-token SID vocabulary), the default for CPU profiles.
# "tiny": for tests only.
SIZES = {
    "cpu": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=64, intermediate_size=704, max_position_embeddings=1024),
    "tiny": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=16, intermediate_size=64, max_position_embeddings=256),
}


# Qwen3 initialises its query/key RMSNorm gains at 1; build_model can start them elsewhere.
DEFAULT_QK_NORM_GAIN = 1.0


def check_qk_norm_gain(gain, base=None) -> float:
    """The one validation of the initial query/key norm gain (see build_model): a number in (0, 8],
    and 1 when the model starts from a `base` checkpoint, which keeps its own weights."""
    if isinstance(gain, bool) or not isinstance(gain, (int, float)) or not 0 < gain <= 8:
        raise ValueError(f"qk_norm_gain must be a number in (0, 8], got {gain!r}")
    if base and gain != DEFAULT_QK_NORM_GAIN:
        raise ValueError(f"qk_norm_gain {gain} sets a fresh model's initial weights; a base checkpoint ({base}) "
                         "keeps its own")
    return float(gain)


def build_model(vocab_size, size="cpu", pad_token_id=None, eos_token_id=None, bos_token_id=None,
                seed=0, attn_implementation="sdpa", qk_norm_gain=DEFAULT_QK_NORM_GAIN):
    """A freshly initialised Qwen3ForCausalLM. `size` is "cpu", "tiny" or a dict of Qwen3Config
    fields (a dict overrides the "cpu" defaults).

    qk_norm_gain: the initial value of every query and key RMSNorm gain (Qwen3 starts them at 1).
    Why: Qwen3 normalises each head's query and key, so an attention logit is at most
    head_dim ** 0.5 times the two gains (8 for the cpu model's 64-wide heads). Finding one line of a
    600-token prompt by its number needs a sharper attention than that, and a gain grows slowly
    (at most about lr per Adam step: 1.0 -> 1.2 in 1,200 steps at lr 1e-3). Measured on Beauty,
    gains of 1.5 made the recipe's mix phase learn its copies about ten times lower in answer loss
    at step 400 (docs/EXPERIMENTS.md, "The lookup by number in real prompts"). The saved model is a
    plain Qwen3: only the starting weights differ."""
    gain = check_qk_norm_gain(qk_norm_gain)
    fields = dict(SIZES["cpu"], **size) if isinstance(size, dict) else dict(SIZES[size])
    fields.setdefault("tie_word_embeddings", True)
    config = Qwen3Config(vocab_size=vocab_size, pad_token_id=pad_token_id, eos_token_id=eos_token_id,
                         bos_token_id=bos_token_id, use_sliding_window=False, **fields)
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng():  # seeded init without disturbing the caller's RNG stream
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(copy.deepcopy(config))
    if gain != DEFAULT_QK_NORM_GAIN:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.fill_(gain)
                layer.self_attn.k_norm.weight.fill_(gain)
    return model.float()


@contextlib.contextmanager
def no_weight_bars():
    """transformers' own progress bars ("Loading weights", "Writing model shards") off inside the
    block: a local model of a few MB loads in milliseconds, and a bar per load and save floods the
    pipeline's log. Scoped through transformers' tqdm hook, the previous hook back on exit (its
    global `disable_progress_bar` would also silence the Hub's and every later bar); our own bars
    (training steps, evaluation) do not go through that hook."""
    from transformers.utils import logging as hf_logging

    previous = hf_logging.set_tqdm_hook(lambda factory, args, kwargs: factory(*args, **{**kwargs, "disable": True}))
    try:
        yield
    finally:
        hf_logging.set_tqdm_hook(previous)


class ModelDirError(ValueError):
    """A model directory that cannot be loaded. The message names the file and says why, in one
    line (the CLI prints it as is) instead of a traceback through transformers."""


def check_model_path(path) -> None:
    """A model that loads without the network: a local directory, or a name already in the local
    Hugging Face cache. Anything else raises ModelDirError naming it; transformers would raise a
    repo-id validation error from deep inside its hub code."""
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            raise ModelDirError(f"{path}: not a model directory (a file)")
        return
    from huggingface_hub import try_to_load_from_cache

    try:
        hit = try_to_load_from_cache(str(path), "config.json")
    except ValueError:  # not a repo id either (an absolute path, say)
        hit = None
    if not isinstance(hit, str):
        raise ModelDirError(f"{path}: no such model directory (nor a model in the local Hugging Face cache)")


def check_weight_files(path) -> None:
    """Open the header of every *.safetensors file of a model directory: a damaged or truncated file
    (a copy cut short, a disk error) raises ModelDirError naming it. transformers would raise from
    deep in its loader without naming the file."""
    from safetensors import SafetensorError, safe_open

    check_model_path(path)
    path = Path(path)
    if not path.is_dir():  # a name in the local Hugging Face cache: transformers resolves it
        return
    if not (path / "config.json").is_file():
        raise ModelDirError(f"{path}: not a model directory (no config.json)")
    for f in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as weights:
                weights.keys()
        except (SafetensorError, OSError) as err:
            raise ModelDirError(f"{f}: not a readable safetensors file ({err}); copy or export the model "
                                "again") from None


def load_model(path, dtype=None, attn_implementation=None, device=None):
    """Load any local HF causal-LM directory (never touches the network); a damaged weight file
    raises ModelDirError naming it."""
    check_weight_files(path)
    kwargs = dict(local_files_only=True)
    if dtype is not None:
        kwargs["dtype"] = dtype
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    with no_weight_bars():
        model = AutoModelForCausalLM.from_pretrained(str(path), **kwargs)
    return model.to(device) if device is not None else model


def save_model(model, tokenizer, path):
    """save_pretrained (safetensors) into a sibling temp dir, then rename into place, so a crash
    never leaves a half-written model directory behind."""
    def save(tmp: Path) -> None:
        with no_weight_bars():
            model.save_pretrained(str(tmp), safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))

    return write_dir_atomically(path, save)


def resize_for_tokenizer(model, tokenizer):
    """Grow the embedding matrix (and a tied head) if the tokenizer has more tokens than rows.
    Never shrinks: real checkpoints (e.g. Qwen3) keep spare rows beyond len(tokenizer)."""
    n = len(tokenizer)
    if n > model.get_input_embeddings().weight.shape[0]:
        model.resize_token_embeddings(n, mean_resizing=False)
    return model


def average_models(paths, out):
    """A model directory whose weights are the uniform average of `paths` (a "model soup" of
    checkpoints of one run or of sibling runs from one parent); config, generation config and
    tokenizer are the first one's. The models must share architecture and every tensor's shape,
    and converted (diffusion) models their block size and mask token, or nothing is written."""
    paths = [Path(p) for p in paths]
    if len(paths) < 2:
        raise ValueError(f"averaging needs at least two model directories, got {len(paths)}")
    first = load_model(paths[0])
    want = first.config.to_dict()
    own = first.state_dict()
    acc = {k: v.detach().float().clone() for k, v in own.items()}
    for p in paths[1:]:
        model = load_model(p)
        got = model.config.to_dict()
        for key in ("architectures", "vocab_size", "hidden_size", "num_hidden_layers", "diffusion"):
            if got.get(key) != want.get(key):
                raise ValueError(f"{p}: config {key} is {got.get(key)!r}, but {paths[0]} has {want.get(key)!r}")
        sd = model.state_dict()
        if set(sd) != set(acc):
            raise ValueError(f"{p}: weights {sorted(set(sd) ^ set(acc))[:3]} differ from {paths[0]}'s")
        for k, v in sd.items():
            if v.shape != acc[k].shape:
                raise ValueError(f"{p}: {k} has shape {tuple(v.shape)}, {paths[0]} {tuple(acc[k].shape)}")
            acc[k] += v.detach().float()
    first.load_state_dict({k: (v / len(paths)).to(own[k].dtype) for k, v in acc.items()})
    return save_model(first, load_tokenizer(paths[0]), out)

"""The decode settings: their names, defaults, bounds and the one validation of each.

Every place that decodes or takes a decode setting (the engine, `dgr2 eval` / `speed` / `e2e`,
the pipeline's evaluation, the RecBole config keys, the gRPC service and its batch key) reads them
from here, so a default or a bound is written once.

Where a value comes from, first match wins:
  1. an explicit setting (a command-line flag, a config key, a field set in a gRPC request);
  2. what the model directory records: `decode_settings` in its config.json, written by
     `dgr2 convert` (which records decoder "diffusion") and carried by every later
     save_pretrained, so a stage's output keeps what its input recorded;
  3. the built-in defaults below.
The block size is not recorded here: a converted model's `diffusion.block_size` is the one it was
trained with, and `block_size=None` means exactly that.

Plain Python only (no torch, no gRPC): the command-line parsers import it to build `--help`.
"""
from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from pathlib import Path

# ar: plain greedy / sampled AR; ar_lookup: greedy AR with exact prompt-lookup drafts (the same tokens
# as ar, fewer forwards: reranker.diffusion.lookup_decoder); diffusion: block diffusion (a converted model)
DECODERS = ("ar", "ar_lookup", "diffusion")
COMMIT_RULES = ("confidence", "prefix")  # see reranker.diffusion.forward.commit_confident
# The matmul precision of a decode: float32, or bfloat16 under torch.autocast (weights, norms, the
# residual stream and the logits' softmax stay float32; reranker.diffusion.forward.compute_precision).
# On a CPU with AVX512-BF16 a 32-column block step's matmuls run several times faster in bfloat16 and
# a one-token step's slower; the choice changes confidences a little (docs/EXPERIMENTS.md).
COMPUTE_DTYPES = ("float32", "bfloat16")
DEFAULT_COMPUTE_DTYPE = "float32"
DEFAULT_DECODER = "ar"
DEFAULT_TAU = 0.9
DEFAULT_COMMIT_RULE = "confidence"  # the paper's rule
DEFAULT_MAX_NEW_TOKENS = 320
MAX_BLOCK_SIZE = 256
# The settings a model directory may record (config.json "decode_settings"). block_size is the
# diffusion config's; max_steps_per_block and seed are run settings, not properties of a model.
RECORDED = ("decoder", "tau", "commit_rule", "hold_eos", "max_new_tokens", "temperature", "window", "reuse_settled",
            "lookup_drafts", "compute_dtype")
MODEL_CONFIG_KEY = "decode_settings"


class DecodeSettingError(ValueError):
    """An invalid decode setting: `field` names it (with any prefix, e.g. "options.tau")."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field, self.problem = field, problem


def check_commit_rule(rule, name="commit rule") -> None:
    """The one check of a commit-rule setting (DecodeOptions.validate, the decoder, the stages'
    configs); `name` is what the error calls it."""
    if rule not in COMMIT_RULES:
        raise DecodeSettingError(name, f"must be one of {COMMIT_RULES}, got {rule!r}")


def check_compute_dtype(dtype, name="compute_dtype") -> None:
    """The one check of a compute-dtype setting (DecodeOptions.validate, the decoders' precision
    context, the speed harness); `name` is what the error calls it."""
    if dtype not in COMPUTE_DTYPES:
        raise DecodeSettingError(name, f"must be one of {COMPUTE_DTYPES}, got {dtype!r}")


def check_workers(workers, name="workers") -> int:
    """The one check of a decode-worker count (eval, the RecBole model, the service): an int >= 1;
    `name` is what the error calls it."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"{name} must be an int >= 1, got {workers!r}")
    return workers


@dataclass
class DecodeOptions:
    decoder: str = DEFAULT_DECODER
    tau: float = DEFAULT_TAU  # diffusion: commit threshold on the chosen token's probability
    block_size: int | None = None  # None: the block size recorded in the converted model
    temperature: float = 0.0  # 0: greedy
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    max_steps_per_block: int | None = None  # None: the block size (one token per step at worst)
    seed: int = 0
    commit_rule: str = DEFAULT_COMMIT_RULE  # diffusion: "confidence" (the paper's) or "prefix" (left to right)
    hold_eos: bool = False  # diffusion: commit EOS only as the position a step must commit
    # diffusion approximations that run fewer columns a step (reranker.diffusion.diffusion_decoder):
    window: int | None = None  # run masked columns only this far past the leftmost one; None: the block
    reuse_settled: bool = False  # keep the KVs of columns whose input and target are committed
    # diffusion, "prefix" rule: masked inputs hold prompt-lookup drafts; a confirmed draft commits
    lookup_drafts: bool = False
    compute_dtype: str = DEFAULT_COMPUTE_DTYPE  # matmul precision of the decode (COMPUTE_DTYPES)

    def validate(self, prefix: str = "") -> "DecodeOptions":
        """Raises ValueError naming the field (after `prefix`, e.g. "options.") and its value."""
        def bad(name, problem):
            raise DecodeSettingError(prefix + name, problem)

        if self.decoder not in DECODERS:
            bad("decoder", f"must be one of {DECODERS}, got {self.decoder!r}")
        if not _is_number(self.tau) or not 0.0 < self.tau <= 1.0:
            bad("tau", f"must be in (0, 1], got {self.tau!r}")
        if self.block_size is not None and (not _is_int(self.block_size) or not 1 <= self.block_size <= MAX_BLOCK_SIZE):
            bad("block_size", f"must be in [1, {MAX_BLOCK_SIZE}] or unset, got {self.block_size!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            bad("temperature", f"must be a finite number >= 0, got {self.temperature!r}")
        if self.decoder == "ar_lookup" and self.temperature != 0:
            # its drafts are kept only where they equal the arg-max: exact for greedy decoding only
            bad("temperature", f"must be 0 with decoder 'ar_lookup' (greedy only), got {self.temperature!r}")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            bad("max_new_tokens", f"must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.max_steps_per_block is not None and (not _is_int(self.max_steps_per_block)
                                                     or self.max_steps_per_block < 1):
            bad("max_steps_per_block", f"must be an integer >= 1 or unset, got {self.max_steps_per_block!r}")
        if not _is_int(self.seed):
            bad("seed", f"must be an integer, got {self.seed!r}")
        check_commit_rule(self.commit_rule, prefix + "commit_rule")
        if not isinstance(self.hold_eos, bool):
            bad("hold_eos", f"must be true or false, got {self.hold_eos!r}")
        if self.window is not None and (not _is_int(self.window) or not 1 <= self.window <= MAX_BLOCK_SIZE):
            bad("window", f"must be in [1, {MAX_BLOCK_SIZE}] or unset, got {self.window!r}")
        if not isinstance(self.reuse_settled, bool):
            bad("reuse_settled", f"must be true or false, got {self.reuse_settled!r}")
        if not isinstance(self.lookup_drafts, bool):
            bad("lookup_drafts", f"must be true or false, got {self.lookup_drafts!r}")
        check_compute_dtype(self.compute_dtype, prefix + "compute_dtype")
        if self.lookup_drafts and self.decoder == "diffusion" and self.commit_rule != "prefix":
            bad("lookup_drafts", f"needs commit_rule 'prefix' (a draft is confirmed by the token just before it), "
                                 f"got commit_rule {self.commit_rule!r}")
        return self

    @property
    def key(self) -> tuple:
        """Every field: requests decode together only when all of them match (the service's batch key)."""
        return tuple(getattr(self, f.name) for f in fields(self))

    def as_dict(self) -> dict:
        return asdict(self)

    def hash_dict(self) -> dict:
        """The settings a pipeline step's key hashes: every field, except a field added after runs were
        keyed (KEYED_LATER) while it holds its default, so a finished run's steps keep their keys."""
        return {k: v for k, v in asdict(self).items() if not (k in KEYED_LATER and v == _DEFAULTS[k])}


NAMES = tuple(f.name for f in fields(DecodeOptions))
_DEFAULTS = {f.name: f.default for f in fields(DecodeOptions)}
KEYED_LATER = ("compute_dtype",)  # DecodeOptions.hash_dict


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def resolve(explicit: Mapping | None = None, recorded: Mapping | None = None) -> DecodeOptions:
    """Explicit settings (None values mean "not given") over the model's recorded ones over the
    defaults, validated. Unknown names are an error naming them."""
    values = {}
    for source in (recorded or {}, explicit or {}):
        unknown = sorted(set(source) - set(NAMES))
        if unknown:
            raise ValueError(f"unknown decode setting(s) {unknown}; known: {list(NAMES)}")
        values.update({k: v for k, v in source.items() if v is not None})
    return DecodeOptions(**values).validate()


def served_rollout_settings(cfg: dict, model_config) -> dict:
    """A diffusion training stage's decoding `tau` and `commit_rule` (OPD and RL rollouts, CFT's
    validation decode): the stage config's, where it sets them (None = not set), else what the
    student records, else the defaults. Stages then decode exactly as the model is served."""
    opts = resolve({"decoder": "diffusion", "tau": cfg.get("tau"), "commit_rule": cfg.get("commit_rule")},
                   recorded_settings(model_config))
    return {"tau": opts.tau, "commit_rule": opts.commit_rule}


def check_recorded(settings, where: str) -> dict:
    """A model's recorded decode settings, checked: a dict with only RECORDED names and valid values.
    `where` names the file in errors."""
    if not isinstance(settings, Mapping):
        raise ValueError(f"{where}: {MODEL_CONFIG_KEY} must be an object, got {type(settings).__name__}")
    unknown = sorted(set(settings) - set(RECORDED))
    if unknown:
        raise ValueError(f"{where}: {MODEL_CONFIG_KEY} has unknown setting(s) {unknown}; known: {list(RECORDED)}")
    try:
        DecodeOptions(**settings).validate(MODEL_CONFIG_KEY + ".")
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return dict(settings)


def recorded_settings(config) -> dict:
    """The decode settings a loaded model's config records ({} when none); config may be an HF
    config object or a config.json dict."""
    settings = config.get(MODEL_CONFIG_KEY) if isinstance(config, Mapping) else getattr(config, MODEL_CONFIG_KEY, None)
    return check_recorded(settings, "config.json") if settings else {}


def recorded_in(model_dir) -> dict:
    """The decode settings model_dir/config.json records, read without loading the model."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the model config ({e})") from None
    settings = config.get(MODEL_CONFIG_KEY) if isinstance(config, dict) else None
    return check_recorded(settings, str(path)) if settings else {}


def record(config, settings: Mapping) -> dict:
    """Write `settings` (RECORDED names, None values left out) into an HF config as the model's
    decode settings, over what it recorded before; save_pretrained then writes them to config.json."""
    merged = {**recorded_settings(config), **{k: v for k, v in settings.items() if v is not None}}
    merged = check_recorded(merged, "decode settings to record")
    setattr(config, MODEL_CONFIG_KEY, merged)
    return merged


# ---- command-line flags ---------------------------------------------------------------------------
_HELP = {
    "decoder": "decoder; default: the model's recorded one, else ar",
    "tau": f"diffusion commit threshold in (0, 1]; default: the model's recorded one, else {DEFAULT_TAU}",
    "block_size": f"diffusion block size in [1, {MAX_BLOCK_SIZE}]; default: the one the model was converted with",
    "commit_rule": "diffusion: commit every confident position (confidence, the paper's) or only the leftmost "
                   "masked one and the confident run after it (prefix); default: the model's recorded one, else "
                   f"{DEFAULT_COMMIT_RULE}",
    "hold_eos": "diffusion: commit EOS only as the position a step must commit, not on confidence beside the "
                "tokens before it; default: the model's recorded setting, else off",
    "max_new_tokens": f"generation budget; default: the model's recorded one, else {DEFAULT_MAX_NEW_TOKENS}",
    "window": "diffusion, approximate: a step runs masked columns only this far past the leftmost one; "
              "default: the model's recorded one, else the whole block",
    "reuse_settled": "diffusion, approximate: keep the KVs of columns whose input and target are committed "
                     "instead of recomputing them each step; default: the model's recorded setting, else off",
    "lookup_drafts": "diffusion, prefix rule: fill masked inputs with prompt-lookup drafts and commit a drafted "
                     "position when the token before it confirms its draft; default: the model's recorded setting, "
                     "else off",
    "temperature": "sampling temperature, 0 greedy; default: the model's recorded one, else 0",
    "compute_dtype": "matmul precision: float32, or bfloat16 under autocast (faster wide steps on CPUs with "
                     "AVX512-BF16; confidences change a little); default: the model's recorded one, else "
                     f"{DEFAULT_COMPUTE_DTYPE}",
}


FLAGS = tuple(_HELP)  # the settings that have a command-line flag
_SWITCHES = tuple(f.name for f in fields(DecodeOptions) if isinstance(f.default, bool))  # --x / --no-x


def add_decode_flags(parser: argparse.ArgumentParser, names=FLAGS, help_overrides: Mapping | None = None) -> None:
    """The decode flags (`--tau`, `--commit-rule`, ...) for the settings in `names`. Every default is
    None, "not given": `explicit_from_args` leaves them out, so the model's recorded setting or the
    built-in default applies."""
    helps = {**_HELP, **(help_overrides or {})}
    types = {"tau": float, "block_size": int, "max_new_tokens": int, "temperature": float, "window": int}
    for name in names:
        flag = "--" + name.replace("_", "-")
        if name == "decoder":
            parser.add_argument(flag, choices=DECODERS, default=None, help=helps[name])
        elif name == "commit_rule":
            parser.add_argument(flag, choices=COMMIT_RULES, default=None, help=helps[name])
        elif name == "compute_dtype":
            parser.add_argument(flag, choices=COMPUTE_DTYPES, default=None, help=helps[name])
        elif name in _SWITCHES:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=helps[name])
        else:
            parser.add_argument(flag, type=types[name], default=None, help=helps[name])


def explicit_from_args(args: argparse.Namespace, names=FLAGS) -> dict:
    """The decode settings in `names` given on the command line (add_decode_flags's, set by the user).
    Pass the names the command added: another flag may share a name (convert's --block-size)."""
    return {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}

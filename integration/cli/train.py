"""`dgr2 model ...`, `dgr2 train` and `dgr2 convert`: the initial model, one training stage, AR -> diffusion."""
from __future__ import annotations

import json
from pathlib import Path

from reranker.decoding import RECORDED as RECORDED_FLAGS
from reranker.decoding import add_decode_flags

from ..config import load_config, section
from .common import json_arg

# the decode settings `dgr2 convert` can record beside decoder "diffusion" (--block-size is the conversion's own)
CONVERT_RECORDS = ("tau", "commit_rule", "hold_eos", "max_new_tokens", "lookup_drafts")


def cmd_model_init(args) -> int:
    from reranker.training.init_model import init_model

    out = init_model(args.data, args.out, size=args.size, base=args.base, seed=args.seed,
                     qk_norm_gain=args.qk_norm_gain)
    print(f"initial model written to {out}")
    return 0


def cmd_model_export(args) -> int:
    from reranker.training.checkpoint import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.like, args.out)
    print(f"model of {args.checkpoint} written to {out}")
    return 0


def cmd_model_average(args) -> int:
    from reranker.model import average_models

    out = average_models(args.models, args.out)
    print(f"average of {len(args.models)} models written to {out}")
    return 0


def cmd_train(args) -> int:
    from reranker.stages.pipeline import run_stage

    config = json_arg(args.config_json, "--config-json") if args.config_json else {}
    if args.config:
        cfg = load_config(args.config)
        config = {**(section(section(cfg, "stages"), args.stage)), **config}
    summary = run_stage(args.stage, args.input, args.output, args.data, config, runs_dir=args.runs,
                        seed=args.seed, force=args.force)
    print(json.dumps(summary, indent=2, default=str))
    return 0


def cmd_convert(args) -> int:
    from reranker.diffusion.convert import convert_to_diffusion

    from reranker.decoding import explicit_from_args

    convert_to_diffusion(args.src, args.dst, block_size=args.block_size,
                         decode=explicit_from_args(args, CONVERT_RECORDS))
    print(f"converted {args.src} -> {args.dst} (block size {args.block_size})")
    return 0


def cmd_model_decode_settings(args) -> int:
    """Record decode settings in a model directory's config.json (what callers that send none get)."""
    from candidate_gen.files import atomic_write_json
    from reranker.decoding import MODEL_CONFIG_KEY, check_recorded, explicit_from_args, recorded_in

    path = Path(args.model) / "config.json"
    settings = recorded_in(args.model)  # checks the file first: an error names it
    given = explicit_from_args(args, RECORDED_FLAGS)
    settings = check_recorded({**settings, **given}, str(path))
    if given:
        config = json.loads(path.read_text(encoding="utf-8"))
        config[MODEL_CONFIG_KEY] = settings
        atomic_write_json(path, config)
    print(json.dumps({MODEL_CONFIG_KEY: settings}, indent=2))
    return 0


def add_model(sub) -> None:
    m = sub.add_parser("model", help="model utilities")
    msub = m.add_subparsers(dest="model_command", required=True)
    mi = msub.add_parser("init", help="a fresh small Qwen3 over the data's tokenizer, or a local checkpoint + our tokens")
    mi.add_argument("--data", help="re-ranking data directory (its tokenizer/ is used for a fresh model)")
    mi.add_argument("--out", required=True)
    mi.add_argument("--size", default="cpu", help="cpu | tiny")
    mi.add_argument("--base", help="a local Hugging Face causal-LM directory to start from instead")
    mi.add_argument("--seed", type=int, default=0)
    mi.add_argument("--qk-norm-gain", type=float,
                    help="initial query/key norm gain of a fresh model (configs' model.qk_norm_gain; default 1)")
    mi.set_defaults(func=cmd_model_init)
    me = msub.add_parser("export", help="a model directory from a training checkpoint (probe a running stage)")
    me.add_argument("--checkpoint", required=True, help="<runs>/<stage>/checkpoints/stepNNNNNNNN-<tag>.pt")
    me.add_argument("--like", required=True, help="the stage's input model directory (architecture, tokenizer)")
    me.add_argument("--out", required=True)
    me.set_defaults(func=cmd_model_export)
    ma = msub.add_parser("average", help="a model directory whose weights average several of one architecture")
    ma.add_argument("models", nargs="+", help="model directories (the first gives config and tokenizer)")
    ma.add_argument("--out", required=True)
    ma.set_defaults(func=cmd_model_average)
    md = msub.add_parser("decode-settings", help="show or record the decode settings a model directory "
                                                 "records (what a request or command that sends none gets)")
    md.add_argument("model", help="model directory")
    add_decode_flags(md, RECORDED_FLAGS, {n: f"record this {n.replace('_', ' ')}" for n in RECORDED_FLAGS})
    md.set_defaults(func=cmd_model_decode_settings)


def add_train(sub) -> None:
    t = sub.add_parser("train", help="run one training stage (a registered plugin: sft, ar_rl, cft, opd, rl, ...)")
    t.add_argument("stage")
    t.add_argument("--input", required=True, help="input model directory")
    t.add_argument("--output", required=True, help="output model directory")
    t.add_argument("--data", required=True, help="re-ranking data directory")
    t.add_argument("--config", help="YAML run config; its stages.<stage> section is used")
    t.add_argument("--config-json", help="stage settings as JSON (override the YAML)")
    t.add_argument("--runs", help="runs directory for checkpoints and TensorBoard")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--force", action="store_true", help="redo the stage even if it is complete")
    t.set_defaults(func=cmd_train)


def add_convert(sub) -> None:
    c = sub.add_parser("convert", help="convert an AR model directory into a block-diffusion model")
    c.add_argument("--from", dest="src", required=True)
    c.add_argument("--to", dest="dst", required=True)
    c.add_argument("--block-size", type=int, default=32)
    add_decode_flags(c, CONVERT_RECORDS, {n: f"record this {n.replace('_', ' ')} as the converted model's "
                                             f"(decoder: diffusion)" for n in CONVERT_RECORDS})
    c.set_defaults(func=cmd_convert)

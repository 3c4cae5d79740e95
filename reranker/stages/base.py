"""The one interface every training stage implements.

A stage reads a model directory (HF format + tokenizer) and writes a new one. The runner
(reranker.stages.pipeline.run_stage) owns everything around that: merging the config over the
stage's defaults, hashing it, the run directory, and the atomic hand-over of the output —
the stage writes into `ctx.output_dir` (a `<out>.partial/` directory); after `run` returns,
the runner adds `stage_done.json` there and renames the directory to `<out>`. A killed stage
therefore never leaves a directory that looks finished.

A third-party stage subclasses `Stage` and declares an entry point:

    [project.entry-points."diffusion_gr2.stages"]
    my_stage = "my_pkg.stage:MyStage"
"""
from __future__ import annotations

import abc
import copy
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

DONE_FILE = "stage_done.json"


class NotDoneError(RuntimeError):
    """A step asked to be done already (read back, not run: `dgr2 pipeline --summary-only`) is not."""


@dataclass
class StageContext:
    name: str
    input_dir: Path  # model to start from (HF directory with tokenizer)
    output_dir: Path  # where the stage writes its model: `<final_dir>.partial`
    final_dir: Path  # where the runner moves output_dir when the stage succeeds
    data_dir: Path | None  # examples JSONL files
    config: dict  # stage config merged over default_config(), plain YAML-style data
    run_dir: Path  # checkpoints/, tensorboard/, metrics.jsonl
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"  # "cpu" or "cuda:<local_rank>", matching the process group's backend
    progress: bool = True  # tqdm bar on rank 0
    config_hash: str = ""  # identity of (stage, config, seed, input model, data); tags checkpoints

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass
class StageResult:
    metrics: dict = field(default_factory=dict)  # plain floats/ints/strings (go into stage_done.json)
    optimizer_steps: int = 0


class Stage(abc.ABC):
    name: str = ""
    defaults: dict = {}  # what default_config returns (a copy), unless a subclass overrides it

    def default_config(self) -> dict:
        """Every config key the stage understands, with its default (unknown keys are errors)."""
        return copy.deepcopy(self.defaults)

    @abc.abstractmethod
    def run(self, ctx: StageContext) -> StageResult:
        """Train from ctx.input_dir and save the result (save_pretrained + tokenizer) into
        ctx.output_dir on rank 0. Resume from ctx.run_dir if a checkpoint is there."""


def merge_config(defaults: dict, overrides: dict | None, stage: str = "") -> dict:
    """`overrides` over `defaults`, recursively for nested dicts. A key the defaults do not
    declare is an error (a typo in a pipeline YAML would otherwise be silently ignored);
    a stage that declares no defaults accepts anything."""
    out = copy.deepcopy(defaults)
    for k, v in (overrides or {}).items():
        if defaults and k not in defaults:
            raise ValueError(f"stage {stage!r}: unknown config key {k!r}; known keys: {', '.join(sorted(defaults))}")
        if isinstance(v, dict) and isinstance(defaults.get(k), dict):
            out[k] = merge_config(defaults[k], v, stage)
        else:
            out[k] = copy.deepcopy(v)
    return out


def config_hash(obj) -> str:
    """sha256 of canonical JSON (sorted keys): the same plain data always hashes the same."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def read_done(final_dir) -> dict | None:
    path = Path(final_dir) / DONE_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None

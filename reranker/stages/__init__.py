"""Training stages as plugins (entry-point group `diffusion_gr2.stages`).

Importing this package is cheap and side-effect free; `reranker.stages.pipeline` (torch) is
imported by whoever runs stages.
"""
from reranker.stages.base import Stage, StageContext, StageResult
from reranker.stages.registry import available_stages, get_stage

__all__ = ["Stage", "StageContext", "StageResult", "available_stages", "get_stage"]

"""Process-group plumbing so one training loop runs unchanged with or without torchrun.

Launched plainly (`python -m ...`) everything here is a no-op over a world of one. Launched
with `torchrun --nproc_per_node=K`, the env vars torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT) initialise a process group: gloo on CPU, nccl when CUDA is there.

Data sharding is by *global batch*, not by example: every rank computes the same shuffled
order from (seed, epoch), cuts it into global batches, and takes its own slice of each. So a
global batch holds the same examples whatever the world size, which is what makes a 2-process
run reproduce a 1-process run step for step (and lets a run resume on a different world size).
"""
from __future__ import annotations

import json
import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str | None = None  # None: single process, no process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str = "auto") -> DistEnv:
    """Read torchrun's env vars and join the process group (idempotent).

    device: "auto" (CUDA if present, else CPU), "cpu" or "cuda". The backend follows the
    device: nccl for CUDA, gloo for CPU.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    use_cuda = torch.cuda.is_available() if device == "auto" else device.startswith("cuda")
    if use_cuda:
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} CUDA devices "
                               "(nccl needs one GPU per process; use --device cpu for gloo)")
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if world <= 1:
        return DistEnv(0, 1, 0, dev, None)
    backend = "nccl" if use_cuda else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=rank, world_size=world)
    else:
        backend = dist.get_backend()
    return DistEnv(rank, world, local_rank, dev, backend)


def destroy_distributed() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def get_rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main() -> bool:
    return get_rank() == 0


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def wrap_ddp(model: torch.nn.Module, env: DistEnv) -> torch.nn.Module:
    """DDP in a multi-process run, the bare model otherwise (same call sites either way)."""
    if not env.distributed:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [env.local_rank] if env.device.type == "cuda" else None
    return DDP(model, device_ids=ids)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if hasattr(model, "module") else model


def no_sync(model: torch.nn.Module, skip: bool):
    """Skip DDP's gradient all-reduce on accumulation micro-steps (only the last one syncs)."""
    if skip and hasattr(model, "no_sync"):
        return model.no_sync()
    return nullcontext()


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> list[int]:
    """The epoch's example order: a pure function of (seed, epoch), identical on every rank,
    and independent of the global RNG so resuming or adding ranks never changes it."""
    if not shuffle:
        return list(range(n))
    g = torch.Generator().manual_seed(int(seed) * 1_000_003 + int(epoch))
    return torch.randperm(n, generator=g).tolist()


def seeded(device, *parts) -> torch.Generator:
    """A generator keyed by plain data, e.g. (seed, step, example) or (seed, step, micro-batch):
    noise and rollouts are reproducible on resume and do not depend on which rank draws them."""
    g = torch.Generator(device=device)
    g.manual_seed(int.from_bytes(json.dumps(parts).encode(), "little") % (2**61 - 1))
    return g


def global_batches(order: list[int], batch_size: int) -> list[list[int]]:
    """Consecutive global batches; the last incomplete one is dropped so every optimizer step
    sees exactly `batch_size` examples (a different tail is dropped each epoch)."""
    n = len(order) // batch_size
    return [order[i * batch_size:(i + 1) * batch_size] for i in range(n)]


def rank_micro_batches(batch: list[int], rank: int, world_size: int, grad_accum: int) -> list[list[int]]:
    """This rank's `grad_accum` micro-batches of one global batch.

    The global batch is cut into world_size * grad_accum equal micro-batches; rank r takes the
    r-th contiguous run of grad_accum of them. With the same micro-batch size, a 1-process run
    with accumulation sees the very same micro-batches (same padding), only in one process.
    """
    k = world_size * grad_accum
    if len(batch) % k:
        raise ValueError(f"global batch of {len(batch)} does not split into "
                         f"{world_size} ranks x {grad_accum} micro-batches")
    m = len(batch) // k
    micro = [batch[i * m:(i + 1) * m] for i in range(k)]
    return micro[rank * grad_accum:(rank + 1) * grad_accum]


def shard(items: list, rank: int, world_size: int) -> list:
    """Strided split for evaluation (every item on exactly one rank; no padding, so sums
    all-reduced over ranks equal the 1-process sums)."""
    return items[rank::world_size]


def all_reduce_sum(values, device: torch.device | str = "cpu") -> list[float]:
    """Sum a list of floats over ranks (float64, so token counts stay exact)."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    if is_distributed():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def sum_gradients(model: torch.nn.Module) -> None:
    """All-reduce (sum) every gradient over ranks in one flat buffer; a no-op on one process.

    For the stages that do not wrap the model in DDP (cft, opd, the RL loop): the diffusion loss
    and the decoders read the model's own attributes (dtype, config), which a wrapper hides, and
    the chunked replay calls the model several times per backward, which DDP's reducer does not
    allow. Each rank's loss is already divided by the GLOBAL token count, so the sum is exactly
    the 1-process gradient. A parameter without a gradient on this rank sends zeros: every rank
    must send the same tensors."""
    if not is_distributed():
        return
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    for p, chunk in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(chunk.view_as(p))


def all_reduce_metrics(metrics: dict, op: str = "mean", device: torch.device | str = "cpu") -> dict:
    """Reduce a dict of scalars over ranks by "mean" or "sum" (keys must match on all ranks)."""
    keys = sorted(metrics)
    vals = all_reduce_sum([metrics[k] for k in keys], device)
    if op == "mean":
        vals = [v / get_world_size() for v in vals]
    elif op != "sum":
        raise ValueError(f"op must be 'mean' or 'sum', got {op!r}")
    return dict(zip(keys, vals))


def all_gather_object(obj) -> list:
    if not is_distributed():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    """Rank `src`'s value on every rank (e.g. a decision only rank 0 may take)."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]

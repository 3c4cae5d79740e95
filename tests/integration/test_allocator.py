"""`dgr2`'s malloc settings (integration/cli/allocator.py): freed memory is reused, not faulted in again."""
import os
import subprocess
import sys

import pytest

from integration.cli.allocator import keep_freed_memory

# Allocate and free a 64 MiB buffer 30 times; print the minor page faults that took.
PROBE = """
import resource, sys
from integration.cli.allocator import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
import torch
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(30):
    x = torch.empty(16 * 2 ** 20)
    x.fill_(1.0)
    del x
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def probe(mode: str, **env) -> tuple[bool, int]:
    env = {k: v for k, v in {**os.environ, **env}.items() if k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=env, check=True)
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_kept_memory_is_reused_without_new_page_faults():
    applied, kept = probe("keep", DGR2_MALLOC="")
    _, default = probe("default", DGR2_MALLOC="")
    assert applied
    # 30 x 64 MiB of fresh pages is ~490k faults by default; kept in the heap, ~130k here
    assert default > 200_000 and kept < default / 2, (kept, default)


def test_opt_outs(monkeypatch):
    monkeypatch.setenv("DGR2_MALLOC", "system")
    assert keep_freed_memory() is False
    monkeypatch.setenv("DGR2_MALLOC", "")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    assert keep_freed_memory() is False  # the user's malloc tunables win

import os

import pytest
import torch

# Tests share two cores with whatever else runs; one thread keeps timings predictable.
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_catalog(tmp_path_factory):
    """A small synthetic dataset in RecBole atomic format (deterministic)."""
    from candidate_gen.synthetic import SyntheticConfig, write_synthetic

    d = tmp_path_factory.mktemp("catalog")
    return write_synthetic(d, SyntheticConfig(n_users=300, seed=3), name="tiny")

"""The diffusion decoder's commit rules: the names and their one check.

Kept apart from forward.py (torch, transformers) so that a command-line parser can offer the
choices without importing a model library.
"""
from __future__ import annotations

COMMIT_RULES = ("confidence", "prefix")


def check_commit_rule(rule, name="commit rule") -> None:
    """The one check of a commit-rule setting; `name` is what the error calls it."""
    if rule not in COMMIT_RULES:
        raise ValueError(f"{name} must be one of {COMMIT_RULES}, got {rule!r}")

"""Result files under docs/results/ (every figure in the docs comes from one of these).

The code lives in candidate_gen.files, the shared I/O module, so that every layer can write a
result file; these names stay importable from here for the benchmark report.
"""
from candidate_gen.files import RESULTS_DIR, current_commit, read_results, write_result

__all__ = ["RESULTS_DIR", "current_commit", "read_results", "write_result"]

"""End-to-end pipeline, CLI, RecBole embedding and benchmark report."""

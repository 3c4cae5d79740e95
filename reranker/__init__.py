"""The generative reasoning re-ranker: semantic IDs, prompts, AR and block-diffusion LMs, training stages."""

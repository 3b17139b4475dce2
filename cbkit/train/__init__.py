"""cbkit's GRPO loop: config, one step's stages (batch, logprobs, objective), hooks, checkpoints."""

"""cbkit: continuous batching of GRPO rollouts, for teaching and for deciding between generate(), CB and vLLM."""

__version__ = "0.1.0"

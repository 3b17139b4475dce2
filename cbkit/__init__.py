"""cbkit: continuous batching of GRPO rollouts, for teaching and for deciding between generate(), CB and vLLM."""

__version__ = "0.1.0"

# The layers, bottom first: a module imports from its own layer or the ones below, never above
# (tests/test_layers.py checks every import; docs/ARCHITECTURE.md draws them).
LAYERS = (
    ("foundation", ("cbkit", "cbkit.jsonl", "cbkit.telemetry")),
    ("tasks", ("cbkit.tasks",)),
    ("models", ("cbkit.models",)),
    ("rollout", ("cbkit.rollout",)),
    ("train", ("cbkit.train",)),
    ("measure", ("cbkit.measure",)),
    ("trl", ("cbkit.trl",)),
    ("viz", ("cbkit.viz",)),
    ("teach", ("cbkit.teach",)),
    ("entry", ("cbkit.cli",)),
)

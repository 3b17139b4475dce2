"""What the notebooks call: set-up and tiers, a few figures, the live hook, the graded exercises."""

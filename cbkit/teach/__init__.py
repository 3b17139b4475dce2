"""What the notebooks call: set-up and tiers, printed findings, the recycling model, the demo."""

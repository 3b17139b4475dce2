"""Loading the policy: hub ids, local dirs, the offline SmolLM2, and models built in code for tests."""

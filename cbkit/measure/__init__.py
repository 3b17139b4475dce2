"""Measuring: length workloads, the N-sweep, its results file and tables, the probe, the planner, advice."""

"""Sizing a run: per-GPU totals, model states, pipeline stages, fit, sweeps and plots."""

"""Slipstream kernels."""

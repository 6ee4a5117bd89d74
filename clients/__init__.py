"""Slipstream clients."""

"""Slipstream scheduler."""

"""Slipstream service."""

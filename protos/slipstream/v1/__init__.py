"""Slipstream wire contract v1: stubs generated from ``inference.proto`` by
``protos/generate.py`` (``make protos``)."""

"""Runnable examples; tests import them as ``examples.<name>`` from the repository root."""

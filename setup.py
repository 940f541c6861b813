"""Build hook for the native data plane (C11); everything else is in pyproject.toml."""

from setuptools import setup

setup()

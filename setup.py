"""For tools that still run setup.py: everything (name, version, requirements) is in pyproject.toml."""
from setuptools import setup

setup()

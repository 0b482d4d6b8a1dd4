"""Shared builders of the test suite: reference numerics, tiny models, checkpoints and the spawn harness.

Import as ``from tests.helpers.<module> import <name>``; test files never import from each other.
"""

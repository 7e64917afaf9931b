"""Helpers shared by the tests (not fixtures: those live in conftest.py files)."""

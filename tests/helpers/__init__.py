"""Helpers shared by the test modules (no test module imports another)."""

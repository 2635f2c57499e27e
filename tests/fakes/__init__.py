"""Test doubles shared by the test modules (one of each)."""

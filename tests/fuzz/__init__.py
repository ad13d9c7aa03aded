"""Fuzzing harnesses for cdmlfs's parsers (shared by tests/test_fuzz*.py and scripts/fuzz.py)."""

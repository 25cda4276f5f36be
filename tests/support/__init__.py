"""Helpers and fakes shared by the test files: tiny checkpoints, tolerances, fake engines and servers, the CLI runner.
A test file imports from here, never from another test file (tests/test_layering.py)."""

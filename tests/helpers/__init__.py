"""Builders and references shared by the tests (imported as ``tests.helpers.<module>``)."""

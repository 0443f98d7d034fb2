"""Tests of `codegen`."""

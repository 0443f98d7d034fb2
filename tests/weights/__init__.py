"""Tests of `weights`."""

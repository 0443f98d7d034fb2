"""Tests of `ref`."""

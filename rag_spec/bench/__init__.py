"""Benchmarks: interleaved runs against the peers, JSON and PNG reports."""

"""Benchmarks for unified_amp: AMP throughput, peak memory and unified-vs-native overhead.

Run ``python -m benchmarks.bench --help``; the backend is ``UNIFIED_AMP_BACKEND``.
"""

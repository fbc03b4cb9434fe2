"""Benchmarks for unified_amp: AMP throughput, peak memory, and unified-vs-native overhead.

One entry point: ``python -m benchmarks <name>`` (``python -m benchmarks`` lists the
names); the backend is ``UNIFIED_AMP_BACKEND``. docs/BENCHMARKS.md says how.
"""

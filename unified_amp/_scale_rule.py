"""The scale rule's path before ``scaler/`` was a package (benchmarks/host_cost_parts.py
imports it from here); the rule is ``unified_amp/scaler/_scale_rule.py``."""

from .scaler._scale_rule import next_scale

__all__ = ["next_scale"]

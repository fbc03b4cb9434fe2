"""The expression an overflow report's hint names a module by, for
``amp.keep_float32(...)``: a leaf, so that the report (forensics.py) needs nothing of
pinning.py, which imports autocast."""

from __future__ import annotations

__all__: list[str] = []


def pin_expression(dotted: str) -> str:
    """``model.encoder.layers[3]`` for the dotted module name ``encoder.layers.3``."""
    expr = "model"
    for part in dotted.split(".") if dotted else ():
        if part.isdigit():
            expr += f"[{part}]"
        elif part.isidentifier():
            expr += f".{part}"
        else:
            expr += f"[{part!r}]"
    return expr

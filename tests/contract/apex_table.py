"""What each apex opt level does to dtypes, as data. docs/APEX.md shows the same table
(a test keeps the two in step); test_opt_levels_contract.py checks every cell on every
backend and device.

A cell is the dtype on every backend, or "X (MegEngine: Y)" where MegEngine differs.
"low" is the run's low precision (``amp.opt_properties().low_dtype``); "none" means no
master weights (the optimizer steps the model's own).
"""

COLUMNS = (
    "weights",
    "batch norm weights",
    "master weights",
    "inputs in the model",
    "activations",
    "batch norm output",
    "model output",
    "weight gradients",
    "gradients the optimizer uses",
    "loss scale",
)

TABLE = {
    "O0": ("float32", "float32", "none", "float32", "float32", "float32", "float32",
           "float32", "float32", "off"),
    "O1": ("float32", "float32", "none", "float32", "low", "low", "float32", "float32",
           "float32", "dynamic"),
    "O2": ("low", "float32", "float32", "low", "low", "low", "float32", "low", "float32",
           "dynamic"),
    "O3": ("low", "low (MegEngine: float32)", "none (MegEngine: float32)", "low", "low",
           "low", "float32", "low", "low (MegEngine: float32)",
           "off (MegEngine: 1.0, checked)"),
}


def expected(level, column, backend):
    """The cell for ``backend``, with its MegEngine exception applied."""
    cell = TABLE[level][COLUMNS.index(column)]
    if " (MegEngine: " in cell:
        common, megengine = cell.split(" (MegEngine: ")
        return megengine.rstrip(")") if backend == "megengine" else common
    return cell

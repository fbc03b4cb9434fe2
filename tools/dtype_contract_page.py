"""docs/DTYPE_CONTRACT.md's table, written from unified_amp/dtype_contract/.

Only the text between the page's table markers is generated; the prose around it is
written by hand. tests/contract/test_dtype_table.py checks that the page holds what this
writes. Framework-free: it reads the table only.

Usage: python tools/dtype_contract_page.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from unified_amp.dtype_contract import ROWS, Row, pairing  # noqa: E402

DOC = ROOT / "docs" / "DTYPE_CONTRACT.md"
BEGIN = "<!-- table:begin: written by tools/dtype_contract_page.py from unified_amp/dtype_contract/ -->"
END = "<!-- table:end -->"
GROUPS = {
    "matmul": "Matmuls", "convolution": "Convolutions", "recurrent": "Recurrent cells",
    "attention": "Attention", "elementwise": "Elementwise math", "activation": "Activations",
    "reduction": "Reductions", "norm": "Norms and distances", "pool": "Pooling",
    "resample": "Resampling", "pad": "Padding", "loss": "Losses", "indexing": "Indexing and joining",
    "linalg": "Linear algebra", "spectral": "Spectral and complex",
    "quantization": "Quantization",
}
CELLS = {"low": ("low", "low"), "float32": ("float32", "float32"),
         "input": ("float32", "low"), "promote": ("float32", "low"),
         "refuse": ("error", "error")}


def _code(names: tuple[str, ...]) -> str:
    return ", ".join(f"`{n}`" for n in names)


def _notes(r: Row) -> str:
    notes = []
    if r.torch_since:
        notes.append(f"From torch {r.torch_since} on; earlier torches lack the op (the tests"
                     " check that they do).")
    if r.rule == "promote":
        notes.append("mixed float32/low inputs: float32.")
    if r.reason:
        notes.append(r.reason)
    if r.refuse_low:
        notes.append("A low-precision input is refused on every device, one outcome"
                     " everywhere: torch's CUDA kernels take none (torch raises there, with"
                     " autocast or without: checked on fake CUDA), and the adapters raise"
                     " the contract's error on the CPU and on MegEngine, which names the"
                     " fix (cast the input to float32).")
    elif not r.sample.cuda_low:
        notes.append("torch's CUDA kernels take no low-precision input (torch raises there,"
                     " with autocast or without): the CUDA cell is checked with a float32"
                     " input.")
    if r.sample.no_bfloat16:
        notes.append("bfloat16 input: an error everywhere (no complex bfloat16 dtype).")
    if r.adapt.compiled:
        notes.append(f"Under torch.compile: {r.adapt.compiled}")
    own = [sp for sp in r.torch if sp in pairing.COMPILED_OWN]
    if own:
        notes.append("Under torch.compile on the CPU, a low-precision input to "
                     + ", ".join(f"`{sp}`" for sp in own)
                     + " keeps torch's CPU autocast (pairing.COMPILED_OWN says why).")
    if r.sample.fake_cuda:
        notes.append(f"Not checked on fake CUDA: {r.sample.fake_cuda}.")
    return " ".join(notes)


def _row(r: Row) -> str:
    f32, low = CELLS[r.rule]
    if r.refuse_low:
        low = "error"
    megengine = _code(r.megengine) if r.sample.megengine else "absent"
    own_megengine = r.native("megengine") if r.sample.megengine else ""
    cells = [f"`{r.name}`", r.rule, f32, low, r.native("torch-cpu"), own_megengine,
             _code(r.aten) or "(none)", megengine, _notes(r)]
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def table_section() -> str:
    """The generated part of the page, markers included."""
    head = ("| op class | rule | float32 input | low input | torch.autocast on CPU alone"
            " | megengine.amp alone | torch ops (Autocast registrations) | MegEngine |"
            " notes |\n|---|---|---|---|---|---|---|---|---|")
    parts = [BEGIN, ""]
    for group, title in GROUPS.items():
        rows = [r for r in ROWS if r.group == group]
        if not rows:
            continue
        parts += [f"### {title}", "", head, *(_row(r) for r in rows), ""]
    missing = {r.group for r in ROWS} - set(GROUPS)
    assert not missing, f"rows in groups without a title: {missing}"
    parts.append(END)
    return "\n".join(parts)


def main() -> int:
    text = DOC.read_text()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    DOC.write_text(text[:start] + table_section() + text[end:])
    print(f"wrote {DOC.relative_to(ROOT)}: {len(ROWS)} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

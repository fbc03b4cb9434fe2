"""docs/INTEGRATIONS.md's tables ("Works with", "Real models") name the versions the
runner and real-model tests run on."""

import re

from . import pins


PAGE = pins.ROOT / "docs" / "INTEGRATIONS.md"


def works_with_rows():
    text = PAGE.read_text()
    table = text.split("## Works with", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| [^|]+ \| `([\w.-]+)` ([\w.]+) \| (torch|MegEngine) \|", table, re.M)


def test_works_with_table_matches_the_constraints_files():
    rows = works_with_rows()
    assert len(rows) == 6, rows
    for distribution, version, backend in rows:
        framework = backend.lower()
        assert pins.pinned(framework).get(pins._norm(distribution)) == version, \
            (distribution, version, framework)


def test_real_models_table_matches_the_constraints_file():
    text = PAGE.read_text()
    table = text.split("### Real models", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| [^|]+ \| `([\w.-]+)` ([\w.]+):", table, re.M)
    assert [d for d, _ in rows] == ["torchvision", "timm", "transformers"], rows
    for distribution, version in rows:
        assert pins.pinned("models").get(pins._norm(distribution)) == version, \
            (distribution, version)

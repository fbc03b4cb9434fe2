"""The README's "Works with" table names the versions the runner tests run on."""

import re

from . import pins


def works_with_rows():
    text = (pins.ROOT / "README.md").read_text()
    table = text.split("## Works with", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| [^|]+ \| `([\w.-]+)` ([\w.]+) \| (torch|MegEngine) \|", table, re.M)


def test_readme_table_matches_the_constraints_files():
    rows = works_with_rows()
    assert len(rows) == 6, rows
    for distribution, version, backend in rows:
        framework = backend.lower()
        assert pins.pinned(framework).get(pins._norm(distribution)) == version, \
            (distribution, version, framework)

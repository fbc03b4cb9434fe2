"""DROP_IN.md's table of deliberate differences is what the scaler fuzzes read; these
keep it well-formed, so that a row the fuzz could never match does not pass for a
listed difference."""

from .scaler_fuzz_common import HEADING, DROP_IN, differences

# The numbers part on purpose: the fuzzes detect these by their situation, by id.
NUMERIC = {"fused-sgd-first-skip", "auto-accumulation-true-sum"}


def test_the_table_is_there_and_each_row_can_be_matched():
    table = differences()
    assert len(table) >= 8, f"{DROP_IN}: {HEADING!r} lists only {sorted(table)}"
    for d in table.values():
        assert d.framework in ("torch", "megengine", "both"), d
        assert d.refuses in ("ours", "native", "neither"), d
        if d.refuses == "neither":
            assert d.id in NUMERIC and not d.fragment, d
        else:
            assert len(d.fragment) >= 15, f"{d.id}: quote a distinctive piece of the message"


def test_no_fragment_matches_a_refusal_of_the_other_side():
    """A fragment names one side's message: the same text listed for both sides would
    let either side's refusal through."""
    table = differences()
    for a in table.values():
        for b in table.values():
            if a.refuses != b.refuses and a.fragment and b.fragment:
                assert a.fragment not in b.fragment and b.fragment not in a.fragment, (a, b)

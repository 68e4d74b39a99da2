"""The counts the README and the docs state about the shipped suites are the suites' own.

A number typed into a page goes stale when a case is added (the README said 36 case files
long after the ``hard`` suite had 45).  Each sentence that states a count is found here by
its words and compared with the count computed from ``refimpl/oracle/suites/``: a new case
fails this test, whose message says which page and line to update.
"""
import re
from pathlib import Path

import pytest

from refimpl.oracle.suite import load_suite

ROOT = Path(__file__).resolve().parent.parent
HARD = load_suite("hard")
FILES, CASES = len(HARD), len({spec.name for spec in HARD})
RANKS = sorted({spec.ranks for spec in HARD})

#: (page, pattern with named groups, {group: the count it must state})
STATEMENTS = [
    ("README.md", r"# (?P<files>\d+) HDF5 case files: (?P<cases>\d+) layer cases x grids of (?P<lo>\d+)-(?P<hi>\d+) ranks",
     {"files": FILES, "cases": CASES, "lo": RANKS[0], "hi": RANKS[-1]}),
    ("docs/oracle.md", r"has (?P<cases>\d+) cases on (?P<files>\d+) grids of (?P<lo>\d+) to\s+(?P<hi>\d+)",
     {"files": FILES, "cases": CASES, "lo": RANKS[0], "hi": RANKS[-1]}),
    ("docs/oracle.md", r"Three of the `hard` suite's (?P<files>\d+) cases", {"files": FILES}),
    ("docs/peers.md", r"The (?P<files>\d+) case files of the shipped `hard` suite, (?P<lo>\d+) to (?P<hi>\d+) ranks",
     {"files": FILES, "lo": RANKS[0], "hi": RANKS[-1]}),
]


@pytest.mark.parametrize("page, pattern, want", STATEMENTS, ids=[f"{p}:{w}" for p, _, w in STATEMENTS])
def test_a_stated_suite_count_is_the_suites(page, pattern, want):
    text = (ROOT / page).read_text()
    match = re.search(pattern, text)
    assert match, f"{page}: the sentence /{pattern}/ is gone; update STATEMENTS in {__file__} with its new words"
    line = text[:match.start()].count("\n") + 1
    got = {k: int(v) for k, v in match.groupdict().items()}
    assert got == want, (f"{page}:{line} states {got}, the shipped hard suite has {want} "
                         f"(refimpl oracle generate hard writes {FILES} files): update the page")

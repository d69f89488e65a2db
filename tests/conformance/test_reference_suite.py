"""The conformance suite against the reference backend (plain `pytest` runs it on CPU).

`pytest --kvio-backend NAME tests/conformance/test_reference_suite.py` points the same
classes at another backend.
"""

from kvcore.testing.suite import (  # noqa: F401 - collected by pytest
    TestBadInputs,
    TestDtypesAndIndices,
    TestElementSizes,
    TestHostMemory,
    TestPageCounts,
    TestRandomised,
    TestRoundTrip,
)

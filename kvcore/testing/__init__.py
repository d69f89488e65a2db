"""kvcore.testing: the conformance suite every backend runs, shipped as a pytest plugin.

``pytest --kvio-backend NAME`` (the plugin is registered through the ``pytest11`` entry point)
or ``kvio check NAME`` runs every case the backend's capabilities claim, differentially
against the reference backend: fresh random data, poisoned destinations, untouched
neighbours checked, index placement checked against the declared residency, bad inputs
refused with typed errors. See docs/writing-a-backend.md.

Modules: :mod:`~kvcore.testing.cases` (what a case is, which cases a claim calls for),
:mod:`~kvcore.testing.harness` (running and judging one case), :mod:`~kvcore.testing.suite`
(the test classes, to subclass), :mod:`~kvcore.testing.plugin` (the pytest plugin),
:mod:`~kvcore.testing.runner` (``pytest.main`` with a per-row result matrix),
:mod:`~kvcore.testing.recording` (observing what ``run()`` receives),
:mod:`~kvcore.testing.stand_in_streams` (the GPU's submit path on the CPU, for a library
emulated there).
"""

"""The plugin contract. A kvcore backend plugin is a module that implements this one hook.

Register the module under the ``kvcore.backends`` entry-point group in the plugin's
``pyproject.toml``::

    [project.entry-points."kvcore.backends"]
    mybackend = "kvio_mybackend"

and implement the hook with the marker re-exported from ``kvcore``::

    import kvcore

    @kvcore.hookimpl
    def kvcore_register_backends(register):
        register(kvcore.BackendSpec(capabilities=CAPS, factory=make_backend))

Keep the module light: importing it and calling the hook must not load native code or touch a
device. The :class:`~kvcore.capabilities.Capabilities` record is static metadata and the
availability probe runs only when someone asks; ``factory`` runs only when a plan needs the
backend. See docs/writing-a-backend.md for the whole walk-through.
"""

from __future__ import annotations

from collections.abc import Callable

import pluggy

from kvcore.capabilities import BackendSpec

PROJECT = "kvcore"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def kvcore_register_backends(register: Callable[[BackendSpec], None]) -> None:
    """Register zero or more backends by calling ``register(spec)`` once per backend.

    Called once per plugin at discovery. ``spec.capabilities.api_version`` must equal
    :data:`kvcore.capabilities.API_VERSION`; a backend built for another version is refused
    with a message naming it. Raising here marks the whole plugin as broken: it is reported
    by ``kvio backends`` and skipped (fatal under ``KVCORE_STRICT=1``).
    """

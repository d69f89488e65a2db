"""Typed errors. Every refusal kvcore makes is one of these.

Messages name the argument or tensor, what was expected and what was given, and where it
matters the backend and operation, e.g.::

    host_indices: expected int64 on cpu for cuda/page_first write_back, got int64 on cuda:0
"""

from __future__ import annotations

from typing import Any

#: what to install when kvcore finds no backend at all
REFERENCE_HINT = ("kvio-reference, the pure-torch backend for any device, is not installed: "
                  "install it (its wheel from scripts/build_wheels.sh, or from a checkout pip "
                  "install -e plugins/kvio_reference)")

NO_PLUGIN_HINT = ("kvcore alone has no backend; install kvio-reference (pure torch, any device, "
                  "the oracle) and the plugin of your GPU, kvio-cuda (NVIDIA) or kvio-rocm "
                  "(AMD); from a checkout: pip install -e plugins/kvio_reference")


class KVCoreError(Exception):
    """Base class of every error kvcore raises on purpose."""


class InvalidArgument(KVCoreError, ValueError):
    """An argument (a tensor, an index set, an option) is not acceptable.

    ``argument`` names it, ``expected`` and ``got`` say what was wanted and what came.
    """

    def __init__(self, argument: str, expected: str, got: str, context: str = "") -> None:
        self.argument = argument
        self.expected = expected
        self.got = got
        self.context = context
        where = f" for {context}" if context else ""
        super().__init__(f"{argument}: expected {expected}{where}, got {got}")


class TensorMismatch(InvalidArgument):
    """A tensor has the wrong dtype, device, shape, stride or alignment."""


class InvalidGeometry(InvalidArgument):
    """A host pool's sizes do not fit its layout (e.g. a head_group_num that does not divide
    head_num, or a head group row off the layout's alignment); the message says what to use."""


class InvalidIndices(InvalidArgument):
    """Index values are out of range, not page-aligned, duplicated or mismatched."""


class UnsupportedCombination(KVCoreError, ValueError):
    """An (op, kind, layout) combination that does not exist, or that no rule allows."""


class NoBackend(KVCoreError, LookupError):
    """No backend can serve a request. ``reasons`` maps each candidate to why it was refused."""

    def __init__(self, request: str, reasons: dict[str, str],
                 without_reference: bool = False) -> None:
        self.request = request
        self.reasons = dict(reasons)
        lines = [f"no backend can serve {request}"]
        if not reasons:
            lines.append(f"  (no backends are registered: {NO_PLUGIN_HINT})")
        lines += [f"  {name}: {why}" for name, why in sorted(reasons.items())]
        if reasons and without_reference:  # (other plugins are, and none of them serves it)
            lines.append(f"  ({REFERENCE_HINT})")
        super().__init__("\n".join(lines))


class PluginLoadError(KVCoreError, ImportError):
    """A plugin could not be imported or registered (fatal only when asked for or strict).

    ``plugin_traceback`` holds the plugin's own traceback where there is one (the message
    stays one line; ``kvio`` prints the traceback under KVCORE_STRICT=1).
    """

    def __init__(self, message: str, plugin_traceback: str | None = None) -> None:
        super().__init__(message)
        self.plugin_traceback = plugin_traceback


class MissingDependency(KVCoreError, ImportError):
    """An optional dependency a command needs is not installed (the message says which)."""


class ApiVersionMismatch(PluginLoadError):
    """A backend was built for another kvcore API version."""

    def __init__(self, backend: str, backend_version: str, got: int, expected: int) -> None:
        self.backend = backend
        super().__init__(
            f"backend {backend!r} (version {backend_version}) declares kvcore API version {got}, "
            f"expected API version {expected}; upgrade or downgrade the plugin (its author "
            "declares api_version=kvcore.API_VERSION of the kvcore it was built against)"
        )


class BackendUnavailable(KVCoreError, RuntimeError):
    """A backend was asked for by name but cannot run on this machine."""


class AllocatorError(KVCoreError, RuntimeError):
    """Host slot allocation failed: out of slots, double allocation or double free."""


class BuildError(KVCoreError, RuntimeError):
    """A native kernel library could not be built (compiler missing, too old, or failing)."""


class KernelError(KVCoreError, RuntimeError):
    """A native runtime call or kernel launch returned an error code."""

    def __init__(self, message: str, code: int | None = None) -> None:
        self.code = code
        super().__init__(message)


class DeviceFault(KernelError):
    """The device reported an error after which it cannot be trusted (a sticky fault)."""


class ContractViolation(KVCoreError, TypeError):
    """A backend answered a job with something its declared capabilities rule out."""


class TransferFailed(KVCoreError, RuntimeError):
    """A transfer did not complete. Its host pages were released; nothing was acknowledged."""

    def __init__(self, message: str, cause: BaseException | None = None) -> None:
        self.cause = cause
        super().__init__(message)


class ControllerUnusable(KVCoreError, RuntimeError):
    """The controller hit an error it cannot recover from (for example the device is lost)."""


class PlanMismatch(KVCoreError, RuntimeError):
    """Tensor-parallel ranks resolved different plans."""

    def __init__(self, message: str, differences: Any = None) -> None:
        self.differences = differences
        super().__init__(message)


class RanksFailed(PlanMismatch):
    """Agreement across ranks (on plans, or on acknowledgements) could not complete: a peer
    rank failed before it, never arrived, or stopped taking part.

    ``failed`` maps each failed rank to its error; ``missing`` lists ranks that did not answer.
    """

    def __init__(self, message: str, failed: dict[int, str], missing: list[int]) -> None:
        self.failed = dict(failed)
        self.missing = list(missing)
        super().__init__(message, {"failed": self.failed, "missing": self.missing})

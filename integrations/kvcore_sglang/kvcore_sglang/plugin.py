"""SGLang's plugin entry point: AROUND hooks on the host pools' two transfer methods.

SGLang 0.5.23 loads entry points of the group ``sglang.srt.plugins`` (allow-list:
``SGLANG_PLUGINS``) in every process with ``sglang.srt.plugins.load_plugins()``, runs them,
then applies the hooks they registered with ``HookRegistry``. :func:`register` is that entry
point. Each hook checks that the pool is exactly the class it was registered on (a subclass
may lay its buffers out differently), then hands over to :mod:`kvcore_sglang.hooks`.
"""

from __future__ import annotations

import logging
import pkgutil
from collections.abc import Callable
from typing import Any

from kvcore_sglang.switch import enabled

# (kvcore is imported by register(), once the switch is read: a server without kvcore then
# gets one warning, and KVCORE_SGLANG=off silences even that)

logger = logging.getLogger("kvcore_sglang")

MHA_HOST = "sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost"
MLA_HOST = "sglang.srt.mem_cache.pool_host.mla.MLATokenToKVPoolHost"
BACKUP = "backup_from_device_all_layer"
LOAD = "load_to_device_per_layer"

#: every hook target, with the kvcore kind (``Kind`` value) of its pool
TARGETS: dict[str, str] = {
    f"{MHA_HOST}.{BACKUP}": "mha",
    f"{MHA_HOST}.{LOAD}": "mha",
    f"{MLA_HOST}.{BACKUP}": "mla",
    f"{MLA_HOST}.{LOAD}": "mla",
}

_classes: dict[str, type] = {}


def _pool_class(path: str) -> type:
    cls = _classes.get(path)
    if cls is None:
        cls = _classes[path] = pkgutil.resolve_name(path)
    return cls


def make_hook(target: str) -> Callable[..., Any]:
    """The AROUND hook for ``target`` (one of :data:`TARGETS`)."""
    from kvcore import Kind
    from kvcore_sglang import hooks

    kind = Kind(TARGETS[target])
    cls_path, method = target.rsplit(".", 1)
    body = hooks.backup_from_device_all_layer if method == BACKUP else \
        hooks.load_to_device_per_layer

    def hook(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
        cls = _pool_class(cls_path)
        if type(self) is not cls:
            hooks._log_once(logging.INFO, f"kvcore-sglang: {method} runs SGLang's own kernel: "
                                          f"host pool class {type(self).__qualname__} is not "
                                          f"{cls.__qualname__}")
            return original(self, *args, **kwargs)
        return body(original, kind, self, *args, **kwargs)

    hook.__qualname__ = hook.__name__ = f"kvcore_{kind.value}_{method}"
    return hook


def register() -> None:
    """Entry point (``sglang.srt.plugins``: ``kvcore``): register the AROUND hooks."""
    if not enabled():
        logger.info("kvcore-sglang: off (KVCORE_SGLANG); SGLang moves HiCache pages itself")
        return
    try:
        import kvcore_sglang.hooks  # noqa: F401 (kvcore and torch: here, not at import)
    except ImportError as exc:
        logger.warning("kvcore-sglang: kvcore cannot be imported (%s: %s); SGLang moves HiCache "
                       "pages itself. Install kvcore and a backend plugin (kvio-reference, "
                       "kvio-cuda or kvio-rocm), or set KVCORE_SGLANG=off",
                       type(exc).__name__, exc)
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target in TARGETS:
        HookRegistry.register(target, make_hook(target), HookType.AROUND)
    logger.info("kvcore-sglang: HiCache host<->device transfers of MHATokenToKVPoolHost and "
                "MLATokenToKVPoolHost go through kvcore where it models the pool")

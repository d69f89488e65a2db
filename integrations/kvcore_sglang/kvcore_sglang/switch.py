"""``KVCORE_SGLANG``, the plugin's off switch, read without importing kvcore: it must work
where kvcore itself cannot be imported."""

from __future__ import annotations

import os
from typing import Any

#: ``KVCORE_SGLANG`` values that turn the plugin off, and those that leave it on (as unset)
OFF_VALUES = frozenset({"off", "0", "false", "no"})
ON_VALUES = frozenset({"", "on", "1", "true", "yes"})


def enabled(environ: Any = None) -> bool:
    """False when ``KVCORE_SGLANG`` is off/0/false/no, True when unset or on/1/true/yes (read
    when the plugin registers); any other value is refused with InvalidArgument naming the
    variable (a misspelt "off" left the plugin on without a word)."""
    env = os.environ if environ is None else environ
    value = env.get("KVCORE_SGLANG", "").strip().lower()
    if value in OFF_VALUES:
        return False
    if value in ON_VALUES:
        return True
    from kvcore.errors import InvalidArgument  # (the switch said neither: kvcore is needed)

    raise InvalidArgument("KVCORE_SGLANG", "off, 0, false or no (or on, 1, true, yes; unset "
                                           "is on)", repr(env.get("KVCORE_SGLANG")))

"""kvcore-sglang: SGLang's HiCache moves its pages through kvcore, by SGLang's plugin hooks.

Install it next to SGLang (``pip install kvcore-sglang``); SGLang's plugin loader finds the
``sglang.srt.plugins`` entry point ``kvcore`` and :func:`kvcore_sglang.plugin.register` wraps
the host pools' transfer methods. The hook bodies in :mod:`kvcore_sglang.hooks` import no
SGLang. ``KVCORE_SGLANG=off`` (or leaving ``kvcore`` out of ``SGLANG_PLUGINS``) turns it off.
"""

__version__ = "0.1.0"

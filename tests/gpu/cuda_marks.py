"""The marks of a test module that needs kvio_cuda: skipped, with the reason, elsewhere."""

from __future__ import annotations

import pytest
import torch

from kvcore.registry import default_registry


def cuda_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        return bool(default_registry().availability("cuda"))
    except Exception:  # noqa: BLE001 - not installed: skip with the reason below
        return False


def needs_kvio_cuda(device: torch.device) -> list[pytest.MarkDecorator]:
    return [pytest.mark.gpu,
            pytest.mark.skipif(not cuda_available(device),
                               reason=f"kvio_cuda is not available on {device} "
                                      "(see `kvio backends`)")]

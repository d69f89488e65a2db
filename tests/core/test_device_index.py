"""A device named without an index ("cuda") means the current device, everywhere.

Tensors always report an indexed device, so a request or backend instance for ``cuda`` must
become ``cuda:N`` or a backend comparing its device with a pool's refuses a valid pool.
"""

from __future__ import annotations

import pytest
import torch

from kvcore.layout import Kind, Layout, Op
from kvcore.registry import REFERENCE, default_registry, make_request
from kvcore.streams import resolve_device


@pytest.fixture
def current_cuda_is_3(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)


def test_cpu_and_indexed_devices_are_kept() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cuda", 1)) == torch.device("cuda", 1)


def test_an_index_less_accelerator_becomes_the_current_device(current_cuda_is_3: None) -> None:
    assert resolve_device("cuda") == torch.device("cuda", 3)
    assert resolve_device(torch.device("cuda")) == torch.device("cuda", 3)


def test_a_device_type_that_cannot_answer_is_returned_as_given(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def no_driver() -> int:
        raise RuntimeError("no CUDA driver")

    monkeypatch.setattr(torch.cuda, "current_device", no_driver)
    assert resolve_device("cuda") == torch.device("cuda")


def test_requests_and_instances_use_the_indexed_device(current_cuda_is_3: None) -> None:
    req = make_request(Op.WRITE_BACK, Kind.MHA, Layout.PAGE_FIRST, torch.bfloat16, 256, "cuda")
    assert req.device == torch.device("cuda", 3)
    with default_registry().isolated() as reg:
        plain = reg.instance(REFERENCE, torch.device("cuda"))
        assert plain is reg.instance(REFERENCE, torch.device("cuda", 3))
        assert plain.device == torch.device("cuda", 3)  # type: ignore[attr-defined]

"""CPU index tensors whose values were checked are not checked again while unmodified: the
memory (kvcore.validate.CheckedTensors) and what a bound plan makes of it (an engine that
submits each layer of a load with the same tensors pays for the value checks once)."""

from __future__ import annotations

import gc

import pytest
import torch

from kvcore import validate
from kvcore.errors import InvalidIndices
from kvcore.layout import Kind, Layout, Op
from kvcore.plan import BoundPlan
from kvcore.registry import make_request
from kvcore.validate import CheckedTensors

from .helpers import make_pools, page_tokens, reference_only

P = 4


def test_a_remembered_tensor_counts_while_it_holds_the_same_values() -> None:
    seen = CheckedTensors()
    t = torch.arange(8)
    assert t not in seen
    seen.add(t)
    assert t in seen
    assert torch.arange(8) not in seen  # equal values, another tensor
    t[0] = 5
    assert t not in seen
    seen.add(t)
    t.numpy()[1] = 7  # a write torch's version counter does not see
    assert t not in seen
    seen.add(t)
    t.add_(1)
    t.sub_(1)  # written twice, back to the values remembered
    assert t in seen
    t.set_(torch.arange(8) * 2)  # the same object, other memory and values
    assert t not in seen
    seen.add(t)
    t.data = t.to(torch.int32)  # same values, another dtype
    assert t not in seen
    assert [1, 2] not in seen and None not in seen
    seen.add(t)
    t.resize_(2)  # fewer bytes than remembered: compared by size first, never read past
    assert t not in seen
    seen.add(t)
    t.resize_(4)  # more (the first two the same)
    assert t not in seen


def test_a_tensor_remembered_with_the_array_it_was_made_from_is_judged_the_same_way() -> None:
    """``add(t, values)`` (the allocator's tensors) reads the array instead of converting
    ``t`` while ``t`` still uses that memory as it did; any other layout falls back."""
    import numpy as np

    seen = CheckedTensors()
    values = np.arange(8, dtype=np.int64)
    t = torch.from_numpy(values)
    seen.add(t, values)
    assert t in seen
    t[0] = 5  # through torch
    assert t not in seen
    t[0] = 0
    assert t in seen
    values[3] = 9  # through the array itself
    assert t not in seen
    values[3] = 3
    t.numpy()[7] = 1  # through another NumPy view
    assert t not in seen
    t.numpy()[7] = 7
    assert t in seen
    t.set_(torch.arange(8))  # other memory, the same values: compared as any tensor
    assert t in seen
    t.set_(torch.arange(8) * 3)  # other memory and values
    assert t not in seen
    u_values = np.arange(8, dtype=np.int64)
    u = torch.from_numpy(u_values)
    seen.add(u, u_values)
    u.as_strided_((4,), (2,))  # the same address, another layout of it
    assert u not in seen
    del u
    gc.collect()
    assert len(seen) == 1  # the array does not keep its tensor's entry alive


def test_match_hands_back_the_proof_add_gave_while_the_tensor_holds_its_values() -> None:
    """The proof is what the index ring stages under: the same object while the values
    hold, None once they changed, and a new object once they are remembered again."""
    seen = CheckedTensors()
    t = torch.randint(0, 1 << 20, (64,), generator=torch.Generator().manual_seed(5))
    kept = seen.add(t)
    assert kept is not None and kept
    assert seen.match(t) is kept and seen.match(t) is kept
    t.numpy()[63] += 1  # the last element, through NumPy
    assert seen.match(t) is None
    again = seen.add(t)
    assert again is not kept and seen.match(t) is again
    other = torch.empty_like(t).copy_(t)
    t.set_(other)  # other memory with the same values: still the same values
    assert seen.match(t) is again
    other[0] += 1
    assert seen.match(t) is None
    assert seen.match(torch.arange(4)) is None and seen.match("t") is None


def test_an_empty_or_strided_tensor_is_remembered_too() -> None:
    seen = CheckedTensors()
    empty = torch.arange(0)
    kept = seen.add(empty)
    assert seen.match(empty) is kept and empty in seen
    whole = torch.arange(16)
    strided = whole[::2]
    kept = seen.add(strided)
    assert seen.match(strided) is kept
    whole[1] = 99  # between its elements: not its values
    assert seen.match(strided) is kept
    whole[2] = 99  # its second element
    assert seen.match(strided) is None


def test_a_tensor_that_is_gone_is_forgotten_and_its_id_never_vouches_for_another() -> None:
    seen = CheckedTensors()
    t = torch.arange(8)
    seen.add(t)
    del t
    gc.collect()
    assert len(seen) == 0
    for _ in range(50):  # ids are reused: none of these was checked
        assert torch.arange(8) not in seen


def test_a_bounded_memory_forgets_the_oldest_first() -> None:
    seen = CheckedTensors(capacity=2)
    a, b, c = torch.arange(4), torch.arange(4), torch.arange(4)
    seen.add(a)
    seen.add(b)
    seen.add(c)
    assert a not in seen and b in seen and c in seen
    seen.add(b)  # again: now the newest
    seen.add(a)
    assert c not in seen and b in seen and a in seen


def _bound(op: Op) -> BoundPlan:
    reg = reference_only()
    dev, host = make_pools(Kind.MHA, Layout.LAYER_FIRST, num_layers=3, host_pages=8,
                           device_size=8 * P, head_num=2, head_dim=16, page_size=P,
                           dtype=torch.bfloat16, registry=reg)
    plan = reg.resolve(make_request(op, Kind.MHA, Layout.LAYER_FIRST, torch.bfloat16,
                                    dev.element_bytes, "cpu"))
    return plan.bind(dev, host)


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The argument names check_cpu_indices is called for, in order."""
    calls: list[str] = []
    real = validate.check_cpu_indices

    def spy(name: str, *args: object, **kwargs: object) -> None:
        calls.append(name)
        real(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr("kvcore.plan.check_cpu_indices", spy)
    return calls


def test_each_layer_of_a_load_submitted_alone_checks_the_cpu_indices_once(
        checks: list[str]) -> None:
    bound = _bound(Op.LOAD_LAYER)
    h, d = page_tokens([5, 2], P), page_tokens([1, 6], P)
    for layer in range(3):
        bound.submit(h, d, layer=layer, chained=layer > 0)
    assert checks == ["host_indices", "device_indices"]
    bound.submit(h.clone(), d, layer=0)  # equal values, another tensor: checked
    assert checks[2:] == ["host_indices"]


def test_a_checked_tensor_changed_in_place_is_checked_again_and_refused(
        checks: list[str]) -> None:
    bound = _bound(Op.LOAD_LAYER)
    h, d = page_tokens([5, 2], P), page_tokens([1, 6], P)
    bound.submit(h, d, layer=0)
    h.numpy()[0] = 8 * P + 3  # out of the host pool, behind torch's back
    with pytest.raises(InvalidIndices, match="host_indices"):
        bound.submit(h, d, layer=1)
    h[0] = 5 * P
    bound.submit(h, d, layer=1)
    d[1] = d[0]  # two tokens into one device slot
    with pytest.raises(InvalidIndices, match=r"device_indices.*more than once"):
        bound.submit(page_tokens([5, 2], P), d, layer=1)
    # h back to the values checked first needs no check; the new host tensor does
    assert checks.count("device_indices") == 2 and checks.count("host_indices") == 3


def test_checked_as_host_indices_is_not_checked_as_device_indices(checks: list[str]) -> None:
    bound = _bound(Op.LOAD_LAYER)
    t = page_tokens([1, 2], P)
    bound.check(t, page_tokens([3, 4], P))
    bound.check(page_tokens([5, 6], P), t)  # the device role has its own bounds and rules
    assert checks == ["host_indices", "device_indices", "host_indices", "device_indices"]


def test_a_write_back_remembers_user_host_indices_but_refuses_their_duplicates_first(
        checks: list[str]) -> None:
    bound = _bound(Op.WRITE_BACK)
    h = torch.cat([page_tokens([3], P), page_tokens([3], P)])
    with pytest.raises(InvalidIndices, match="host_indices"):
        bound.check(h, page_tokens([1, 2], P))
    with pytest.raises(InvalidIndices, match="host_indices"):  # a refused one is not kept
        bound.check(h, page_tokens([1, 2], P))
    assert checks.count("host_indices") == 2

"""Selection: priority, tie-break by name, coverage, and NoBackend naming every candidate."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvcore.capabilities import Residency as R
from kvcore.capabilities import Unavailable, op_support
from kvcore.errors import NoBackend, UnsupportedCombination
from kvcore.layout import Kind, Layout, Op
from kvcore.registry import Registry, make_request

from .helpers import BROKEN_PLUGIN_SOURCE, all_ops, fake_spec

FakePlugin = Callable[[str], tuple[str, str]]


@pytest.fixture
def reg() -> Registry:
    r = Registry(environ={"KVCORE_PLUGINS": ""})
    with r.isolated():
        yield r


def _request(layout: str = "layer_first", dtype: torch.dtype = torch.bfloat16,
             element_bytes: int = 96, device: str = "cpu"):
    return make_request("write_back", "mha", layout, dtype, element_bytes, device)


def test_highest_priority_wins(reg: Registry) -> None:
    for name, prio in [("low", 10), ("high", 30), ("mid", 20)]:
        reg.register(fake_spec(name, priority=prio))
    res = reg.explain(_request())
    assert res.chosen is not None and res.chosen.name == "high"
    assert res.order == ("high", "mid", "low", "reference")
    assert res.reasons == {n: "lower in order than high" for n in ("mid", "low", "reference")}
    plan = reg.resolve(_request())
    assert plan.backend_name == "high" and plan.backend_version == "9.9"


@pytest.mark.parametrize("names", [("zeta", "alpha", "mid"), ("alpha", "mid", "zeta")])
def test_ties_are_broken_by_name(reg: Registry, names: tuple[str, ...]) -> None:
    for name in names:
        reg.register(fake_spec(name, priority=20))
    assert reg.resolve(_request()).backend_name == "alpha"
    assert [r.name for r in reg.backends()] == ["alpha", "mid", "zeta", "reference"]


def test_higher_priority_that_does_not_cover_loses(reg: Registry) -> None:
    reg.register(fake_spec("narrow", priority=90, ops=all_ops(layouts=[Layout.PAGE_FIRST])))
    reg.register(fake_spec("wide", priority=10))
    assert reg.resolve(_request("page_first")).backend_name == "narrow"
    res = reg.explain(_request("layer_first"))
    assert res.chosen is not None and res.chosen.name == "wide"
    assert res.reasons["narrow"] == "does not implement write_back for mha/layer_first"


def test_an_unavailable_higher_priority_backend_loses(reg: Registry) -> None:
    reg.register(fake_spec("gone", priority=90, probe=lambda: Unavailable("no widget")))
    assert reg.resolve(_request()).backend_name == "reference"
    assert reg.explain(_request()).reasons["gone"] == "unavailable: no widget"


def test_a_raising_probe_is_reported_as_unavailable(reg: Registry) -> None:
    def probe():
        raise OSError("driver exploded")

    reg.register(fake_spec("flaky", priority=90, probe=probe))
    assert reg.resolve(_request()).backend_name == "reference"
    assert "OSError: driver exploded" in reg.explain(_request()).reasons["flaky"]


def test_no_backend_lists_every_candidate_and_why(reg: Registry,
                                                  fake_plugin: FakePlugin) -> None:
    ep, _ = fake_plugin(BROKEN_PLUGIN_SOURCE)
    broken_reg = Registry(environ={"KVCORE_PLUGINS": ep})
    with broken_reg.isolated():
        broken_reg.unregister("reference")
        specs = [
            fake_spec("gone", probe=lambda: Unavailable("no widget")),
            fake_spec("gpuonly", device_types=frozenset({"cuda"})),
            fake_spec("narrow", ops=all_ops(layouts=[Layout.PAGE_FIRST])),
            fake_spec("f32only", ops=all_ops(dtypes=frozenset({torch.float32}))),
            fake_spec("aligned", ops=all_ops(element_alignment=64)),
        ]
        for spec in specs:
            broken_reg.register(spec)
        with pytest.raises(NoBackend) as info:
            broken_reg.resolve(_request())
    reasons = info.value.reasons
    assert reasons == {
        "gone": "unavailable: no widget",
        "gpuonly": "runs on cuda devices, not cpu",
        "narrow": "does not implement write_back for mha/layer_first",
        "f32only": "write_back mha/layer_first: dtype bfloat16 not in (float32)",
        "aligned": "write_back mha/layer_first: element of 96 B is not a multiple of 64 B",
        f"plugin:{ep}": reasons[f"plugin:{ep}"],
    }
    assert "exploded" in reasons[f"plugin:{ep}"]
    message = str(info.value)
    assert "write_back mha/layer_first bfloat16 element 96 B on cpu" in message
    for name, why in reasons.items():
        assert f"{name}: {why}" in message


def test_no_backend_with_nothing_registered(reg: Registry) -> None:
    reg.unregister("reference")
    with pytest.raises(NoBackend, match=r"no backends are registered"):
        reg.resolve(_request())


def test_variant_that_refuses_dtype_leaves_the_fitting_one(reg: Registry) -> None:
    ops = (op_support(Op.WRITE_BACK, Kind.MHA, Layout.LAYER_FIRST, R.HOST, R.DEVICE,
                      variant="f32", dtypes=frozenset({torch.float32})),
           op_support(Op.WRITE_BACK, Kind.MHA, Layout.LAYER_FIRST, R.DEVICE, R.DEVICE,
                      variant="any"))
    reg.register(fake_spec("two", priority=50, ops=ops))
    plan = reg.resolve(_request())
    assert [v.variant for v in plan.variants] == ["any"]
    assert reg.resolve(_request(dtype=torch.float32)).variants == ops


def test_mla_page_head_request_is_unsupported(reg: Registry) -> None:
    with pytest.raises(UnsupportedCombination, match=r"page_head"):
        make_request("load_layer", "mla", "page_head", torch.bfloat16, 128, "cpu")


@pytest.mark.parametrize(("field", "value"), [("op", "read"), ("kind", "gqa"),
                                              ("layout", "head_first")])
def test_request_with_unknown_enum_names_the_field(field: str, value: str) -> None:
    args = dict(op="write_back", kind="mha", layout="page_first")
    args[field] = value
    with pytest.raises(ValueError, match=rf"^{field}: expected one of"):
        make_request(args["op"], args["kind"], args["layout"], torch.bfloat16, 128, "cpu")

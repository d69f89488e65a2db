"""kvcore-sglang against SGLang 0.5.23 itself: its plugin loader, its real device and host
pools and its L2TransferEngine, on the CPU with kvcore's reference backend behind the hooks.

Skipped (with the reason) only where sglang is not installed; CI installs it with
scripts/install_sglang_test_deps.sh.
"""

from __future__ import annotations

import importlib.metadata
import logging
import pkgutil

import numpy as np
import pytest
import torch

try:
    import sglang.srt.plugins as sglang_plugins
    from sglang.srt.mem_cache import memory_pool as sgl_memory_pool
    from sglang.srt.mem_cache.l2_transfer import L2Transfer, L2TransferEngine
    from sglang.srt.mem_cache.pool_host import mha as sgl_mha
    from sglang.srt.mem_cache.pool_host import mla as sgl_mla
    from sglang.srt.plugins.hook_registry import HookRegistry
except ImportError as exc:  # pragma: no cover - the CI environment has sglang
    pytest.skip(f"sglang==0.5.23 is not installed ({exc}); scripts/install_sglang_test_deps.sh "
                "installs it", allow_module_level=True)

from kvcore_sglang import hooks, plugin

import kvcore
from kvcore import Available, BackendSpec, Capabilities, HostMemory, Kind, Op
from kvcore.errors import InvalidArgument
from kvcore.registry import default_registry

SGLANG_VERSION = importlib.metadata.version("sglang")
LAYERS = 3

# SGLang's kernel names its original methods call for io_backend 'kernel'/'direct' on a
# platform without the JIT kernels. On the CPU they are not imported at all, so a spy put in
# their place records that SGLang's original method ran (and what it was asked to do).
ORIGINAL_KERNELS = {
    sgl_mha: ("transfer_kv_all_layer", "transfer_kv_all_layer_lf_pf", "transfer_kv_per_layer",
              "transfer_kv_per_layer_pf_lf", "transfer_kv_direct",
              "transfer_kv_all_layer_lf_ph", "transfer_kv_per_layer_ph_lf"),
    sgl_mla: ("transfer_kv_all_layer_mla", "transfer_kv_all_layer_mla_lf_pf",
              "transfer_kv_per_layer_mla", "transfer_kv_per_layer_mla_pf_lf",
              "transfer_kv_direct"),
}


@pytest.fixture(scope="module", autouse=True)
def _plugins_loaded() -> None:
    assert SGLANG_VERSION == "0.5.23", f"these tests pin sglang 0.5.23, found {SGLANG_VERSION}"
    sglang_plugins.load_plugins()


@pytest.fixture(autouse=True)
def _fresh(clean_env: pytest.MonkeyPatch) -> None:
    hooks.reset()


@pytest.fixture
def original_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    for module, names in ORIGINAL_KERNELS.items():
        for name in names:
            def spy(*args: object, _name: str = name, **kwargs: object) -> None:
                calls.append(_name)
            monkeypatch.setattr(module, name, spy, raising=False)
    return calls


# -- the hooks are in place ---------------------------------------------------------------------


def test_every_target_resolves_and_is_wrapped() -> None:
    assert set(plugin.TARGETS) == {
        "sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost.backup_from_device_all_layer",
        "sglang.srt.mem_cache.pool_host.mha.MHATokenToKVPoolHost.load_to_device_per_layer",
        "sglang.srt.mem_cache.pool_host.mla.MLATokenToKVPoolHost.backup_from_device_all_layer",
        "sglang.srt.mem_cache.pool_host.mla.MLATokenToKVPoolHost.load_to_device_per_layer",
    }
    for target in plugin.TARGETS:
        cls_path, method = target.rsplit(".", 1)
        cls = pkgutil.resolve_name(cls_path)  # a renamed class or module fails here
        assert method in vars(cls), f"{target}: {cls.__qualname__} defines no {method}"
        fn = vars(cls)[method]
        assert hasattr(fn, "__wrapped__"), f"{target} is not wrapped by a hook"
        assert fn.__name__ == method  # functools.wraps keeps SGLang's name
        assert target in HookRegistry._patched
        sources = {src.dist_name for _, _, src in HookRegistry._hooks[target] if src}
        assert "kvcore-sglang" in sources


def test_entry_point_is_registered() -> None:
    eps = {ep.name: ep for ep in importlib.metadata.entry_points(
        group=sglang_plugins.GENERAL_PLUGINS_GROUP)}
    assert eps["kvcore"].value == "kvcore_sglang.plugin:register"
    assert eps["kvcore"].dist.name == "kvcore-sglang"


def test_sglang_plugins_allow_list_leaves_it_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_PLUGINS", "some_other_plugin")
    assert "kvcore" not in sglang_plugins.load_plugins_by_group(
        sglang_plugins.GENERAL_PLUGINS_GROUP)
    monkeypatch.setenv("SGLANG_PLUGINS", "kvcore")
    assert "kvcore" in sglang_plugins.load_plugins_by_group(sglang_plugins.GENERAL_PLUGINS_GROUP)


@pytest.mark.parametrize("value", ["off", "0", "false", "OFF"])
def test_kvcore_sglang_off_registers_nothing(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("KVCORE_SGLANG", value)
    before = {t: list(h) for t, h in HookRegistry._hooks.items()}
    plugin.register()
    assert {t: list(h) for t, h in HookRegistry._hooks.items()} == before


@pytest.mark.parametrize("value", ["disabled", "none", "maybe"])
def test_a_kvcore_sglang_value_that_is_neither_on_nor_off_is_refused(
        monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("KVCORE_SGLANG", value)
    before = {t: list(h) for t, h in HookRegistry._hooks.items()}
    with pytest.raises(InvalidArgument, match=rf"^KVCORE_SGLANG: expected off, 0, "
                                                     rf"false or no .*, got '{value}'$"):
        plugin.register()
    assert {t: list(h) for t, h in HookRegistry._hooks.items()} == before


def test_without_kvcore_the_plugin_warns_once_and_registers_nothing(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """kvcore-sglang installed, kvcore not importable: one warning line (not SGLang's raw
    traceback of a failed plugin), SGLang's own transfers; KVCORE_SGLANG=off silences it."""
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "kvcore", None)  # (import kvcore raises ImportError)
    for name in ("kvcore_sglang.hooks", "kvcore_sglang.plugin"):
        monkeypatch.delitem(sys.modules, name)
    fresh = importlib.import_module("kvcore_sglang.plugin")  # imports no kvcore
    before = {t: list(h) for t, h in HookRegistry._hooks.items()}
    with caplog.at_level(logging.INFO, logger="kvcore_sglang"):
        fresh.register()
    assert {t: list(h) for t, h in HookRegistry._hooks.items()} == before
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "kvcore cannot be imported" in warned[0].getMessage()
    assert "KVCORE_SGLANG=off" in warned[0].getMessage()
    caplog.clear()
    monkeypatch.setenv("KVCORE_SGLANG", "off")
    with caplog.at_level(logging.INFO, logger="kvcore_sglang"):
        fresh.register()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# -- building SGLang's own pools ----------------------------------------------------------------


def mha_pools(layout: str, dtype: torch.dtype, page_size: int, **device_kw: object):
    kw = {"head_num": 2, "head_dim": 8, **device_kw}
    dev = sgl_memory_pool.MHATokenToKVPool(
        size=page_size * 6, page_size=page_size, dtype=dtype, layer_num=LAYERS, device="cpu",
        enable_memory_saver=False, **kw)
    info = dev.get_device_pool_infos()[0].buffer_info
    host = sgl_mha.MHATokenToKVPoolHost(
        info, host_to_device_ratio=2.0, host_size=0, page_size=page_size, layout=layout,
        pin_memory=False, device="cpu", device_capacity_tokens=dev.size, start_layer=0,
        end_layer=LAYERS - 1)
    return dev, host


def mla_pools(layout: str, dtype: torch.dtype, page_size: int, **host_kw: object):
    dev = sgl_memory_pool.MLATokenToKVPool(
        size=page_size * 6, page_size=page_size, dtype=dtype, kv_lora_rank=16,
        qk_rope_head_dim=8, layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    host = sgl_mla.MLATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info, host_to_device_ratio=2.0, host_size=0,
        page_size=page_size * host_kw.get("dcp_size", 1), layout=layout, pin_memory=False,
        device="cpu", device_capacity_tokens=dev.size, start_layer=0, end_layer=LAYERS - 1,
        target_layer_num=LAYERS, override_kv_cache_dim=dev.kv_cache_dim, **host_kw)
    return dev, host


def device_layers(host) -> list[torch.Tensor]:
    if isinstance(host, sgl_mha.MHATokenToKVPoolHost):
        return [*host.device_k_buffers, *host.device_v_buffers]
    return list(host.device_kv_buffers)


def poison(t: torch.Tensor, gen: torch.Generator) -> None:
    """Random bytes (every bit pattern, never zeros) written through a byte view."""
    raw = t.view(torch.uint8) if t.is_contiguous() else t
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def token_rows(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    return (pages[:, None] * page_size + torch.arange(page_size)).flatten()


def pick(gen: torch.Generator, num_pages: int, count: int, page_size: int,
         first: int = 0) -> torch.Tensor:
    """Token indices of ``count`` distinct pages in random order, from pages >= first."""
    pages = torch.randperm(num_pages - first, generator=gen)[:count] + first
    return token_rows(pages, page_size)


def host_slot(host, kv: int, layer: int) -> tuple:
    """SGLang's host buffer indexed at (kv, layer, all tokens): its layouts' own meaning."""
    if host.layout == "layer_first":
        return (kv, layer) if host.kv_buffer.dim() == 5 else (layer,)
    # page_first: (2, S, L, H, D) for MHA, (S, L, 1, D) for MLA
    return (kv, slice(None), layer) if host.kv_buffer.dim() == 5 else (slice(None), layer)


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def kvs(host) -> int:
    return 2 if isinstance(host, sgl_mha.MHATokenToKVPoolHost) else 1


def host_rows(host, buf: torch.Tensor, kv: int, layer: int, hi: torch.Tensor):
    """(buffer, index) addressing host tokens ``hi`` of (kv, layer) in SGLang's layout."""
    if host.layout == "page_head":  # (2, pages, H, P, L, D): [kv, h // P, head, h % P, layer]
        p = host.page_size
        return buf[kv], (hi // p, slice(None), hi % p, layer)
    return buf[host_slot(host, kv, layer)], hi


def expected_backup(host, hi: torch.Tensor, di: torch.Tensor) -> torch.Tensor:
    """The whole host buffer after a backup, computed from SGLang's layout by hand."""
    want = host.kv_buffer.clone()
    layers = device_layers(host)
    for kv in range(kvs(host)):
        for layer in range(host.layer_num):
            src = layers[kv * host.layer_num + layer]
            view, index = host_rows(host, want, kv, layer, hi)
            view[index] = src[di]
    return want


def expected_load(host, hi: torch.Tensor, di: torch.Tensor) -> list[torch.Tensor]:
    want = [t.clone() for t in device_layers(host)]
    for kv in range(kvs(host)):
        for layer in range(host.layer_num):
            view, index = host_rows(host, host.kv_buffer, kv, layer, hi)
            want[kv * host.layer_num + layer][di] = view[index]
    return want


def count_transfers(monkeypatch: pytest.MonkeyPatch) -> list[Op]:
    seen: list[Op] = []
    real = hooks._transfer

    def counting(routed, op, *args, **kwargs):
        seen.append(op)
        return real(routed, op, *args, **kwargs)

    monkeypatch.setattr(hooks, "_transfer", counting)
    return seen


POOLS = {"mha": mha_pools, "mla": mla_pools}


# -- byte-exact through L2TransferEngine("kernel") ----------------------------------------------


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize(("kind", "layout"), [
    ("mha", "layer_first"), ("mha", "page_first"), ("mha", "page_head"),
    ("mla", "layer_first"), ("mla", "page_first")])
def test_engine_moves_pages_through_kvcore_byte_exact(
        kind: str, layout: str, dtype: torch.dtype, page_size: int,
        monkeypatch: pytest.MonkeyPatch, original_calls: list[str]) -> None:
    gen = torch.Generator().manual_seed(hash((kind, layout, str(dtype), page_size)) % 2**31)
    dev, host = POOLS[kind](layout, dtype, page_size)
    seen = count_transfers(monkeypatch)
    engine = L2TransferEngine("kernel")
    dev_pages = device_layers(host)[0].shape[0] // page_size
    for trial in range(3):
        count = 1 + trial * 2
        # device page 0 is SGLang's padding page; its allocator never hands it out
        di = pick(gen, dev_pages, count, page_size, first=1)
        hi = pick(gen, host.page_num, count, page_size)

        for t in device_layers(host):
            poison(t, gen)
        poison(host.kv_buffer, gen)
        want_host = expected_backup(host, hi, di)
        engine.submit_device_to_host([L2Transfer(host, dev, hi, di)])
        assert torch.equal(bytes_of(host.kv_buffer), bytes_of(want_host)), \
            f"backup {kind}/{layout} differs from SGLang's layout"

        for t in device_layers(host):
            poison(t, gen)
        poison(host.kv_buffer, gen)
        di2 = pick(gen, dev_pages, count, page_size, first=1)
        want_dev = expected_load(host, hi, di2)
        engine.submit_host_to_device([L2Transfer(host, dev, hi, di2)],
                                     transfer_layer_id_max=LAYERS)
        for i, (got, want) in enumerate(zip(device_layers(host), want_dev, strict=True)):
            assert torch.equal(bytes_of(got), bytes_of(want)), \
                f"load {kind}/{layout}: device buffer {i} differs"
    assert original_calls == []
    assert seen == [Op.WRITE_BACK, *[Op.LOAD_LAYER] * LAYERS] * 3
    route = hooks.route_for(host, Kind.MHA if kind == "mha" else Kind.MLA)
    assert isinstance(route, hooks.Routed)
    assert {p.backend_name for p in route.plans.values()} == {"reference"}
    # kvcore's pools are SGLang's tensors, not copies
    assert route.host_pool.buffer.data_ptr() == host.kv_buffer.data_ptr()
    assert [t.data_ptr() for t in route.device_pool.all_buffers()] == \
        [t.data_ptr() for t in device_layers(host)]


def test_routed_pool_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    dev, host = mha_pools("page_first", torch.bfloat16, 4)
    idx = torch.arange(4, 8)
    with caplog.at_level(logging.INFO, logger="kvcore_sglang"):
        for _ in range(2):
            host.backup_from_device_all_layer(dev, idx, idx, "kernel")
    lines = [r.getMessage() for r in caplog.records if "routed through kvcore" in r.getMessage()]
    assert len(lines) == 1
    assert "MHATokenToKVPoolHost" in lines[0] and "reference" in lines[0]


# -- every decline runs SGLang's original method -----------------------------------------------


def _call_both(host, dev, **load_kw: object) -> None:
    idx = torch.arange(host.page_size, 2 * host.page_size)
    io = load_kw.pop("io_backend", "kernel")
    host.backup_from_device_all_layer(dev, idx, idx, io)
    host.load_to_device_per_layer(dev, idx, idx, 0, io, **load_kw)


def _assert_declined(caplog, calls: list[str], fragment: str, expected_calls: int = 2) -> None:
    assert len(calls) == expected_calls, calls
    assert any(fragment in r.getMessage() for r in caplog.records), \
        [r.getMessage() for r in caplog.records]


def _assert_declined_with_a_warning(caplog, calls: list[str], fragment: str) -> None:
    """Both transfers of a page_first MHA pool fall back, logged at WARNING with ``fragment``."""
    dev, host = mha_pools("page_first", torch.bfloat16, 4)
    with caplog.at_level(logging.INFO, logger="kvcore_sglang"):
        _call_both(host, dev)
    _assert_declined(caplog, calls, fragment)
    assert all(r.levelno == logging.WARNING for r in caplog.records
               if fragment in r.getMessage())


def test_io_backend_direct_declines(original_calls, caplog) -> None:
    dev, host = mha_pools("layer_first", torch.bfloat16, 4)
    with caplog.at_level(logging.INFO, logger="kvcore_sglang"):
        _call_both(host, dev, io_backend="direct")
    assert original_calls == ["transfer_kv_direct", "transfer_kv_direct"]
    _assert_declined(caplog, original_calls, "io_backend 'direct'")


def test_a_kvcore_backend_that_cannot_serve_the_pool_is_a_warning(
        original_calls, caplog, monkeypatch) -> None:
    """The user forced a backend: SGLang's own kernel running instead is not news to log at
    INFO, as kvio refuses the same setting outright."""
    monkeypatch.setenv("KVCORE_BACKEND", "bogus")
    _assert_declined_with_a_warning(caplog, original_calls, "KVCORE_BACKEND=bogus cannot serve it")


def test_no_backend_that_can_run_here_is_a_warning(original_calls, caplog, monkeypatch) -> None:
    """kvcore on, but no installed backend runs on the pool's device (a GPU plugin whose probe
    failed, the reference not installed): every transfer falls back, so it is not INFO news."""
    from kvcore.capabilities import Unavailable
    from kvcore.registry import Registry

    monkeypatch.delenv("KVCORE_BACKEND", raising=False)
    registry = Registry(environ={})
    available = registry.availability  # (on this CPU machine only the reference's probe passes)
    monkeypatch.setattr(registry, "availability", lambda name: Unavailable(
        "its probe failed (the test's)") if name == "reference" else available(name))
    monkeypatch.setattr(hooks, "default_registry", lambda: registry)
    _assert_declined_with_a_warning(caplog, original_calls, "no kvcore backend can run on cpu")


def test_draft_load_declines(original_calls, caplog, monkeypatch) -> None:
    dev, host = mha_pools("page_first", torch.bfloat16, 4)
    seen = count_transfers(monkeypatch)
    idx = torch.arange(4, 8)
    with caplog.at_level(logging.INFO, logger="kvcore_sglang"):
        host.load_to_device_per_layer(dev, idx, idx, 0, "kernel", is_draft=True)
    assert original_calls == ["transfer_kv_per_layer_pf_lf"] and seen == []
    _assert_declined(caplog, original_calls, "is_draft=True", 1)


def test_packed_draft_pool_declines(original_calls, caplog) -> None:
    dev, _ = mha_pools("page_first", torch.bfloat16, 4)
    draft = sgl_memory_pool.MHATokenToKVPool(
        size=dev.size, page_size=4, dtype=torch.bfloat16, head_num=2, head_dim=8, layer_num=1,
        device="cpu", enable_memory_saver=False)
    host = sgl_mha.MHATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info, host_to_device_ratio=2.0, host_size=0,
        page_size=4, layout="page_first", pin_memory=False, device="cpu",
        device_capacity_tokens=dev.size, start_layer=0, end_layer=LAYERS - 1,
        draft_buffer_infos=(draft.get_device_pool_infos()[0].buffer_info,))
    with caplog.at_level(logging.INFO, logger="kvcore_sglang"):
        _call_both(host, dev)
    _assert_declined(caplog, original_calls, "packed draft layers")


def test_other_host_pool_class_declines(original_calls, caplog) -> None:
    class SubclassHost(sgl_mha.MHATokenToKVPoolHost):
        """Inherits the wrapped methods, but may lay its buffers out otherwise."""

    dev, _base = mha_pools("page_first", torch.bfloat16, 4)
    host = SubclassHost(
        dev.get_device_pool_infos()[0].buffer_info, host_to_device_ratio=2.0, host_size=0,
        page_size=4, layout="page_first", pin_memory=False, device="cpu",
        device_capacity_tokens=dev.size, start_layer=0, end_layer=LAYERS - 1)
    with caplog.at_level(logging.INFO, logger="kvcore_sglang"):
        _call_both(host, dev)
    _assert_declined(caplog, original_calls, "SubclassHost is not MHATokenToKVPoolHost")


def test_strided_device_rows_decline(original_calls, caplog) -> None:
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo

    rows, heads, dim, page = 24, 2, 8, 4
    # token-major entries: K and V of a token side by side, so each per-layer view is strided
    fused = [torch.zeros(rows, 2, heads, dim, dtype=torch.bfloat16) for _ in range(LAYERS)]
    ks, vs = tuple(f[:, 0] for f in fused), tuple(f[:, 1] for f in fused)
    ptrs = [torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64) for ts in (ks, vs)]
    info = MHABufferInfo(
        buffers=KVBuffers(k=ks, v=vs, k_data_ptrs=ptrs[0], v_data_ptrs=ptrs[1],
                          layout=KVBufferLayout.NHD),
        page_size=page, head_num=heads, head_dim=dim, v_head_dim=dim, dtype=torch.bfloat16,
        device=torch.device("cpu"))
    host = sgl_mha.MHATokenToKVPoolHost(
        info, host_to_device_ratio=2.0, host_size=0, page_size=page, layout="page_first",
        pin_memory=False, device="cpu", device_capacity_tokens=rows - page, start_layer=0,
        end_layer=LAYERS - 1)
    assert not host.device_rows_packed
    with caplog.at_level(logging.INFO, logger="kvcore_sglang"):
        with pytest.raises(NotImplementedError, match="rows are"):
            # SGLang's own non-JIT kernel refuses strided rows itself: the original ran
            _call_both(host, None)
    _assert_declined(caplog, original_calls, "strided device rows", 0)


def test_different_k_and_v_head_dims_decline(original_calls, caplog) -> None:
    dev, host = mha_pools("layer_first", torch.bfloat16, 4, v_head_dim=4)
    assert host.v_head_dim != host.head_dim
    with caplog.at_level(logging.INFO, logger="kvcore_sglang"):
        _call_both(host, dev)
    _assert_declined(caplog, original_calls, "K and V head dims differ")


def test_decode_context_parallel_declines(original_calls, caplog) -> None:
    dev, host = mla_pools("layer_first", torch.bfloat16, 4, dcp_size=2, dcp_rank=0)
    with caplog.at_level(logging.INFO, logger="kvcore_sglang"):
        _call_both(host, dev)
    _assert_declined(caplog, original_calls, "decode-context parallelism")


@pytest.mark.parametrize(("kind", "layout"), [("mha", "page_first_direct"),
                                              ("mla", "page_first_direct")])
def test_layout_without_a_kernel_path_declines(original_calls, caplog, kind, layout) -> None:
    dev, host = POOLS[kind](layout, torch.bfloat16, 4)
    with caplog.at_level(logging.INFO, logger="kvcore_sglang"):
        with pytest.raises(ValueError, match="Unsupported layout"):
            _call_both(host, dev)  # SGLang's own answer for this layout with 'kernel'
    _assert_declined(caplog, original_calls, "host layout 'page_first_direct'", 0)


def test_page_unified_layout_declines(original_calls, caplog) -> None:
    dev, host = mha_pools("page_unified", torch.bfloat16, 4)
    with caplog.at_level(logging.INFO, logger="kvcore_sglang"):
        with pytest.raises(ValueError, match="Unsupported layout"):
            _call_both(host, dev)
    _assert_declined(caplog, original_calls, "host layout 'page_unified'", 0)


def test_host_memory_the_backend_cannot_read_declines(original_calls, caplog) -> None:
    """A backend whose kernels read only pinned memory, on a pool in plain memory."""
    caps = Capabilities(
        name="pinned-only", version="0", api_version=kvcore.API_VERSION, platform="cpu",
        priority=1000, probe=lambda: Available(), host_memory=HostMemory.PINNED,
        device_types=frozenset({"cpu"}),
        ops=default_registry().get("reference").spec.capabilities.ops)
    with default_registry().isolated() as reg:
        reg.register(BackendSpec(capabilities=caps, factory=lambda d: None))
        dev, host = mha_pools("page_first", torch.bfloat16, 4)
        with caplog.at_level(logging.INFO, logger="kvcore_sglang"):
            _call_both(host, dev)
    _assert_declined(caplog, original_calls, "expected pinned host memory")


def test_registered_host_memory_is_told_apart() -> None:
    plain = torch.empty(8)
    assert hooks._host_memory(plain) is HostMemory.PLAIN
    setattr(plain, hooks.SGLANG_REGISTERED_RANGES_ATTR, [(plain.data_ptr(), 32)])
    assert hooks._host_memory(plain) is HostMemory.REGISTERED


def test_out_of_range_indices_raise_not_corrupt() -> None:
    """A routed call validates indices (kvcore's typed error), it does not fall back."""
    dev, host = mha_pools("page_first", torch.bfloat16, 4)
    before = host.kv_buffer.clone()
    bad = torch.arange(host.size, host.size + 4)
    with pytest.raises(kvcore.KVCoreError, match="host_indices"):
        host.backup_from_device_all_layer(dev, bad, torch.arange(4, 8), "kernel")
    assert torch.equal(bytes_of(host.kv_buffer), bytes_of(before))


def test_a_pool_missing_an_attribute_declines(original_calls, caplog) -> None:
    """A future SGLang that renames what the hooks read gets its own method, not a crash."""
    dev, host = mha_pools("page_first", torch.bfloat16, 4)
    del host.device_v_buffers
    with caplog.at_level(logging.INFO, logger="kvcore_sglang"):
        with pytest.raises(AttributeError):
            _call_both(host, dev)  # SGLang's original needs it too
    _assert_declined(caplog, original_calls, "is not shaped as SGLang 0.5.23's", 0)


# -- found by a misuse sweep ---------------------------------------------------------------------


def test_a_destroyed_host_pool_is_decided_again_and_its_old_buffer_untouched(
        original_calls: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """After destroy() (kv_buffer None) the cached route must not keep writing into the
    buffer the pool let go: the pool is decided again, declines, and SGLang's own method
    runs (and fails as it does without kvcore)."""
    dev, host = mha_pools("page_first", torch.bfloat16, 4)
    seen = count_transfers(monkeypatch)
    hi, di = torch.arange(8, 16), torch.arange(4, 12)
    host.backup_from_device_all_layer(dev, hi, di, "kernel")
    assert seen == [Op.WRITE_BACK]
    old = host.kv_buffer
    before = old.clone()
    host.destroy()
    with pytest.raises((TypeError, AttributeError)):  # SGLang's own, on its None buffer
        host.backup_from_device_all_layer(dev, hi, di, "kernel")
    assert seen == [Op.WRITE_BACK]  # kvcore moved nothing more
    assert torch.equal(bytes_of(old), bytes_of(before))


@pytest.mark.parametrize("layer", [np.int64(1), torch.tensor(1), np.int32(1)])
def test_an_integer_layer_of_another_type_is_routed_like_an_int(
        layer: object, original_calls: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    dev, host = mha_pools("page_first", torch.bfloat16, 4)
    seen = count_transfers(monkeypatch)
    idx = torch.arange(4, 8)
    host.load_to_device_per_layer(dev, idx, idx, layer, "kernel")
    assert seen == [Op.LOAD_LAYER] and original_calls == []


@pytest.mark.parametrize("layer", [None, 1.0, "1", True])
def test_a_layer_that_is_no_integer_is_a_typed_error(layer: object,
                                                     original_calls: list[str]) -> None:
    dev, host = mha_pools("page_first", torch.bfloat16, 4)
    idx = torch.arange(4, 8)
    with pytest.raises(InvalidArgument, match=r"^layer_id: expected an int"):
        host.load_to_device_per_layer(dev, idx, idx, layer, "kernel")
    assert original_calls == []


def test_sparse_or_wrapper_index_tensors_are_a_typed_error() -> None:
    from torch.testing._internal.logging_tensor import LoggingTensor

    dev, host = mha_pools("page_first", torch.bfloat16, 4)
    before = host.kv_buffer.clone()
    hi, di = torch.arange(8, 16), torch.arange(4, 12)
    for h, d in ((hi.to_sparse(), di), (hi, di.to_sparse()), (LoggingTensor(hi), di)):
        with pytest.raises(kvcore.errors.TensorMismatch, match="a dense \\(strided\\)"):
            host.backup_from_device_all_layer(dev, h, d, "kernel")
    assert torch.equal(bytes_of(host.kv_buffer), bytes_of(before))


def test_the_decision_is_per_pool_and_kind_and_a_stand_in_without_weakrefs_declines() -> None:
    _dev, host = mha_pools("page_first", torch.bfloat16, 4)
    assert isinstance(hooks.route_for(host, Kind.MHA), hooks.Routed)
    assert isinstance(hooks.route_for(host, Kind.MLA), hooks.Decline)  # not the MHA one

    class Slotted:
        __slots__ = ("kv_buffer",)

    stand_in = Slotted()
    stand_in.kv_buffer = torch.zeros(4)
    found = hooks.route_for(stand_in, Kind.MHA)
    assert isinstance(found, hooks.Decline)

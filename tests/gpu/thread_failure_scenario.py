"""The case of tests/gpu/test_library_thread_failure.py, run in a process of its own with
tests/gpu/fault_shim.c preloaded (it replaces cudaEventRecord):

    LD_PRELOAD=/path/fault_shim.so python tests/gpu/thread_failure_scenario.py   # ok, or what broke

A write-back handed to kvio_cuda's library thread fails part way through its pipeline: the
shim fails the thread's third cudaEventRecord, after the copies of the first chunk were
enqueued. Those copies wait behind a sleep on the caller's stream. Until they completed, the
write must stay pending: its host slots are released at its failure, and the copies still
write them. Then the failure surfaces, the slots are back, and the controller and the device
still move data exactly. Exit status 1 names what went wrong; 2 says the shim saw none of
the library's calls (the test could not run), 3 that the sleep ended too early to tell.
"""

from __future__ import annotations

import ctypes
import sys
import time

import torch

LAYERS, HEADS, DIM, PAGE, PAGES = 4, 8, 128, 64, 8
FAIL_AT = 3  # the thread's third event record: the second chunk's, after the first's copies
SLEEP_CYCLES = 1_500_000_000  # about 0.8 s of the caller's stream


def scenario() -> tuple[int, str]:
    import kvcore.native
    from kvcore import DevicePool, HiCacheController
    from kvcore.errors import TransferFailed
    from kvcore.layout import Op
    from kvcore.registry import allocate_host_pool
    from kvcore.verify import random_fill

    shim = ctypes.CDLL(None)  # the preloaded shim's functions are in the global scope
    try:
        arm, seen, fired = shim.kvio_fault_arm, shim.kvio_fault_seen, shim.kvio_fault_fired
    except AttributeError:
        return 2, "fault_shim.so is not preloaded (LD_PRELOAD)"
    kvcore.native.ASYNC_WRITE_BACK_MIN_BYTES = 1  # every write-back goes to the thread
    kvcore.native.DIRECT_WRITE_BACK_MAX_BYTES = 0  # (none to the direct kernel)
    device = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator().manual_seed(20261206)
    dev = DevicePool.allocate("mha", LAYERS, 4 * PAGES * PAGE, HEADS, DIM, torch.bfloat16,
                              device, PAGE)
    for t in dev.all_buffers():
        random_fill(t, gen)
    host = allocate_host_pool("mha", "page_first", LAYERS, 4 * PAGES * PAGE, HEADS, DIM,
                              torch.bfloat16, PAGE, device)
    ctl = HiCacheController(dev, host)
    backend = ctl.bound[(0, Op.WRITE_BACK)].plan.instance()
    page_bytes = 2 * LAYERS * PAGE * HEADS * DIM * 2  # K and V of one page
    backend.staging_bytes = 2 * page_bytes + page_bytes // 2  # one page per chunk, pipelined
    backend._staging = {}
    n = PAGES * PAGE
    d = torch.arange(n, device=device)
    d2 = torch.arange(n, 2 * n, device=device)
    free_before = ctl.allocator.available_size()

    arm(-1)  # how many event records one such write-back makes on the thread
    ctl.write(d)
    (ack,) = ctl.wait_acks()
    ctl.free_host(ack.host_indices)
    records = seen()
    arm(0)
    if records == 0:
        return 2, "the shim saw no cudaEventRecord of the library's thread"
    if records <= FAIL_AT + 1:
        return 1, f"a pipelined write-back made only {records} event records on the thread"

    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)  # the caller's stream: the write's copies wait for it
    arm(FAIL_AT)
    ctl.write(d)
    deadline = time.monotonic() + 5
    while not fired():
        if time.monotonic() > deadline:
            return 1, "the library's thread never issued the write-back"
        time.sleep(0.001)
    time.sleep(0.05)  # the thread records the job's completion after the failure
    try:
        early = ctl.poll_acks()
    except TransferFailed as exc:
        if torch.cuda.current_stream().query():
            return 3, "the sleep ended before the poll"
        return 1, ("the failure was reported while the copies enqueued before it were still "
                   f"queued (their host slots released under them): {exc}")
    if torch.cuda.current_stream().query():
        return 3, "the sleep ended before the poll"
    if early:
        return 1, f"a write-back that failed was acknowledged: {early}"
    arm(0)
    torch.cuda.synchronize()
    try:
        late = ctl.poll_acks()
    except TransferFailed:
        pass
    else:
        return 1, f"the failed write-back never surfaced (poll_acks returned {late})"
    if ctl.allocator.available_size() != free_before:
        return 1, (f"{free_before - ctl.allocator.available_size()} host slots were not "
                   "released after the failure")

    ctl.write(d)  # the controller and the device are still usable, and exact
    (ack,) = ctl.wait_acks()
    ctl.load(ack.host_indices, d2).wait()
    torch.cuda.synchronize()
    for t in dev.all_buffers():
        if not torch.equal(t[d2].view(torch.int16), t[d].view(torch.int16)):
            return 1, "a write-back and load after the failure did not move the pages exactly"
    return 0, "ok"


if __name__ == "__main__":
    status, message = scenario()
    print(message)
    sys.exit(status)

"""One worker thread per gloo process group: the fix for issue 46's heap corruption.

torch 2.13's gloo backend runs each process group's collectives on ``Options::threads`` worker
threads (2 by default). After a collective, ``ProcessGroupGloo::runLoop``
(``torch/csrc/distributed/c10d/ProcessGroupGloo.cpp``) records it in the group's status,
``pgStatus_->lastCompletedWorkName = opTypeToString(work->opType_)``, after releasing the group's
work mutex. Two workers that finish together therefore assign one ``std::string`` at once: one swaps
its buffer in and frees the old one while the other copies its (short) name into the old one it had
already read — a write into a freed 32-byte chunk that aborts the first worker at its next small
allocation with ``malloc(): unaligned tcache chunk detected``. The ring attention's backward on gloo
is where two collectives of one group finish together (the K/V all-gather and the dK/dV permute);
``bench/gloo_worker_race.py`` shows the write after free under ASan and the crash under glibc's own
allocator, and that one worker per group has neither.

With one worker thread a group's collectives still run off the main thread and in issue order, one
at a time, so nothing else changes: the values are the same bit for bit, and the ring still overlaps
its collectives with the attention kernel. NCCL groups are not touched.
"""

from __future__ import annotations

import os
from datetime import timedelta

__all__ = ["GLOO_WORKERS_ENV", "gloo_workers", "gloo_worker_threads", "one_worker_per_gloo_group"]

GLOO_WORKERS_ENV = "MILES_GLOO_WORKERS"  # worker threads per gloo group; torch's own default is 2
_DEFAULT_TIMEOUT = timedelta(minutes=30)  # torch's kBackendDefaultTimeout, its binding's default


def gloo_workers() -> int:
    """Worker threads per gloo group: 1, or ``MILES_GLOO_WORKERS`` (2 reproduces torch's default,
    for ``bench/sp_stress.py --arms``)."""
    raw = os.environ.get(GLOO_WORKERS_ENV, "1")
    try:
        workers = int(raw)
    except ValueError:
        workers = 0
    if not 1 <= workers <= 64:
        raise ValueError(
            f"{GLOO_WORKERS_ENV}={raw!r}: worker threads per gloo process group must be an integer in "
            f"[1, 64]; unset it (1, the default: issue 46's heap corruption needs two)"
        )
    return workers


def _default_devices(gloo_cls) -> list:
    """The transport devices torch's ``Options::create_default`` picks: one per interface of
    ``GLOO_SOCKET_IFNAME``, else the hostname's."""
    interfaces = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]
    if interfaces:
        return [gloo_cls.create_device(interface=i) for i in interfaces]
    return [gloo_cls.create_default_device()]


def one_worker_per_gloo_group() -> None:
    """Make every gloo process group this process creates from now on run ``gloo_workers()`` worker
    threads (``init_process_group``, ``new_group``, device meshes: they all construct
    ``ProcessGroupGloo(store, rank, size, timeout=...)``). Call it before the first group; calling it
    again does nothing. A group built with explicit options keeps them."""
    try:
        from torch._C._distributed_c10d import ProcessGroupGloo
    except ImportError:  # torch built without gloo
        return
    if getattr(ProcessGroupGloo.__init__, "_miles_one_worker", False):
        return
    workers = gloo_workers()
    original = ProcessGroupGloo.__init__

    def __init__(self, store, rank, size, *args, **kwargs):
        explicit = (args and isinstance(args[0], ProcessGroupGloo._Options)) or "options" in kwargs
        if explicit:
            return original(self, store, rank, size, *args, **kwargs)
        timeout = args[0] if args else kwargs.pop("timeout", _DEFAULT_TIMEOUT)
        options = ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = _default_devices(ProcessGroupGloo)
        options._threads = workers
        return original(self, store, rank, size, options)

    __init__._miles_one_worker = True
    ProcessGroupGloo.__init__ = __init__


def gloo_worker_threads(group) -> int | None:
    """The worker threads of ``group``'s gloo backend (None: it has none, e.g. NCCL only)."""
    import torch

    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:
        return None
    options = getattr(backend, "options", None)
    return getattr(options, "_threads", None)

"""A rank that dies by a native abort names where it was: ``init_distributed`` enables faulthandler.

The crash of issue 46 (``malloc(): unaligned tcache chunk detected``, SIGABRT in one rank of a
torchrun launch) left only glibc's one line and torchrun's exit code. Here a process sets up its
runtime as a rank does (``miles.train.runtime.init_distributed``, one gloo rank), starts a second
thread, and then hands glibc a pointer it never allocated, so glibc's own heap check aborts it as
it aborted that rank. Its stderr must carry glibc's message and every thread's Python stack: the
function that called ``free`` and the thread beside it. The same script without the runtime's
set-up dies silently (the control: faulthandler is not on by default).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.dist_utils import free_port

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import ctypes, sys, threading

    if sys.argv[1] == "runtime":
        from miles.train.runtime import init_distributed
        init_distributed(30.0)

    started = threading.Event()

    def thread_beside_the_crash():
        started.set()
        threading.Event().wait()

    threading.Thread(target=thread_beside_the_crash, daemon=True).start()
    started.wait()

    def free_a_pointer_glibc_never_gave():
        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        libc.free.argtypes = [ctypes.c_void_p]
        block = libc.malloc(64)
        # The 8 bytes before block + 8 are what free reads as its chunk's size: zeroed, so that
        # garbage there with the mmapped bit set cannot send it down munmap_chunk's check instead.
        ctypes.memset(block, 0, 64)
        libc.free(block + 8)  # misaligned: glibc's check aborts ("free(): invalid pointer")

    free_a_pointer_glibc_never_gave()
    """
)


def _run(mode: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
    }
    for name in ("PYTHONFAULTHANDLER", "LD_PRELOAD", "MALLOC_CHECK_", "MALLOC_PERTURB_"):
        env.pop(name, None)
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, mode],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's heap checks")
def test_a_native_abort_in_a_rank_prints_every_threads_stack():
    control = _run("bare")
    assert control.returncode == -signal.SIGABRT, control.stderr[-2000:]
    assert "free(): invalid pointer" in control.stderr
    assert "Fatal Python error" not in control.stderr  # nothing names the place without the runtime

    proc = _run("runtime")
    err = proc.stderr
    assert proc.returncode == -signal.SIGABRT, err[-2000:]
    assert "free(): invalid pointer" in err
    assert "Fatal Python error: Aborted" in err, err[-2000:]
    # The crashing thread's stack names the function that called free, and the other thread is listed.
    current = err.split("Current thread", 1)[1]
    assert "free_a_pointer_glibc_never_gave" in current.split("\n\n", 1)[0], err[-2000:]
    assert "thread_beside_the_crash" in err, err[-2000:]

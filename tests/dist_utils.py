"""Run a function on several CPU processes over gloo, for multi-rank tests.

Usage in a test:

    def _body(rank, world_size, arg):
        ...  # torch.distributed is initialised (gloo); raise AssertionError to fail

    def test_x():
        run_distributed(_body, 4, arg)

The body must be a module-level function (it is pickled for spawn). Failures on any
rank are re-raised in the parent with that rank's traceback.

``run_pooled`` runs the body the same way on ranks that live for the whole session (one set per
world size), so that a test pays the ~10-30 s start-up of its processes (Python, torch, diffusers,
gloo) once per session instead of once per call. A pooled body must leave the process as it found
it: restore what it patches (module attributes, environment variables) and keep the default process
group. After each body the ranks destroy the process groups it made (a mesh's) with DTensor's plans
that name them (``release_subgroups``), and restore the deterministic-algorithms flags (torch's and
Inductor's), the default dtype, grad mode and Dynamo's caches. A failure on any rank retires the
set (a fresh one serves the next call); tests/conftest.py closes the sets when the run leaves their
test folder.
Bodies that replace the default process group use ``run_distributed``.

Also the launch helpers' rule for torchrun launches (tests/e2e): a failed launch is retried only
when every rank wrote its "finished" marker (``train_grpo.py`` writes ``rank<R>`` into
``$MILES_FINISHED_DIR`` after its work returned 0), that is, when the failure came after every rank
was done; a launch that died by a signal or an error mid-run fails the test at once. Every retry is
reported as a warning. Random inputs use ``FIXED_SEEDS`` so that a failure reproduces.
"""

from __future__ import annotations

import atexit
import os
import queue
import socket
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from miles.parallel.gloo import one_worker_per_gloo_group

# Seeds of the tests' random inputs: fixed, so a failing case fails again (one per call site).
FIXED_SEEDS = (271828, 314159, 161803, 141421, 173205, 223606, 577215, 662607, 299792)

FINISHED_ENV = "MILES_FINISHED_DIR"


def finished_ranks(marker_dir: str | Path) -> set[int]:
    """The ranks that wrote their "finished" marker into ``marker_dir``."""
    folder = Path(marker_dir)
    return {int(p.name[4:]) for p in folder.glob("rank*")} if folder.is_dir() else set()


def may_retry(returncode: int, marker_dir: str | Path, world_size: int, what: str, output: str) -> bool:
    """Whether a failed launch may be retried: only when every rank had finished (a teardown
    failure). Reports the retry as a warning with the output's tail."""
    if returncode == 0 or finished_ranks(marker_dir) != set(range(world_size)):
        return False
    warnings.warn(
        f"retrying {what}: it exited {returncode} after all {world_size} ranks had finished:\n{output[-1500:]}",
        stacklevel=2,
    )
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_rank(rank: int, world_size: int, port: int) -> None:
    """A spawned rank as torchrun sets one up: its environment, one thread, the default gloo group."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    one_worker_per_gloo_group()  # as every miles process (issue 46)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def _exit_now() -> None:
    """As train_grpo.py does: skip interpreter finalization, where gloo's worker threads can abort the
    process (pytorch/pytorch#179291)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _worker(rank, world_size, port, err_dir, fn, args, kwargs):
    _init_rank(rank, world_size, port)
    try:
        fn(rank, world_size, *args, **kwargs)
    except BaseException:
        with open(os.path.join(err_dir, f"rank{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        raise
    # Every check of the body passed on this rank.
    open(os.path.join(err_dir, f"done{rank}"), "w").close()
    dist.destroy_process_group()
    _exit_now()


def run_distributed(fn, world_size: int, *args, **kwargs) -> None:
    """Spawn ``world_size`` gloo ranks running ``fn(rank, world_size, *args, **kwargs)``."""
    with tempfile.TemporaryDirectory() as err_dir:
        try:
            mp.start_processes(
                _worker,
                args=(world_size, free_port(), err_dir, fn, args, kwargs),
                nprocs=world_size,
                join=True,
                start_method="spawn",
            )
        except mp.ProcessRaisedException as e:
            msgs = [
                open(os.path.join(err_dir, p)).read()
                for p in sorted(os.listdir(err_dir))
                if p.startswith("rank")
            ]
            raise AssertionError("distributed test failed:\n" + "\n".join(msgs)) from e
        except mp.ProcessExitedException as e:
            done = {p for p in os.listdir(err_dir) if p.startswith("done")}
            if len(done) == world_size:
                # Every rank finished the body and its checks; a rank then aborted while tearing
                # down gloo ("terminate called without an active exception", seen rarely on CPU).
                warnings.warn(f"ignored a crash after every rank had passed its checks: {e}", stacklevel=2)
                return
            raise AssertionError(f"a rank died: {e}") from e


def clear_dtensor_caches() -> None:
    """Forget DTensor's plans. Its sharding propagation (a Python and a C++ cache), redistribute
    planner and mesh cost model cache results by ``DeviceMesh``, and a mesh compares equal to any
    mesh of the same ranks and names: a later mesh would be served results naming the process groups
    of an earlier one (after those are destroyed: "Could not resolve the process group registered
    under the name ...")."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _redistribute as redistribute
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_cached.cache_clear()
    redistribute._gen_transform_infos.cache_clear()
    redistribute.clear_redistribute_planner_cache()
    MeshTopoInfo.build_from_mesh.cache_clear()


def release_subgroups() -> None:
    """Destroy every process group but the default one, and DTensor's plans that name them. Each
    gloo group keeps I/O threads polling for the life of its process: a session's bodies and runs on
    kept ranks (a mesh's groups per Trainer) left ~460 threads and ~20% of a core per idle rank on
    the 2-core machine. Called on every rank, after its body or run."""
    from torch.distributed import distributed_c10d as c10d

    if not dist.is_initialized():
        return
    dist.barrier()  # every rank is done with them
    for group in list(c10d._world.pg_map):
        if group is not c10d.GroupMember.WORLD:
            dist.destroy_process_group(group)
    clear_dtensor_caches()


class KeepGroup:
    """``torch.distributed`` for ``train_grpo.main`` (as ``train_grpo.dist``) when its process group
    must outlive it: ``destroy_process_group`` keeps the default group and releases the run's
    subgroups (tests/e2e/multi_run.py, pooled ranks)."""

    def __getattr__(self, name):
        return getattr(dist, name)

    @staticmethod
    def destroy_process_group(*args, **kwargs) -> None:
        release_subgroups()


# --- ranks kept for the session -------------------------------------------------------------------

POOL_CALL_TIMEOUT_S = 1500.0  # one body on a loaded 2-core machine; a hang fails the test after this
POOL_FAILURE_GRACE_S = 30.0  # after one rank failed, how long the others may take to report


def _process_state() -> tuple:
    from torch._inductor import config as inductor_config

    deterministic = torch.are_deterministic_algorithms_enabled()
    inductor_deterministic = getattr(inductor_config, "deterministic", None)
    return deterministic, inductor_deterministic, torch.get_default_dtype(), torch.initial_seed()


def _reset_process_state(deterministic: bool, inductor_deterministic, dtype: torch.dtype, seed: int) -> None:
    """Put back what a body may switch: a Trainer's deterministic mode (torch's and Inductor's flag)."""
    from torch._inductor import config as inductor_config

    torch.manual_seed(seed)  # the generator as a fresh process has it
    torch.use_deterministic_algorithms(deterministic)
    if inductor_deterministic is not None:
        inductor_config.deterministic = inductor_deterministic
    torch.set_default_dtype(dtype)
    torch.set_grad_enabled(True)
    torch._dynamo.reset()


def _pool_worker(rank, world_size, port, tasks, results):
    _init_rank(rank, world_size, port)
    state = _process_state()
    while (task := tasks.get()) is not None:
        fn, args, kwargs, env = task
        os.environ.update(env)
        try:
            fn(rank, world_size, *args, **kwargs)
            error = None
        except BaseException:
            error = traceback.format_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        results.put((rank, error))
        if error is None:  # after a failure the set is retired: a rank may be stuck in a collective
            release_subgroups()
        _reset_process_state(*state)
    _exit_now()


class _Pool:
    """``world_size`` gloo ranks that run one body after another."""

    def __init__(self, world_size: int):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.tasks = [ctx.SimpleQueue() for _ in range(world_size)]
        self.results = ctx.Queue()
        port = free_port()
        self.procs = [
            ctx.Process(
                target=_pool_worker, args=(r, world_size, port, self.tasks[r], self.results), daemon=True
            )
            for r in range(world_size)
        ]
        for proc in self.procs:
            proc.start()

    def run(self, fn, args, kwargs) -> dict[int, str | None]:
        """Each rank's error (None: passed); raises AssertionError when a rank died or hung."""
        env = {k: v for k, v in os.environ.items() if k not in _RANK_ENV}
        for q in self.tasks:
            q.put((fn, args, kwargs, env))
        errors: dict[int, str | None] = {}
        deadline = time.monotonic() + POOL_CALL_TIMEOUT_S
        while len(errors) < self.world_size:
            if any(e is not None for e in errors.values()):
                deadline = min(deadline, time.monotonic() + POOL_FAILURE_GRACE_S)
            try:
                rank, error = self.results.get(timeout=1.0)
                errors[rank] = error
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
            if dead or time.monotonic() > deadline:
                if any(e is not None for e in errors.values()):
                    break  # the others are stuck in a collective with the failed rank
                what = f"rank(s) {dead} died" if dead else f"no result after {POOL_CALL_TIMEOUT_S:.0f} s"
                raise AssertionError(f"distributed test failed: {what}")
        return errors

    def close(self) -> None:
        for proc, q in zip(self.procs, self.tasks):
            if proc.is_alive():
                q.put(None)
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()


_RANK_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
_pools: dict[int, _Pool] = {}


def close_pools() -> None:
    while _pools:
        _pools.popitem()[1].close()


atexit.register(close_pools)


def run_pooled(fn, world_size: int, *args, **kwargs) -> None:
    """``run_distributed`` on the session's ranks of ``world_size`` (started at the first call)."""
    pool = _pools.get(world_size) or _pools.setdefault(world_size, _Pool(world_size))
    try:
        errors = pool.run(fn, args, kwargs)
    except BaseException:
        _pools.pop(world_size).close()
        raise
    failed = {r: e for r, e in errors.items() if e is not None}
    if failed or len(errors) < world_size:
        silent = sorted(set(range(world_size)) - set(errors))
        dead = {r: pool.procs[r].exitcode for r in silent if pool.procs[r].exitcode is not None}
        msgs = [f"rank {r}:\n{e}" for r, e in sorted(failed.items())]
        msgs += [f"rank {r} died (exit code {code})" for r, code in dead.items()]
        if stuck := [r for r in silent if r not in dead]:
            msgs += [f"rank(s) {stuck} did not finish (stuck in a collective?)"]
        _pools.pop(world_size).close()  # a rank may be left inside a collective: start afresh
        raise AssertionError("distributed test failed:\n" + "\n".join(msgs))

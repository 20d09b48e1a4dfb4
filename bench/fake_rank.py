"""One rank of a world-N job in one process: torch's fake process group, and what it breaks.

``torch.testing._internal.distributed.fake_pg`` registers the ``fake`` backend: collectives return
at once and move nothing, while every tensor, shape and allocation stays real, so one GPU can
rehearse one rank of a larger job (peak memory, kernels at 1/sp of the sequence).

What the fake group returns on CPU (torch 2.13, ``tests/e2e/test_benchmarks.py``): all-gathers
fill every chunk with the local input, reduce-scatter returns the local chunk, all-to-all returns
its input, all-reduce leaves the tensor as it was: all finite and of the right shape. On CUDA
(torch 2.11) the object gathers came back unfilled, and the sp 4 train step ran at an implied
1003 TFLOP/s, above the bf16 peak: the tensor outputs are taken to be left as allocated too
(uninitialised or zero memory, data no real rank sees). :func:`fake_collective_fixes` therefore
fills every tensor collective's output as the CPU group does, zero-fills point-to-point receive
buffers, hands every "rank" this rank's object in object collectives (DCP), and skips DCP's
save-plan coverage check (every fake rank reports rank 0's chunks). The ring templates exchange K/V
and their gradients through torch's functional collectives (all-gather, permute): those are filled
too, in the templates' module only (every gathered chunk the local buffer, the permute its input),
so that eager and compiled copies of a ring layout see the same data (unfilled,
``bench/sp_timing.py``'s gradient check compared two draws of uninitialised memory at sp 8 = 4 x 2).
Random weights at 30-40 layers, with gathered parameters that are copies of the local shard, may
overflow to inf/NaN: :func:`tolerate_nonfinite` keeps the trainer's non-finite checks from stopping
a rehearsal (the numbers are meaningless; memory is the point).

Everything is patched here, at run time: ``miles/`` is never edited for the fake group.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
import torch.distributed as dist


def init_fake_world(world_size: int, rank: int = 0, local_world_size: int | None = None) -> None:
    """Initialise torch.distributed as rank ``rank`` of ``world_size`` over the fake group; the
    environment is set as torchrun would (``LOCAL_WORLD_SIZE`` = processes per node, default
    min(world, 8): Ulysses groups must stay inside a node)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised; a fake world needs a fresh process")
    local = local_world_size or min(world_size, 8)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK="0",  # the one device of this process
        LOCAL_WORLD_SIZE=str(local),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29599",
    )
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # as the trainer sets it
    if torch.cuda.is_available():
        torch.cuda.set_device(0)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def _zero_recv(op):
    def wrapped(tensor, *args, **kwargs):
        tensor.zero_()
        return op(tensor, *args, **kwargs)

    return wrapped


def _fill_gather(obj, object_gather_list=None, dst=None, group=None, group_dst=None):
    if object_gather_list is not None:
        object_gather_list[:] = [obj] * len(object_gather_list)


def _first_scatter(
    scatter_object_output_list, scatter_object_input_list=None, src=0, group=None, group_src=None
):
    if scatter_object_input_list:
        scatter_object_output_list[0] = scatter_object_input_list[0]


def _io(args, kwargs, out_names, in_names):
    out = args[0] if args else next((kwargs[n] for n in out_names if n in kwargs), None)
    inp = args[1] if len(args) > 1 else next((kwargs[n] for n in in_names if n in kwargs), None)
    return out, inp


def _fill_gather_tensor(out, inp):
    """Every chunk of the gathered buffer holds the local input (as the CPU fake group does)."""
    if out.is_contiguous() and inp.numel() and out.numel() % inp.numel() == 0:
        out.view(-1, inp.numel()).copy_(inp.reshape(1, -1))


def _fill_scatter_tensor(out, inp):
    """The reduce-scatter's output is the input's first chunk."""
    if inp.is_contiguous() and inp.numel() >= out.numel():
        out.copy_(inp.view(-1)[: out.numel()].view_as(out))


def _fill_all_to_all(out, inp):
    """Equal splits: the output is the input (as the CPU fake group does)."""
    if out.numel() == inp.numel():
        out.copy_(inp.reshape(out.shape))


def _filling(op, fill):
    """``op`` (a tensor collective of the fake group) followed by ``fill(output, input)``, so that
    what follows computes on data like a real rank's whatever the fake group left in the output
    (on CUDA, taken to be the memory as allocated: see the module docstring)."""

    def wrapped(*args, **kwargs):
        work = op(*args, **kwargs)
        out, inp = _io(args, kwargs, ("output_tensor", "output"), ("input_tensor", "input"))
        if out is not None and inp is not None:
            # In place, FSDP gathers from a slice of the output buffer (in eager hooks). Traced code
            # must not read a storage pointer: Dynamo breaks the graph there and recompiles for every
            # new address, until it falls back to eager (it did so to the Ulysses all-to-all while
            # compiled blocks traced it; it is now a custom op whose body runs eagerly).
            traced = torch.compiler.is_compiling()
            if not traced and out.untyped_storage().data_ptr() == inp.untyped_storage().data_ptr():
                inp = inp.clone()
            fill(out, inp)
        return work

    return wrapped


_TENSOR_FILLS = {
    "all_gather_into_tensor": _fill_gather_tensor,
    "all_gather_single": _fill_gather_tensor,
    "reduce_scatter_tensor": _fill_scatter_tensor,
    "reduce_scatter_single": _fill_scatter_tensor,
    "all_to_all_single": _fill_all_to_all,
}


class _FilledFunctionals:
    """torch's functional collectives as the ring templates call them (``ft_c.<name>``), with the
    outputs of the K/V exchanges filled: the all-gather's chunks the local buffer, the permute's
    output its input. Everything else is the module's own."""

    def __init__(self, funcol):
        self._funcol = funcol

    def __getattr__(self, name):
        return getattr(self._funcol, name)

    def _waited(self, result):
        return result.wait() if isinstance(result, self._funcol.AsyncCollectiveTensor) else result

    def _gathered(self, name, tensor, *args, **kwargs):
        out = self._waited(getattr(self._funcol, name)(tensor, *args, **kwargs))
        _fill_gather_tensor(out, tensor)
        return out

    def all_gather_tensor(self, tensor, *args, **kwargs):  # what torch 2.11's templates call
        return self._gathered("all_gather_tensor", tensor, *args, **kwargs)

    def all_gather_single(self, tensor, *args, **kwargs):  # what torch 2.13's templates call
        return self._gathered("all_gather_single", tensor, *args, **kwargs)

    def permute_tensor(self, tensor, *args, **kwargs):
        out = self._waited(self._funcol.permute_tensor(tensor, *args, **kwargs))
        out.copy_(tensor)
        return out


@contextlib.contextmanager
def _filled_ring_exchanges():
    from miles.sequence_parallel import ring

    try:
        templates = ring._ring_templates()
    except ImportError:  # no ring templates in this torch: no ring to fill
        yield
        return
    funcol = templates.ft_c
    templates.ft_c = _FilledFunctionals(funcol)
    try:
        yield
    finally:
        templates.ft_c = funcol


@contextlib.contextmanager
def fake_collective_fixes():
    """Fill the outputs of the tensor collectives as the CPU fake group does (every gathered chunk
    the local input, the scatter's first chunk, the all-to-all's input; the ring templates' K/V
    exchanges alike), zero-fill point-to-point receive buffers, and hand object collectives this
    rank's object."""
    import miles.sequence_parallel.comm as sp_comm

    tensor_ops = {name: getattr(dist, name) for name in _TENSOR_FILLS if hasattr(dist, name)}
    for name, op in tensor_ops.items():
        setattr(dist, name, _filling(op, _TENSOR_FILLS[name]))
    sp_gather = sp_comm._all_gather_single  # bound at import: the SP boundary's gather
    sp_comm._all_gather_single = _filling(sp_gather, _fill_gather_tensor)
    saved = {
        name: getattr(dist, name)
        for name in (
            "recv",
            "irecv",
            "batch_isend_irecv",
            "gather_object",
            "all_gather_object",
            "scatter_object_list",
        )
    }
    # Object collectives pickle into tensors that the fake group leaves unfilled on CUDA (torch
    # 2.11: DCP's save-plan gather unpickled zeros): every "rank" gets this rank's object.
    dist.gather_object = _fill_gather
    dist.all_gather_object = lambda object_list, obj, group=None: _fill_gather(obj, object_list)
    dist.scatter_object_list = _first_scatter
    dist.recv = _zero_recv(saved["recv"])
    dist.irecv = _zero_recv(saved["irecv"])

    def batch(ops):
        for op in ops:
            if op.op in (saved["irecv"], dist.irecv):
                op.tensor.zero_()
        return saved["batch_isend_irecv"](ops)

    dist.batch_isend_irecv = batch
    # DCP's coordinator checks that the ranks' chunks tile every tensor; under the fake group
    # every "rank" reports rank 0's chunks, so the check fails though rank 0 writes exactly its own.
    import torch.distributed.checkpoint.default_planner as planner

    validate = planner._validate_global_plan

    def valid(global_plan, metadata):  # torch 2.13 returns a list of errors, 2.11 a bool
        return [] if isinstance(validate(global_plan, metadata), list) else True

    planner._validate_global_plan = valid
    try:
        with _filled_ring_exchanges():
            yield
    finally:
        for name, fn in {**saved, **tensor_ops}.items():
            setattr(dist, name, fn)
        sp_comm._all_gather_single = sp_gather
        planner._validate_global_plan = validate


@contextlib.contextmanager
def tolerate_nonfinite(trainer_cls):
    """Decoded videos, losses and gradient norms made finite for the trainer's checks (random
    weights at real depth can overflow; under the fake group the values mean nothing)."""
    from miles.models.wan import WanModel

    saved = {
        "decode": WanModel.decode,
        "_all_finite": trainer_cls._all_finite,
        "_clip_grad_norm": trainer_cls._clip_grad_norm,
    }

    def decode(self, latents):
        return torch.nan_to_num(saved["decode"](self, latents), nan=0.5, posinf=1.0, neginf=0.0)

    def clip(self):
        norm = saved["_clip_grad_norm"](self)
        return norm if math.isfinite(norm) else 0.0

    WanModel.decode = decode
    trainer_cls._all_finite = lambda self, value: True
    trainer_cls._clip_grad_norm = clip
    try:
        yield
    finally:
        WanModel.decode = saved["decode"]
        trainer_cls._all_finite = saved["_all_finite"]
        trainer_cls._clip_grad_norm = saved["_clip_grad_norm"]

"""CUDA checks (skipped without a GPU): the ring kernels and the SP model path in bf16.

The ring kernels run one ring step on one GPU here (a ring of one rank through torch's ring
templates needs a process group: a world of 1 over NCCL); multi-GPU ring parity is issue 6.
"""

import os

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def nccl_world():
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29541")
        dist.init_process_group("nccl", rank=0, world_size=1)
    yield dist.group.WORLD


@pytest.mark.parametrize("backend", ["_native_flash", "_native_cudnn"])
def test_ring_kernel_matches_sdpa_bf16(nccl_world, backend):
    from miles.sequence_parallel import ring_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (1, 8, 2048, 128)  # (B, H, S, D) as SDPA takes it
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=g)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in)
    ref.backward(grad)
    ins = [t.clone().transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]  # (B, S, H, D)
    out = ring_attention(*ins, nccl_world, backend=backend)
    out.backward(grad.transpose(1, 2))

    def rel(a, b):
        return ((a.float() - b.float()).norm() / b.float().norm()).item()

    assert rel(out.transpose(1, 2), ref) < 8e-3
    for a, r in zip(ins, ref_in):
        assert rel(a.grad.transpose(1, 2), r.grad) < 8e-3

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


@pytest.mark.parametrize("per_token", [False, True], ids=["one-timestep", "per-token-timesteps"])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_block_calibration_predicts_a_chain_of_blocks(mode, per_token):
    """What ``measure_block_memory`` says one block keeps, times the number of blocks, is what a
    chain of blocks keeps after its forward (each block's output is the next one's saved input);
    also with Wan2.2 TI2V's per-token modulation input (B, S, 6, D), shared by the chain's blocks."""
    import copy

    from diffusers import WanTransformer3DModel

    from miles.parallel.checkpointing import measure_block_memory, wrap_block

    device, dtype, batch, tokens, n = torch.device("cuda"), torch.bfloat16, 2, 4096, 4
    model = WanTransformer3DModel(
        num_attention_heads=4, attention_head_dim=128, ffn_dim=1536, num_layers=1, text_dim=512
    )
    block = model.blocks[0].to(device=device, dtype=dtype).train()
    dim, g = 512, torch.Generator(device="cuda").manual_seed(0)

    def make_inputs():
        def r(*shape, dt=dtype):
            return torch.randn(*shape, device=device, dtype=dt, generator=g)

        rope = r(1, tokens, 1, 128, dt=torch.float32)
        hidden = r(batch, tokens, dim).requires_grad_()
        temb = r(*((batch, tokens, 6, dim) if per_token else (batch, 6, dim)))  # bf16, as the model's
        return hidden, r(batch, 512, dim), temb, (rope, rope)

    per_block = measure_block_memory(block, make_inputs, device)[mode]
    chain = [wrap_block(copy.deepcopy(block), mode) for _ in range(n)]
    hidden, *rest = make_inputs()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    x = hidden
    for b in chain:
        x = b(x, *rest)
    torch.cuda.synchronize()
    kept = torch.cuda.memory_allocated(device) - before
    assert abs(kept - n * per_block) <= 0.1 * n * per_block, (mode, kept, n * per_block)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_per_token_timesteps_cost_what_the_dry_run_says(compiled):
    """Per-token timesteps (Wan2.2 TI2V) make an eager block keep 32·D bytes a token more for
    backward and a compiled one nothing more (``miles.train.dry_run._block_bytes_per_token``;
    measured on CPU by saved-tensor accounting): the CUDA calibration agrees within 15% of 32·D."""
    from diffusers import WanTransformer3DModel

    from miles.parallel.checkpointing import measure_block_memory
    from miles.train.dry_run import _block_bytes_per_token

    device, dtype, batch, tokens, dim = torch.device("cuda"), torch.bfloat16, 2, 4096, 512
    model = WanTransformer3DModel(
        num_attention_heads=4, attention_head_dim=128, ffn_dim=1536, num_layers=1, text_dim=512
    )
    block = model.blocks[0].to(device=device, dtype=dtype).train()

    def none_bytes(per_token):
        def make_inputs():
            temb_shape = (batch, tokens, 6, dim) if per_token else (batch, 6, dim)
            rope = torch.randn(1, tokens, 1, 128, device=device)
            return (
                torch.randn(batch, tokens, dim, device=device, dtype=dtype, requires_grad=True),
                torch.randn(batch, 512, dim, device=device, dtype=dtype),
                torch.randn(temb_shape, device=device, dtype=dtype),  # as the model passes it
                (rope, rope),
            )

        return measure_block_memory(block, make_inputs, device, compiled=compiled)["none"]

    measured = (none_bytes(True) - none_bytes(False)) / (batch * tokens)
    formula = [_block_bytes_per_token(dim, 1536, 2, compiled, p)["none"] for p in (False, True)]
    expected = formula[1] - formula[0]
    assert abs(measured - expected) <= 0.15 * 32 * dim, (measured / dim, expected / dim)

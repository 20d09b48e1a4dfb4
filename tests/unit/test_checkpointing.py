"""Activation checkpointing modes: same gradients as no checkpointing; the budget planner."""

import copy

import pytest
import torch
from diffusers import WanTransformer3DModel

from miles.parallel.checkpointing import apply_checkpointing, checkpoint_modes, plan_modes

TINY = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=8,
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=16,
    ffn_dim=32,
    num_layers=3,
    rope_max_seq_len=32,
)


def _grads(model, x, t, ctx):
    model.zero_grad(set_to_none=True)
    out = model(x, t, ctx, return_dict=False)[0]
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "modes", [["full"] * 3, ["selective"] * 3, ["attention"] * 3, ["none", "selective", "full"]]
)
def test_checkpointed_gradients_equal_plain(modes):
    torch.manual_seed(0)
    ref = WanTransformer3DModel(**TINY).train()
    model = copy.deepcopy(ref)
    apply_checkpointing(model.blocks, modes)
    x, t, ctx = torch.randn(2, 4, 2, 8, 8), torch.tensor([300.0, 700.0]), torch.randn(2, 5, 16)
    out_ref, g_ref = _grads(ref, x, t, ctx)
    out, g = _grads(model, x, t, ctx)
    assert torch.equal(out, out_ref)
    names = {n.replace("._checkpoint_wrapped_module", ""): v for n, v in g.items()}
    assert names.keys() == g_ref.keys()
    for n, v in g_ref.items():
        assert torch.equal(names[n], v), n


def test_budget_planner():
    costs = {"none": 10.0, "selective": 4.0, "attention": 2.0, "full": 1.0}
    # once a block is checkpointed, one block's full activations (10) are added for its recompute
    assert plan_modes(4, costs, 40.0) == ["none"] * 4
    assert plan_modes(4, costs, 39.0) == ["none", "none", "selective", "selective"]
    assert plan_modes(4, costs, 26.0) == ["selective"] * 4
    assert plan_modes(4, costs, 22.0) == ["selective", "selective", "attention", "attention"]
    assert plan_modes(4, costs, 15.0) == ["attention", "full", "full", "full"]
    with pytest.raises(ValueError, match="over the budget"):
        plan_modes(4, costs, 13.0)
    assert checkpoint_modes("full", 2) == ["full", "full"]
    with pytest.raises(ValueError, match="unknown activation checkpointing"):
        checkpoint_modes("half", 2)
    with pytest.raises(ValueError, match="budget is spent"):
        checkpoint_modes("budget", 2, -1.0, costs)


@pytest.mark.parametrize("per_token", [False, True], ids=["one-timestep", "expand-timesteps"])
def test_calibration_inputs_have_the_shapes_the_model_passes_its_blocks(per_token):
    """The block calibration feeds block 0 what the stock forward feeds it in bf16 compute: with
    per-token timesteps (Wan2.2 TI2V) the modulation input is (B, S, 6, D), not (B, 6, D), and in
    bf16, not fp32 (a compiled block keeps per-token fp32 products of an fp32 input, not of bf16)."""
    import miles.parallel.checkpointing as checkpointing
    from miles.models.wan import calibrate_block_memory

    torch.manual_seed(0)
    model = WanTransformer3DModel(**TINY).to(torch.bfloat16)
    x, ctx = torch.randn(2, 4, 2, 8, 8, dtype=torch.bfloat16), torch.randn(2, 5, 16, dtype=torch.bfloat16)
    tokens = 2 * 4 * 4
    t = torch.full((2, tokens) if per_token else (2,), 500.0)
    seen = {}

    def shapes(args):
        hidden, _context, temb, rope = args
        return hidden.shape, temb.shape, temb.dtype, tuple(r.shape for r in rope)

    hook = model.blocks[0].register_forward_pre_hook(lambda m, args: seen.update(stock=shapes(args)))
    model(x, t, ctx, return_dict=False)
    hook.remove()

    def measure(block, make_inputs, device, compiled=False):
        seen["calibration"] = shapes(make_inputs())
        return {m: 0.0 for m in checkpointing.MODES}

    saved = checkpointing.measure_block_memory
    checkpointing.measure_block_memory = measure
    try:
        calibrate_block_memory(model, tokens, torch.device("cpu"), batch=2, per_token_timesteps=per_token)
    finally:
        checkpointing.measure_block_memory = saved
    assert seen["calibration"] == seen["stock"]

"""Sharded loading (miles.models.sharded_load) against the whole-model load it replaces.

The reference is the old path: ``from_pretrained`` the whole expert in fp32, LoRA (peft), SP,
FSDP2. The sharded path builds a meta skeleton, applies LoRA there (peft's own draw, captured),
installs SP and FSDP2 and reads each rank's slices. For each case (gloo, world 2 and 4: dp x sp
layouts, a 2-D HSDP mesh; full fine-tune and LoRA in fp32 and bf16; a single safetensors file, a
sharded one with its index and a bf16 one), bitwise: every parameter's full tensor, the RNG
state after LoRA, and a forward output. Through the real Trainer: the DiffusionNFT old policy and
a full fine-tune's KL reference equal the policy they were copied from (what the deep copies
held), local shard by local shard. ``model.init: random`` builds from a folder holding no weight
file, the same weights at world 1 and world 2.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.dist_utils import FIXED_SEEDS, run_pooled

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / ".cache" / "tiny-wan"
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]


def _lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8.0, init_lora_weights="gaussian", target_modules=TARGETS)


def _parallelize(model, sp_mesh, fsdp_mesh, dtype):
    from miles.parallel.fsdp import apply_fsdp
    from miles.sequence_parallel import apply_sequence_parallel

    if sp_mesh is not None:
        apply_sequence_parallel(model, sp_mesh)
    apply_fsdp(model, fsdp_mesh, param_dtype=dtype)
    return model


def _old_path(folder, lora, dtype, sp_mesh, fsdp_mesh):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(FIXED_SEEDS[1])
    model = WanTransformer3DModel.from_pretrained(folder, torch_dtype=torch.float32)
    if lora:
        model.requires_grad_(False)
        model.add_adapter(_lora_config())
    rng = torch.rand(4)
    return _parallelize(model, sp_mesh, fsdp_mesh, dtype), rng


def _new_path(root, sub, lora, dtype, sp_mesh, fsdp_mesh):
    from miles.models.sharded_load import WeightFiles, add_lora, build_skeleton, cast_frozen, materialize

    torch.manual_seed(FIXED_SEEDS[1])
    model = build_skeleton(root, sub)
    adapters = {}
    if lora:
        model.requires_grad_(False)
        adapters = add_lora(model, _lora_config())
        if dtype is not None:
            cast_frozen(model, dtype)
    rng = torch.rand(4)
    assert all(p.is_meta for p in model.parameters())
    _parallelize(model, sp_mesh, fsdp_mesh, dtype)
    materialize(model, torch.device("cpu"), WeightFiles(root / sub), adapters)
    return model, rng


def _forward(model, config):
    g = torch.Generator().manual_seed(FIXED_SEEDS[0])
    latents = torch.randn(1, config.in_channels, 2, 8, 8, generator=g)
    text = torch.randn(1, 16, config.text_dim, generator=g)
    dtype = getattr(model, "_miles_compute_dtype", torch.float32)
    with torch.no_grad():
        return model(latents.to(dtype), torch.tensor([937.7]), text.to(dtype), return_dict=False)[0]


def _compare(name, old, new, lora, dtype):
    olds = dict(old.named_parameters())
    news = dict(new.named_parameters())
    assert olds.keys() == news.keys(), f"{name}: parameter names differ"
    keep = set(new._keep_in_fp32_modules or [])
    for key, p in news.items():
        want = olds[key].full_tensor()
        got = p.full_tensor()
        frozen_cast = (
            lora and dtype is not None and "lora_" not in key and not keep.intersection(key.split("."))
        )
        assert got.dtype == (dtype if frozen_cast else torch.float32), f"{name}: {key} is {got.dtype}"
        assert p.placements == olds[key].placements, f"{name}: {key} placed unlike the old path"
        assert torch.equal(got, want.to(got.dtype)), f"{name}: {key} differs"
        assert p.requires_grad == olds[key].requires_grad, f"{name}: {key} requires_grad differs"
    for (bn, b), (_, ob) in zip(new.named_buffers(), old.named_buffers()):
        assert torch.equal(b, ob), f"{name}: buffer {bn} differs"
    out_old, out_new = _forward(old, old.config), _forward(new, new.config)
    assert torch.equal(out_new, out_old), f"{name}: forward differs by {(out_new - out_old).abs().max()}"


def _write_variants(root: Path, out: Path) -> dict[str, Path]:
    """Copies of the tiny two-expert folder: weights as one file, sharded with an index, in bf16."""
    from diffusers import WanTransformer3DModel

    folders = {"single": root}
    for kind in ("sharded", "bf16"):
        folder = out / kind
        shutil.copytree(root, folder, ignore=shutil.ignore_patterns("*.safetensors*"), dirs_exist_ok=True)
        for sub in ("transformer", "transformer_2"):
            m = WanTransformer3DModel.from_pretrained(root / sub, torch_dtype=torch.float32)
            if kind == "bf16":
                m = m.to(torch.bfloat16)
            m.save_pretrained(folder / sub, max_shard_size="100KB" if kind == "sharded" else "10GB")
        folders[kind] = folder
    assert (folders["sharded"] / "transformer" / "diffusion_pytorch_model.safetensors.index.json").is_file()
    return folders


def _body(rank, world_size, folders, cases):
    from torch.distributed.device_mesh import init_device_mesh

    from miles.parallel.topology import ParallelDims, build_parallel_mesh

    torch.use_deterministic_algorithms(True)
    folders = {k: Path(v) for k, v in folders.items()}
    for layout, lora, dtype_name, files, sub in cases:
        dtype = {"float32": None, "bfloat16": torch.bfloat16}[dtype_name]
        if layout == "hsdp":
            sp_mesh, fsdp_mesh = (
                None,
                init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("rep", "shard")),
            )
        else:
            sp = int(layout[2:])
            mesh = build_parallel_mesh(ParallelDims(world_size=world_size, sequence_parallel_size=sp), "cpu")
            sp_mesh, fsdp_mesh = (mesh if sp > 1 else None), mesh.fsdp_mesh
        name = f"world {world_size} {layout} {'lora' if lora else 'full'} {dtype_name} {files} {sub}"
        root = folders[files]
        old, rng_old = _old_path(root / sub, lora, dtype, sp_mesh, fsdp_mesh)
        new, rng_new = _new_path(root, sub, lora, dtype, sp_mesh, fsdp_mesh)
        assert torch.equal(rng_old, rng_new), f"{name}: LoRA consumed the RNG differently"
        _compare(name, old, new, lora, dtype)
        if rank == 0:
            print(f"[sharded_load] {name}: bitwise", flush=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from miles.models.tiny import tiny_model_path

    root = tiny_model_path(str(TINY), "two_expert")
    return {k: str(v) for k, v in _write_variants(Path(root), tmp_path_factory.mktemp("weights")).items()}


def test_sharded_load_world2_is_bitwise_the_whole_load(folders):
    cases = [
        ("sp1", False, "float32", "single", "transformer"),
        ("sp2", False, "float32", "sharded", "transformer_2"),
        ("sp2", True, "float32", "single", "transformer"),
        ("sp1", True, "float32", "sharded", "transformer_2"),
        ("sp1", True, "bfloat16", "bf16", "transformer"),
        ("sp2", False, "bfloat16", "bf16", "transformer"),
    ]
    run_pooled(_body, 2, folders, cases)


def test_sharded_load_world4_and_hsdp_are_bitwise_the_whole_load(folders):
    cases = [
        ("sp2", False, "float32", "sharded", "transformer"),
        ("sp4", True, "float32", "single", "transformer_2"),
        ("hsdp", False, "float32", "single", "transformer"),
        ("hsdp", True, "bfloat16", "sharded", "transformer_2"),
    ]
    run_pooled(_body, 4, folders, cases)


def _trainer(out_dir, name, *args):
    from miles.config import parse_args
    from miles.train.trainer import Trainer

    cfg, _ = parse_args(
        ["--config", str(REPO / "configs" / "tiny_cpu.yaml"), "--run.output-dir", out_dir]
        + ["--run.name", name, "--run.wandb-mode", "disabled", "--run.no-progress", "--train.no-export"]
        + ["--model.tiny-model-dir", str(TINY), "--data.prompts-per-rank", "1", *args]
    )
    return Trainer(cfg)


def _assert_copy(name, copy_, policy, dtype=None):
    """``copy_`` holds the policy's local shards (cast to ``dtype``), placed alike, and computes
    the same forward."""
    from miles.models.sharded_load import clean_name

    policies = {clean_name(k): p for k, p in policy.named_parameters()}
    copies = {clean_name(k): p for k, p in copy_.named_parameters()}
    assert copies.keys() == policies.keys(), f"{name}: parameter names differ"
    keep = set(copy_._keep_in_fp32_modules or [])
    for key, p in copies.items():
        q = policies[key]
        assert p.placements == q.placements, f"{name}: {key} placed unlike the policy"
        want = q.to_local().detach()
        if dtype is not None and not keep.intersection(key.split(".")):
            want = want.to(dtype)
        assert p.to_local().dtype == want.dtype and torch.equal(p.to_local(), want), f"{name}: {key} differs"
        assert not p.requires_grad, f"{name}: {key} trains"
    assert torch.equal(_forward(copy_, copy_.config), _forward(policy, policy.config)), (
        f"{name}: forward differs"
    )


def _copies_body(rank, world_size, out_dir):
    # activation checkpointing wraps the policy's blocks, not the copies': names must still pair up
    ckpt = ("--model.activation-checkpointing", "full")
    trainer = _trainer(out_dir, "nft", "--algorithm.name", "diffusion_nft", "--model.lora-rank", "4", *ckpt)
    assert trainer.reference is None
    assert any("_checkpoint_wrapped_module" in k for k, _ in trainer.model.transformers[0].named_parameters())
    assert len(trainer.old_policy.pairs) == sum(
        p.requires_grad for t in trainer.model.transformers for p in t.parameters()
    )
    for i, (old, policy) in enumerate(zip(trainer.old_policy.transformers, trainer.model.transformers)):
        _assert_copy(f"old policy {i}", old, policy)
    trainer.close()
    trainer = _trainer(out_dir, "kl", "--grpo.kl-beta", "0.01", "--sequence-parallel-size", "2", *ckpt)
    assert trainer.old_policy is None and len(trainer.reference) == 2
    for i, (ref, policy) in enumerate(zip(trainer.reference, trainer.model.transformers)):
        _assert_copy(f"reference {i}", ref, policy, dtype=trainer.compute_dtype)
    trainer.close()


def test_old_policy_and_kl_reference_are_the_policy_shard_by_shard(tmp_path):
    run_pooled(_copies_body, 2, str(tmp_path))


def _random_body(rank, world_size, folder, out_file, sp):
    trainer = _trainer(
        str(Path(out_file).parent), f"random{world_size}", "--model.path", folder, "--model.init", "random",
        "--sequence-parallel-size", str(sp), "--model.lora-rank", "4",
    )  # fmt: skip
    state = {}
    for i, t in enumerate(trainer.model.transformers):
        for key, p in t.named_parameters():
            state[f"{i}.{key}"] = p.full_tensor()
        assert torch.isfinite(_forward(t, t.config)).all()
    pos, neg = trainer.model.encode_prompts(["a red ball"], "", 16, "cpu")
    assert torch.isfinite(pos).all() and torch.isfinite(neg).all()
    if rank == 0:
        torch.save(state, out_file)
    trainer.close()


def test_random_init_reads_no_weight_file_and_is_the_same_in_every_layout(tmp_path):
    from miles.models.tiny import tiny_model_path

    folder = tmp_path / "config-only"
    shutil.copytree(
        tiny_model_path(str(TINY), "two_expert"),
        folder,
        ignore=shutil.ignore_patterns("*.safetensors*", "*.bin"),
    )
    assert not list(folder.rglob("*.safetensors"))
    run_pooled(_random_body, 2, str(folder), str(tmp_path / "w2.pt"), 2)
    run_pooled(_random_body, 1, str(folder), str(tmp_path / "w1.pt"), 1)
    w1, w2 = torch.load(tmp_path / "w1.pt"), torch.load(tmp_path / "w2.pt")
    assert w1.keys() == w2.keys()
    for key in w1:
        assert torch.equal(w1[key], w2[key]), f"{key} depends on the layout"
    assert not torch.equal(w1["0.proj_out.weight"], w1["1.proj_out.weight"]), "the two experts are the same"
    base = [k for k in w1 if "lora_" not in k and k.endswith(".weight") and w1[k].dim() == 2]
    assert all(w1[k].std() > 0 for k in base), "a matrix was not drawn"
    # the whole (unsharded) random load of load_wan(experts="load") gives the same weights
    from miles.config import ModelConfig
    from miles.models.sharded_load import file_key
    from miles.models.wan import load_wan

    whole = load_wan(ModelConfig(path=str(folder), init="random"), torch.device("cpu"), seed=0)
    for i, t in enumerate(whole.transformers):
        state = dict(t.named_parameters())
        for key in (k for k in w1 if k.startswith(f"{i}.") and "lora_" not in k):
            assert torch.equal(state[file_key(key[2:])], w1[key]), f"whole random load: {key} differs"

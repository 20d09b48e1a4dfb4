"""The embedded tiny Wan pipeline: deterministic build, offline round trip through from_pretrained."""

import hashlib

import pytest
import torch

from miles.models import tiny


def _digests(root):
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_build_twice_is_byte_identical(tmp_path):
    a = tiny.build_tiny_models(tmp_path / "a")
    b = tiny.build_tiny_models(tmp_path / "b")
    da, db = _digests(a), _digests(b)
    assert da == db
    assert any(k.endswith("transformer_2/diffusion_pytorch_model.safetensors") for k in da)
    assert not any("transformer_2" in k for k in da if k.startswith("single_expert"))


@pytest.mark.parametrize("variant", tiny.VARIANTS)
def test_round_trip_offline(tmp_path, monkeypatch, variant):
    from diffusers import WanPipeline

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = tiny.tiny_model_path(tmp_path, variant)
    built = tiny.build_pipeline(variant)
    loaded = WanPipeline.from_pretrained(path)
    assert (loaded.config.boundary_ratio is not None) == (variant == "two_expert")
    assert (loaded.transformer_2 is not None) == (variant == "two_expert")
    # several heads (Ulysses 2 and 4 divide them), at least 2 blocks
    cfg = loaded.transformer.config
    assert cfg.num_attention_heads % 4 == 0 and cfg.num_layers >= 2

    ids = loaded.tokenizer(["a red fox"], padding="max_length", max_length=16, return_tensors="pt")
    ids_built = built.tokenizer(["a red fox"], padding="max_length", max_length=16, return_tensors="pt")
    assert torch.equal(ids.input_ids, ids_built.input_ids)

    torch.manual_seed(0)
    x = torch.randn(1, 16, 2, 8, 8)
    ctx = torch.randn(1, 7, cfg.text_dim)
    t = torch.tensor([500.0])
    with torch.no_grad():
        y_loaded = loaded.transformer(x, t, ctx, return_dict=False)[0]
        y_built = built.transformer(x, t, ctx, return_dict=False)[0]
        emb_l = loaded.text_encoder(ids.input_ids).last_hidden_state
        emb_b = built.text_encoder(ids.input_ids).last_hidden_state
        z = torch.randn(1, 16, 2, 4, 4)
        v_l = loaded.vae.decode(z, return_dict=False)[0]
        v_b = built.vae.decode(z, return_dict=False)[0]
    assert torch.equal(y_loaded, y_built) and y_loaded.shape == x.shape
    assert torch.equal(emb_l, emb_b)
    assert torch.equal(v_l, v_b) and v_l.shape == (1, 3, 5, 32, 32)


def test_random_text_encoder_is_the_seeded_draw(tmp_path):
    """``model.init: random`` builds the text encoder without transformers' own init and fills it
    from RandomInit in row chunks: every parameter equals the whole-tensor draw for its seed."""
    from miles.config import ModelConfig
    from miles.models.sharded_load import RandomInit
    from miles.models.wan import fill_random, load_wan

    path = tiny.tiny_model_path(tmp_path, "single_expert")
    cfg = ModelConfig(path=str(path), init="random")
    a = load_wan(cfg, torch.device("cpu"), seed=3).pipeline.text_encoder
    b = load_wan(cfg, torch.device("cpu"), seed=4).pipeline.text_encoder
    source = RandomInit(seed=3, salt="text_encoder")
    for name, p in a.named_parameters():
        shape = tuple(p.shape)
        want = source.read(name, (0,) * p.dim(), shape, shape, torch.device("cpu")).to(p.dtype)
        assert torch.equal(p, want), f"{name} is not the seeded draw"
    matrices = [n for n, p in a.named_parameters() if p.dim() == 2]
    assert matrices and all(not torch.equal(a.get_parameter(n), b.get_parameter(n)) for n in matrices), (
        "another seed gave the same text encoder"
    )
    # the chunked fill is the one-shot fill
    fine = load_wan(cfg, torch.device("cpu"), seed=3).pipeline.text_encoder
    fill_random(fine, source, torch.device("cpu"), chunk_numel=1000)
    for (name, p), q in zip(a.named_parameters(), fine.parameters()):
        assert torch.equal(p, q), f"{name} depends on the chunk size"


def test_concurrent_builder_keeps_a_published_folder(tmp_path, monkeypatch):
    """Runs launched side by side on a fresh cache each build the tiny models: a variant another
    process published while this one was building stays in place (it was deleted under its readers,
    and a band launch failed reading a half-removed folder), and this build's copy is discarded."""

    class Fake:
        def __init__(self, variant):
            self.variant = variant

        def save_pretrained(self, folder, safe_serialization=True):
            other = tmp_path / self.variant  # another process publishes meanwhile
            other.mkdir(exist_ok=True)
            (other / "model_index.json").write_text("{}")
            (other / "theirs").write_text("kept")
            (folder / "model_index.json").write_text("{}")

    monkeypatch.setattr(tiny, "build_pipeline", Fake)
    tiny.build_tiny_models(tmp_path)
    for variant in tiny.ALL_VARIANTS:
        assert (tmp_path / variant / "theirs").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(tiny.ALL_VARIANTS)  # no temp folder left
    tiny.build_tiny_models(tmp_path, force=True)  # force rebuilds: this process's copy replaces theirs
    assert not (tmp_path / tiny.ALL_VARIANTS[0] / "theirs").exists()

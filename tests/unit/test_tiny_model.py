"""The embedded tiny Wan pipeline: deterministic build, offline round trip through from_pretrained."""

import hashlib
import json
import multiprocessing
import time

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


class _CountingBuild:
    """A stand-in for ``build_pipeline`` that is slow and counts its builds in ``log``."""

    def __init__(self, log, delay_s=0.0):
        self.log, self.delay_s = log, delay_s

    def __call__(self, variant):
        log, delay_s = self.log, self.delay_s

        class Fake:
            def save_pretrained(self, folder, safe_serialization=True):
                with open(log, "a") as f:
                    f.write(variant + "\n")
                time.sleep(delay_s)
                (folder / "model_index.json").write_text(json.dumps({"text_encoder": ["transformers", "X"]}))
                (folder / "text_encoder").mkdir()
                (folder / "text_encoder" / "model.safetensors").write_bytes(b"w" * 64)

        return Fake()


def _race(root, log):
    tiny.build_pipeline = _CountingBuild(log, delay_s=0.3)  # in this forked child only
    tiny.tiny_model_path(root, "two_expert")


def test_ranks_racing_on_a_fresh_cache_build_each_variant_once(tmp_path):
    """The ranks of a launch all ask for the tiny model on a fresh cache at once (issue 46: the I2V
    try-it failed in 2 of 3 fresh clones, a text_encoder folder left empty): under the build lock
    the first builds each variant once and the others find it whole."""
    log = tmp_path / "builds.log"
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_race, args=(tmp_path / "cache", log)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    built = log.read_text().split()
    assert sorted(built) == sorted(tiny.ALL_VARIANTS), f"variants built more than once: {built}"
    assert all(tiny.is_complete(tmp_path / "cache" / v) for v in tiny.ALL_VARIANTS)
    assert not [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".") and p.is_dir()]


def test_a_folder_with_a_missing_or_cut_file_is_rebuilt(tmp_path, monkeypatch):
    """A folder with its ``model_index.json`` but an emptied component (the state the race left) is
    not taken as complete: it is rebuilt, and only it."""
    log = tmp_path / "builds.log"
    monkeypatch.setattr(tiny, "build_pipeline", _CountingBuild(log))
    root = tmp_path / "cache"
    tiny.build_tiny_models(root)
    log.unlink()
    for f in (root / "ti2v" / "text_encoder").iterdir():
        f.unlink()  # the empty text_encoder folder of the issue
    (root / "i2v" / "text_encoder" / "model.safetensors").write_bytes(b"w")  # cut short
    assert (root / "ti2v" / "model_index.json").is_file() and not tiny.is_complete(root / "ti2v")
    path = tiny.tiny_model_path(root, "single_expert")
    assert sorted(log.read_text().split()) == ["i2v", "ti2v"]
    assert path == root / "single_expert" and tiny.is_complete(root / "ti2v")
    # an old folder with no manifest (built before it existed) is rebuilt too
    (root / "i2v" / tiny.MANIFEST).unlink()
    tiny.build_tiny_models(root)
    assert log.read_text().split()[-1] == "i2v"


def test_force_rebuilds_a_published_folder(tmp_path, monkeypatch):
    log = tmp_path / "builds.log"
    monkeypatch.setattr(tiny, "build_pipeline", _CountingBuild(log))
    tiny.build_tiny_models(tmp_path / "c")
    (tmp_path / "c" / "two_expert" / "theirs").write_text("old")
    tiny.build_tiny_models(tmp_path / "c", force=True)
    assert not (tmp_path / "c" / "two_expert" / "theirs").exists()
    assert len(log.read_text().split()) == 2 * len(tiny.ALL_VARIANTS)

"""Tiny image-to-video Wan pipelines, built in code like the T2V ones (``miles.models.tiny``).

Three variants, one per way the Wan family conditions on a first frame (each an ordinary
diffusers folder, loadable with ``WanImageToVideoPipeline.from_pretrained``):

- ``i2v`` (Wan2.1-I2V-14B): ``WanImageToVideoPipeline``; the transformer takes 36 input channels
  (16 noise + 4 frame-mask + 16 VAE-encoded image-and-zeros video) and CLIP image embeddings
  through the ``add_k_proj`` cross-attention branch. A tiny CLIP vision tower (28x28 images,
  patch 14: 5 tokens) and its ``CLIPImageProcessor`` stand in for CLIP ViT-H/14. Wan's
  attention processor splits the context at a hard-coded 512 text tokens, so this variant
  must be run with ``data.max_sequence_length: 512``.
- ``i2v_two_expert`` (Wan2.2-I2V-A14B): the same channel concatenation, two experts switched
  at ``boundary_ratio``, no image encoder.
- ``ti2v`` (Wan2.2-TI2V-5B): a ``WanPipeline`` folder with ``expand_timesteps``: in its image
  mode (``model.task: i2v``) the first latent frame is the encoded image, kept clean by a
  per-token timestep of 0.
"""

from __future__ import annotations

import torch

I2V_VARIANTS = ("i2v", "i2v_two_expert", "ti2v")
I2V_TEXT_TOKENS = 512
"""The text length Wan's ``add_k_proj`` branch assumes (diffusers' WanAttnProcessor)."""
TINY_CLIP = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
    projection_dim=32,
)
I2V_BOUNDARY_RATIO = 0.9  # Wan2.2-I2V-A14B's


def _image_encoder():
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(4)
    encoder = CLIPVisionModel(CLIPVisionConfig(**TINY_CLIP)).eval()
    size = TINY_CLIP["image_size"]
    processor = CLIPImageProcessor(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}, do_center_crop=True
    )
    return encoder, processor


def build_i2v_pipeline(variant: str):
    """Construct a tiny I2V pipeline in memory with fixed seeds (text encoder, tokenizer and VAE
    are the T2V tiny model's)."""
    from diffusers import WanImageToVideoPipeline, WanPipeline, WanTransformer3DModel

    from miles.models import tiny_t2v as tiny

    if variant not in I2V_VARIANTS:
        raise ValueError(f"unknown tiny I2V variant {variant!r}; choose one of {I2V_VARIANTS}")
    base = tiny.build_t2v_pipeline("single_expert")
    z = tiny.TINY_VAE["z_dim"]
    temporal = base.vae.config.scale_factor_temporal
    if variant == "ti2v":
        torch.manual_seed(7)
        transformer = WanTransformer3DModel(**tiny.TINY_TRANSFORMER)
        return WanPipeline(
            tokenizer=base.tokenizer,
            text_encoder=base.text_encoder,
            vae=base.vae,
            scheduler=base.scheduler,
            transformer=transformer,
            expand_timesteps=True,
        )
    concat = dict(tiny.TINY_TRANSFORMER, in_channels=z + temporal + z)  # noise + mask + image latents
    image_encoder = image_processor = None
    if variant == "i2v":
        image_encoder, image_processor = _image_encoder()
        inner = concat["num_attention_heads"] * concat["attention_head_dim"]
        concat.update(image_dim=TINY_CLIP["hidden_size"], added_kv_proj_dim=inner)
    torch.manual_seed(5)
    transformer = WanTransformer3DModel(**concat)
    transformer_2 = None
    if variant == "i2v_two_expert":
        torch.manual_seed(6)
        transformer_2 = WanTransformer3DModel(**concat)
    return WanImageToVideoPipeline(
        tokenizer=base.tokenizer,
        text_encoder=base.text_encoder,
        vae=base.vae,
        scheduler=base.scheduler,
        image_processor=image_processor,
        image_encoder=image_encoder,
        transformer=transformer,
        transformer_2=transformer_2,
        boundary_ratio=I2V_BOUNDARY_RATIO if transformer_2 is not None else None,
    )

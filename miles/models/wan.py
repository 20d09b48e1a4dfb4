"""The Wan model backend: load a local diffusers Wan folder, encode prompts, decode videos.

Covers Wan2.1 T2V (one expert), Wan2.2 TI2V-5B (one expert, 2-D timesteps) and Wan2.2 A14B
(two experts: ``transformer`` for high noise, ``transformer_2`` for low noise, switched at
``boundary_ratio``), their image-to-video forms (Wan2.1-I2V, Wan2.2-I2V-A14B, TI2V-5B's image
mode: ``miles.models.i2v``, ``miles.rollout.condition``), and the embedded tiny models. The text
encoder and VAE are frozen and replicated on every rank; only the transformer(s) are trained,
sharded and sequence-parallel. The run reaches it through the model-family seam
(:mod:`miles.models.family`, :mod:`miles.models.wan_family`): :class:`WanModel` is the family's
``FamilyModel``, :class:`WanRouting` its ``ExpertRouting``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from miles.models.dtypes import DTYPES, text_encoder_dtype, text_encoder_on
from miles.models.folder import read_json, read_pipeline_index, resolve_model_path  # noqa: F401
from miles.models.i2v import check_i2v_run, condition_mode, encode_image_condition, text_pipeline
from miles.rollout.condition import ImageCondition
from miles.rollout.sampler import NUM_TRAIN_TIMESTEPS, diffusers_call
from miles.rollout.schedule import FlowSchedule

EXPERT_FOLDERS = ("transformer", "transformer_2")  # high noise, low noise
WAN_PIPELINES = frozenset({"WanPipeline", "WanImageToVideoPipeline", "WanVideoToVideoPipeline"})


@dataclass(frozen=True)
class WanRouting:
    """How a Wan folder's experts are called (the family's ``ExpertRouting``): Wan2.2 A14B's
    ``transformer`` (high noise) runs while t >= boundary_ratio·1000 and ``transformer_2`` below,
    WanPipeline's rule; Wan2.2 TI2V (``expand_timesteps``) takes one timestep per token."""

    boundary_ratio: float | None = None
    expand_timesteps: bool = False

    @property
    def boundary_sigma(self) -> float | None:
        """σ at which the low-noise expert takes over (t = 1000·σ)."""
        return self.boundary_ratio

    @property
    def per_token_timesteps(self) -> bool:
        return self.expand_timesteps

    def expert_index(self, t: float | Tensor, num_experts: int) -> int:
        """0 (``transformer``) when there is one expert or t >= boundary_ratio·1000, else 1
        (``transformer_2``); t compared in fp32 as the pipeline compares its scheduler timestep."""
        if num_experts == 1:
            return 0
        if num_experts != 2:
            raise ValueError(f"Wan has 1 or 2 experts, got {num_experts}")
        if self.boundary_ratio is None:
            raise ValueError("two experts need a boundary_ratio (Wan2.2 A14B uses 0.875)")
        t32 = torch.as_tensor(t, dtype=torch.float32)
        return 0 if bool(t32 >= self.boundary_ratio * NUM_TRAIN_TIMESTEPS) else 1

    def model_timestep(self, t: Tensor, x: Tensor, expert: nn.Module) -> Tensor:
        """The timestep ``expert`` takes for samples' timesteps ``t`` (B,) at model input ``x``
        (B, C, F, H, W): ``t`` itself, or with ``expand_timesteps`` one per token, (B, S)."""
        if not self.expand_timesteps:
            return t
        pt, ph, pw = expert.config.patch_size
        _, _, f, h, w = x.shape
        return t[:, None].expand(-1, (f // pt) * (h // ph) * (w // pw))

    def forward(self, expert: nn.Module, x: Tensor, timestep: Tensor, text: Tensor, **extra) -> Tensor:
        """The expert's output at model input ``x`` (B, C, F, H, W): diffusers' Wan call, the text
        embeddings as they are."""
        return diffusers_call(expert, x, timestep, text, **extra)

    def report(self, num_experts: int) -> dict:
        """The run plan's fields (its JSON keys) and the dry run's words for them."""
        return {
            "boundary_ratio": self.boundary_ratio,
            "expand_timesteps": self.expand_timesteps,
            "expert_switch": f"boundary_ratio {self.boundary_ratio}" if num_experts == 2 else None,
            "timestep_layout": "per-token timesteps" if self.expand_timesteps else None,
        }


# The VAE decoder's peak working set in bytes per output pixel, per channel of its base width and per
# byte of its dtype: the live storages through AutoencoderKLWan.decode, tracked on CPU at two widths
# of each VAE (tests/unit/test_resident_memory.py measures it again). The Wan2.2 VAE (residual,
# patch 2) runs its last stages at half resolution. Against the GPU rehearsal (81 frames): the Wan2.1
# VAE at 480x832 kept 8.76 GiB, this says 8.0; the Wan2.2 VAE at 704x1280 20.6, this says 20.0.
VAE_DECODER_BYTES = {"wan2.1": 51.0, "wan2.2": 21.4}


def vae_decoder_memory(vae_config) -> tuple[int, float]:
    """(d, k) of an AutoencoderKLWan config: the decoder's base width d (decoder_base_dim, else base_dim)
    and k, its peak bytes per output pixel per channel of d per dtype byte (``VAE_DECODER_BYTES``)."""
    base = int(getattr(vae_config, "decoder_base_dim", None) or getattr(vae_config, "base_dim", 96) or 96)
    return base, VAE_DECODER_BYTES["wan2.2" if getattr(vae_config, "is_residual", False) else "wan2.1"]


@dataclass
class WanModel:
    """What the trainer needs of a loaded Wan pipeline (the family's ``FamilyModel``)."""

    path: Path
    transformers: list[nn.Module]  # [high-noise expert, low-noise expert] or [the one]
    boundary_ratio: float | None
    expand_timesteps: bool  # Wan2.2 TI2V: per-token (2-D) timesteps
    pipeline: object  # the diffusers WanPipeline (text encoder, tokenizer, VAE)
    condition_mode: str | None = None  # image-to-video: "concat" or "first_frame" (miles.rollout.condition)
    image_pipeline: object | None = None  # image-to-video: the WanImageToVideoPipeline sharing the modules
    text_encoder_offload: bool = False  # the text encoder lives on the CPU and visits the device to encode

    @property
    def routing(self) -> WanRouting:
        return WanRouting(self.boundary_ratio, self.expand_timesteps)

    @property
    def expert_folders(self) -> tuple[str, ...]:
        """The folder of each expert, in ``transformers`` order."""
        return EXPERT_FOLDERS[: len(self.transformers)]

    def calibrate_block_memory(
        self, transformer: nn.Module, tokens: int, device, **options
    ) -> dict[str, float]:
        """:func:`calibrate_block_memory` of one of this model's experts, its timesteps shaped as the model's."""
        return calibrate_block_memory(
            transformer, tokens, device, per_token_timesteps=self.expand_timesteps, **options
        )

    @property
    def num_attention_heads(self) -> int:
        return self.transformers[0].config.num_attention_heads

    def vae_decoder_memory(self) -> tuple[int, float]:
        """(d, k) of this model's VAE decoder for the memory plan (:func:`vae_decoder_memory`)."""
        vae = getattr(self.pipeline, "vae", None)
        return vae_decoder_memory(vae.config) if getattr(vae, "config", None) is not None else (0, 0.0)

    def flow_schedule(self, rollout, num_tokens: int) -> FlowSchedule:
        """Wan's noise schedule: ``rollout.shift`` (the recipe's: 3.0 at 480p, 5.0 at 720p) on the
        sampler's even grid, whatever the token count (:func:`miles.rollout.schedule.flow_sigmas`)."""
        return FlowSchedule(shift=rollout.shift)

    def text_length_warnings(self, max_sequence_length: int) -> list[str]:
        """Wan's image-to-video transformers split their context at 512 text tokens (the image's
        tokens follow): another text length is warned about."""
        tcfg = self.transformers[0].config
        if (tcfg.get("added_kv_proj_dim") or tcfg.get("image_dim")) and max_sequence_length != 512:
            return [
                f"this is an I2V transformer: Wan splits its context at 512 text tokens, but "
                f"data.max_sequence_length is {max_sequence_length}"
            ]
        return []

    @property
    def architecture(self) -> dict:
        c = self.transformers[0].config
        return {
            "num_layers": c.num_layers,
            "ffn_dim": c.ffn_dim,
            "text_dim": c.text_dim,
            "patch_size": tuple(c.patch_size),
        }

    @property
    def latent_channels(self) -> int:
        # the denoised channels; an I2V transformer's in_channels also count the image condition
        return self.transformers[0].config.out_channels

    def latent_shape(self, num_frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        vae = self.pipeline.vae
        t, s = vae.config.scale_factor_temporal, vae.config.scale_factor_spatial
        return (self.latent_channels, (num_frames - 1) // t + 1, height // s, width // s)

    def num_tokens(self, num_frames: int, height: int, width: int) -> int:
        """Tokens per sample after patchify: the sequence SP shards."""
        _, f, h, w = self.latent_shape(num_frames, height, width)
        pt, ph, pw = self.transformers[0].config.patch_size
        return (f // pt) * (h // ph) * (w // pw)

    def sequence_parallel_plan(self, transformer: nn.Module):
        """The SP plan of one expert: the family's pre-attached plan, else the default from _cp_plan."""
        from miles.sequence_parallel import sequence_parallel_plan

        return sequence_parallel_plan(transformer)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], negative_prompt: str, max_sequence_length: int, device):
        """(prompt_embeds, negative_embeds), each (B, L, text_dim), via the pipeline's own encoder."""
        pipe = self.pipeline
        with text_encoder_on(pipe.text_encoder, device, self.text_encoder_offload):
            pos, neg = pipe.encode_prompt(
                prompt=prompts,
                negative_prompt=[negative_prompt] * len(prompts),
                do_classifier_free_guidance=True,
                max_sequence_length=max_sequence_length,
                device=device,
            )
        return pos, neg

    @torch.no_grad()
    def encode_texts(self, texts: list[str], max_sequence_length: int, device) -> Tensor:
        """(N, L, D) embeddings of ``texts``: the pipeline's encoder output as is (no CFG)."""
        embeds, _ = self.pipeline.encode_prompt(
            prompt=texts,
            do_classifier_free_guidance=False,
            max_sequence_length=max_sequence_length,
            device=device,
        )
        return embeds

    @torch.no_grad()
    def encode_images(self, images: list, num_frames: int, height: int, width: int, device):
        """The image condition (``ImageCondition``) of PIL ``images``, one row each, each encoded
        alone (batch 1, as the I2V pipeline encodes it)."""
        if self.condition_mode is None:
            raise ValueError(f"{self.path} is a text-to-video model: it takes no image")
        size = dict(num_frames=num_frames, height=height, width=width, device=device)
        parts = [
            encode_image_condition(self.image_pipeline, im, self.condition_mode, **size) for im in images
        ]
        return ImageCondition.cat(parts)

    @torch.no_grad()
    def encode_video(self, clip: Tensor, device) -> Tensor:
        """Frames (F, 3, H, W) in [0, 1] -> normalised latents (C, F', H', W') fp32 on ``device``
        (the mode of the VAE's latent distribution, as decode's inverse)."""
        vae = self.pipeline.vae
        x = (clip.permute(1, 0, 2, 3)[None] * 2.0 - 1.0).to(device, vae.dtype)  # (1, 3, F, H, W)
        z = vae.encode(x).latent_dist.mode().float()  # (1, C, F', H', W')
        mean = torch.tensor(vae.config.latents_mean, device=z.device).view(1, -1, 1, 1, 1)
        std = torch.tensor(vae.config.latents_std, device=z.device).view(1, -1, 1, 1, 1)
        return ((z - mean) / std)[0]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents (B, C, F, H, W) -> frames (B, F, 3, H', W') in [0, 1], fp32."""
        vae = self.pipeline.vae
        z = latents.to(vae.dtype)
        mean = torch.tensor(vae.config.latents_mean, device=z.device, dtype=z.dtype).view(1, -1, 1, 1, 1)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std, device=z.device, dtype=z.dtype).view(
            1, -1, 1, 1, 1
        )
        z = z / inv_std + mean
        video = vae.decode(z, return_dict=False)[0]  # (B, 3, F, H, W) in [-1, 1]
        return ((video.float() / 2 + 0.5).clamp(0, 1)).permute(0, 2, 1, 3, 4).contiguous()


def read_model_index(path: Path) -> dict:
    """``model_index.json`` of a diffusers Wan folder; a clear error if ``path`` is not one."""
    info = read_pipeline_index(path)
    if info.get("_class_name") not in WAN_PIPELINES:
        raise ValueError(
            f"model.path {path} holds a {info.get('_class_name')}, not a Wan pipeline ({sorted(WAN_PIPELINES)})"
        )
    return info


def check_wan_folder(path: Path) -> dict:
    """Fail with a clear message unless ``path`` is a complete diffusers Wan folder; returns model_index."""
    info = read_model_index(path)
    for sub in ("transformer", "vae", "text_encoder", "tokenizer"):
        if not (path / sub).is_dir():
            raise ValueError(f"model.path {path} lacks the '{sub}' folder of a diffusers Wan pipeline")
    return info


def transformer_config(path: Path) -> dict:
    """``transformer/config.json`` of the Wan folder at ``path``: read before any weights load."""
    file = path / "transformer" / "config.json"
    if not file.is_file():
        raise ValueError(
            f"model.path {path} lacks transformer/config.json: it is not a complete diffusers Wan folder"
        )
    return read_json(file)


def load_wan(cfg, device: torch.device, experts: str = "load", seed: int = 0) -> WanModel:
    """Load the pipeline of ``cfg`` (the run's ``ModelConfig``) from a local folder (hub never
    contacted), move it to ``device``.

    ``experts``: ``load`` loads the transformer(s) whole in fp32 and moves them to ``device``;
    ``skeleton`` builds them on the meta device from their config.json (the trainer shards them,
    then each rank reads only its own shards: :mod:`miles.models.sharded_load`). The text encoder
    stays on the CPU when ``cfg.text_encoder_offload`` (:meth:`WanModel.encode_prompts` moves it
    to ``device`` for each call). ``cfg.init == "random"``: every component is built from its
    config.json with random weights and no weight file is read (the transformers as skeletons
    unless ``experts`` is ``load``, then with :class:`RandomInit`'s weights for ``seed`` on ``device``)."""
    from diffusers import WanImageToVideoPipeline, WanPipeline

    from miles.models.sharded_load import RandomInit, build_skeleton, materialize

    if experts not in ("load", "skeleton"):
        raise ValueError(f"experts must be 'load' or 'skeleton', got {experts!r}")
    path = resolve_model_path(cfg)
    info = check_wan_folder(path)
    mode = condition_mode(path, info, cfg.task)
    # dtypes at load time: diffusers keeps its fp32-sensitive modules (norms, rope) in fp32.
    # The transformers keep fp32 master weights; FSDP2 casts them to ``cfg.dtype`` for compute.
    dtypes = {
        "transformer": torch.float32,
        "transformer_2": torch.float32,
        "text_encoder": text_encoder_dtype(cfg.text_encoder_dtype, torch.device(device).type),
        "vae": DTYPES[cfg.vae_dtype],
        "default": torch.float32,
    }
    subs = [s for s in EXPERT_FOLDERS if (info.get(s) or [None])[0] is not None]
    given = {}
    if experts == "skeleton" or cfg.init == "random":
        given = {s: build_skeleton(path, s) for s in subs}
    if cfg.init == "random":
        given.update(random_components(path, info, dtypes, seed, torch.device(device)))
    pipeline_class = WanPipeline if mode is None else WanImageToVideoPipeline
    loaded = pipeline_class.from_pretrained(path, local_files_only=True, dtype=dtypes, **given)
    image_pipe = None
    if mode is None:
        pipe = loaded
    else:
        image_pipe = loaded
        if image_pipe.image_encoder is not None:
            image_pipe.image_encoder.to(device).requires_grad_(False).eval()
        pipe = text_pipeline(image_pipe)
    pipe.set_progress_bar_config(disable=True)
    pipe.text_encoder.requires_grad_(False).eval()
    if not cfg.text_encoder_offload:
        pipe.text_encoder.to(device)
    pipe.vae.to(device).requires_grad_(False).eval()
    if cfg.vae_tiling:  # diffusers' tiles: 256 px, stride 192 (blended overlaps)
        pipe.vae.enable_tiling()
    transformers = [pipe.transformer] + ([pipe.transformer_2] if pipe.transformer_2 is not None else [])
    if experts == "load" and cfg.init == "random":
        for t, sub in zip(transformers, subs):  # whole experts with the weights every layout gets
            materialize(t, device, RandomInit(seed=seed, salt=sub))
    elif experts == "load":
        for t in transformers:
            t.to(device)
    return WanModel(
        path=path,
        transformers=transformers,
        boundary_ratio=pipe.config.boundary_ratio if len(transformers) == 2 else None,
        expand_timesteps=bool(getattr(pipe.config, "expand_timesteps", False)),
        pipeline=pipe,
        condition_mode=mode,
        image_pipeline=image_pipe,
        text_encoder_offload=cfg.text_encoder_offload,
    )


def random_components(path: Path, info: dict, dtypes: dict, seed: int, device: torch.device) -> dict:
    """Text encoder, VAE and image encoder of the folder built from their config.json with random
    weights; no weight file is read. The transformers-library encoders are allocated without their
    own (CPU, one tensor at a time) initialisation and filled by :class:`RandomInit` drawing on
    ``device`` (UMT5-XXL: seconds on a GPU instead of minutes on the CPU), then kept on the CPU:
    deterministic given ``seed`` and the device type. The VAE (small) keeps diffusers' own init."""
    import diffusers
    import transformers
    from transformers.initialization import no_init_weights

    from miles.models.sharded_load import RandomInit

    out = {}
    for name in ("text_encoder", "vae", "image_encoder"):
        entry = info.get(name) or [None, None]
        if entry[0] is None:
            continue
        library, class_name = entry
        dtype = dtypes.get(name, torch.float32)
        if library == "transformers":
            config = transformers.AutoConfig.from_pretrained(path / name, local_files_only=True)
            with no_init_weights():
                module = getattr(transformers, class_name)._from_config(config, dtype=dtype)
            fill_random(module, RandomInit(seed=seed, salt=name), device)
        elif library == "diffusers":
            cls = getattr(diffusers, class_name)
            module = cls.from_config(cls.load_config(path / name)).to(dtype)
        else:
            raise ValueError(f"{path}/model_index.json: cannot build {name} of library {library} at random")
        out[name] = module
    return out


@torch.no_grad()
def fill_random(module: nn.Module, source, device: torch.device, chunk_numel: int = 1 << 26) -> None:
    """Fill every parameter of ``module`` (tied ones once) with ``source``'s draw on ``device``,
    about ``chunk_numel`` values at a time (rows of the whole tensor), copied into the parameter
    where it lives."""
    for name, p in module.named_parameters():
        shape = tuple(p.shape)
        if p.dim() < 2:
            p.copy_(source.read(name, (0,), shape, shape, device))
            continue
        rows = max(1, chunk_numel // max(1, p[0].numel()))
        for lo in range(0, shape[0], rows):
            n = min(rows, shape[0] - lo)
            p[lo : lo + n].copy_(
                source.read(name, (lo, *(0,) * (p.dim() - 1)), (n, *shape[1:]), shape, device)
            )


def calibrate_block_memory(
    transformer: nn.Module,
    tokens: int,
    device: torch.device,
    batch: int = 2,
    dtype=torch.bfloat16,
    compiled: bool = False,
    per_token_timesteps: bool = False,
) -> dict[str, float]:
    """Activation bytes one Wan block keeps for backward in each checkpointing mode, measured at
    ``batch`` x ``tokens`` (training's CFG batch of 2 by default) on a bf16 copy of block 0,
    compiled or eager as training will run it. ``per_token_timesteps`` (Wan2.2 TI2V's
    ``expand_timesteps``): the block's modulation input is per token, (batch, tokens, 6, D). The
    modulation input comes in ``dtype``, as the model's condition embedder returns it (in the text
    embeddings' dtype): an eager block keeps its fp32 shift/scale/gate products (32·D bytes a token
    more than with one timestep per sample), a compiled one recomputes them in backward from that
    input (fed an fp32 input instead, a compiled block kept them: the dtype matters)."""
    from miles.parallel.checkpointing import measure_first_block_memory

    cfg = transformer.config
    dim = cfg.num_attention_heads * cfg.attention_head_dim

    def make_inputs():
        hidden = torch.randn(batch, tokens, dim, device=device, dtype=dtype, requires_grad=True)
        context = torch.randn(batch, 512, dim, device=device, dtype=dtype)
        temb_shape = (batch, tokens, 6, dim) if per_token_timesteps else (batch, 6, dim)
        temb = torch.randn(temb_shape, device=device, dtype=dtype)
        rope = torch.randn(1, tokens, 1, cfg.attention_head_dim, device=device, dtype=torch.float32)
        return hidden, context, temb, (rope, rope)

    return measure_first_block_memory(transformer, make_inputs, device, dtype, compiled=compiled)


def run_condition_mode(model_cfg, max_sequence_length: int) -> str | None:
    """The condition mode of a run's model (``ModelConfig``), its folder and settings checked."""

    path = resolve_model_path(model_cfg)
    index = check_wan_folder(path)
    mode = condition_mode(path, index, model_cfg.task)
    check_i2v_run(path, index, mode, max_sequence_length)
    return mode

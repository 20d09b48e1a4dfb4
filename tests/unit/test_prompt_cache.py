"""The rollout's prompt cache: rows identical to batched encoding, each prompt encoded once, the
text encoder parked on the CPU between encodings."""

import pytest
import torch
from torch import nn

from miles.config import ModelConfig
from miles.models.wan import load_wan
from miles.rollout.prompt_cache import PromptCache

NEG = "blurry, static"
LEN = 512


@pytest.fixture(scope="module")
def model():
    return load_wan(ModelConfig(tiny_variant="two_expert"), torch.device("cpu"))


def _count_forwards(module: nn.Module) -> list[int]:
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_rows_equal_batched_encoding_and_each_prompt_is_encoded_once(model):
    # A rollout as the trainer lays it out: groups of 2, micro-batches of 3 that cut across groups.
    texts = ["a red ball moving left", "a blue cube", "a green ball moving up", "a yellow square"]
    prompts = [t for t in texts for _ in range(2)]
    slices = [slice(i, i + 3) for i in range(0, len(prompts), 3)]
    cache = PromptCache(
        model.pipeline, negative_prompt=NEG, max_sequence_length=LEN, device="cpu", offload=True, batch_size=3
    )
    calls = _count_forwards(model.pipeline.text_encoder)
    cache.start_rollout(prompts)
    assert calls[0] == 1 + 2  # the negative, then 4 unique prompts in batches of 3
    assert cache.num_encoded == 1 + len(texts) and cache.num_encoder_visits == 1
    for sl in slices:
        pos, neg = model.encode_prompts(prompts[sl], NEG, LEN, "cpu")  # today's per-micro-batch encoding
        got_pos, got_neg = cache.embeds(prompts[sl]), cache.negative()
        assert got_pos.device.type == got_neg.device.type == "cpu"
        assert got_neg.shape == (1, *neg.shape[1:])
        assert (got_pos - pos).abs().max().item() == 0.0
        assert (got_neg.expand_as(neg) - neg).abs().max().item() == 0.0
    assert calls[0] == 3 + 2 * len(slices)  # since then only the reference ran it (prompts, negative)
    # The next rollout re-encodes its prompts once; the negative prompt is never encoded again.
    before = calls[0]
    cache.start_rollout(prompts[:4])
    assert calls[0] == before + 1 and cache.num_encoded == 1 + len(texts) + 2
    cache.embeds(prompts[:4])
    cache.negative()
    assert calls[0] == before + 1 and cache.num_encoder_visits == 2


class _SpyEncoder(nn.Module):
    """Records where it is moved (a stand-in for UMT5 on a GPU machine)."""

    def __init__(self, where: str):
        super().__init__()
        self.where, self.moves = where, []

    def to(self, device):
        self.where = torch.device(device).type
        self.moves.append(self.where)
        return self


class _StubPipeline:
    def __init__(self, where: str):
        self.text_encoder = _SpyEncoder(where)
        self.encoded_on = []

    def encode_prompt(self, prompt, do_classifier_free_guidance, max_sequence_length, device):
        self.encoded_on.append(self.text_encoder.where)
        rows = torch.stack([torch.full((max_sequence_length, 4), float(len(p))) for p in prompt])
        return rows, None


@pytest.mark.parametrize("loaded_on", ["cpu", "cuda"])
def test_offload_moves_the_encoder_to_the_device_only_to_encode(loaded_on):
    pipe = _StubPipeline(loaded_on)
    cache = PromptCache(pipe, negative_prompt="", max_sequence_length=3, device="cuda", offload=True)
    assert pipe.text_encoder.where == "cpu"  # parked at once, wherever it was loaded
    cache.start_rollout(["ab", "abc", "ab"])
    assert pipe.encoded_on == ["cuda", "cuda"] and pipe.text_encoder.where == "cpu"
    cache.embeds(["abc"])  # cached: no visit
    assert pipe.text_encoder.moves == ["cpu", "cuda", "cpu"]
    assert cache.embeds(["abc", "ab"])[:, 0, 0].tolist() == [3.0, 2.0]


def test_without_offload_the_encoder_stays_on_the_device():
    pipe = _StubPipeline("cpu")
    cache = PromptCache(pipe, negative_prompt="", max_sequence_length=3, device="cuda", offload=False)
    cache.start_rollout(["a"])
    cache.start_rollout(["b"])
    assert pipe.encoded_on == ["cuda", "cuda", "cuda"] and pipe.text_encoder.where == "cuda"


def test_bad_input():
    with pytest.raises(ValueError, match="batch_size"):
        PromptCache(
            _StubPipeline("cpu"),
            negative_prompt="",
            max_sequence_length=3,
            device="cpu",
            offload=True,
            batch_size=0,
        )
    with pytest.raises(ValueError, match="at least one prompt"):
        PromptCache(
            _StubPipeline("cpu"), negative_prompt="", max_sequence_length=3, device="cpu", offload=True
        ).embeds([])


def test_text_encoder_dtype_auto_is_bf16_on_cuda_only(model):
    from miles.models.wan import text_encoder_dtype

    assert ModelConfig().text_encoder_dtype == "auto"
    assert text_encoder_dtype("auto", "cuda") == torch.bfloat16
    assert text_encoder_dtype("auto", "cpu") == torch.float32  # the tiny models' fp32 numerics
    assert text_encoder_dtype("float32", "cuda") == torch.float32
    assert text_encoder_dtype("bfloat16", "cpu") == torch.bfloat16
    assert model.pipeline.text_encoder.dtype == torch.float32  # loaded with the default on the CPU
    with pytest.raises(ValueError, match="text_encoder_dtype"):
        text_encoder_dtype("fp8", "cuda")


class _SpyLinear(nn.Linear):
    """A module with parameters (its home device is read from them) that records where it is moved."""

    def __init__(self):
        super().__init__(2, 2)
        self.moves = []

    def to(self, device):
        self.moves.append(torch.device(device).type)
        return self


def test_a_family_model_takes_its_offloaded_encoder_to_the_device_and_back():
    """``text_encoder_on`` (``WanModel``/``LTXModel.encode_prompts``): with offload the encoder
    visits the device for the block and goes home after it, errors included; without, it stays."""
    from miles.models.dtypes import text_encoder_on

    encoder = _SpyLinear()
    with text_encoder_on(encoder, "cuda", offload=True):
        assert encoder.moves == ["cuda"]
    assert encoder.moves == ["cuda", "cpu"]
    with pytest.raises(RuntimeError, match="encode failed"), text_encoder_on(encoder, "cuda", offload=True):
        raise RuntimeError("encode failed")
    assert encoder.moves == ["cuda", "cpu"] * 2
    with text_encoder_on(encoder, "cuda", offload=False):
        pass
    assert encoder.moves == ["cuda", "cpu"] * 2

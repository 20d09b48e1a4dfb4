"""Each reward's files are checked as its loader reads them, by the same function, every problem at once.

The issue's stub folders (an empty ``config.json``, 0-byte weights, an empty processor config) passed the
dry run, which checked file names only; the real run then refused them 8 s later ("could not load a
CLIPProcessor"), and the PickScore processor folder was not listed beside the model folder. Here:

- for every reward with local files (pickscore, clipscore, aesthetic, hpsv2, videoalign), a copy of a
  working tiny folder with each kind of damage (a 0-byte weights file, a truncated safetensors, a JSON
  config that does not parse, an index naming a missing shard, a cut torch checkpoint, a processor
  that does not load, a reward model without ``rm_head``) is refused by ``check_resources`` naming
  the file, and the reward's constructor (``build_rewards``) refuses it with the same problems,
  before any model loads; the working folder passes;
- several broken folders of several rewards are listed together, one problem a line, by the run
  plan (``collect_errors``), the dry run and the real run's startup alike (``train_grpo.main``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from miles.rewards.registry import build_rewards, check_resources
from miles.rewards.resources import ResourceError
from miles.rewards.tiny_clip import tiny_clip
from tests.dist_utils import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return Path(tiny_clip(tmp_path_factory.mktemp("tiny_clip")))


@pytest.fixture(scope="module")
def videoalign_dir(tmp_path_factory):
    from miles.rewards.tiny_videoalign import tiny_videoalign

    return Path(tiny_videoalign(tmp_path_factory.mktemp("tiny_videoalign")))


@pytest.fixture(scope="module")
def head_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("head") / "sac+logos+ava1-l14-linearMSE.pth"
    dims = [32, 16, 8, 8, 4, 1]
    state = {}
    for i, (a, b) in zip((0, 2, 4, 6, 7), zip(dims[:-1], dims[1:])):
        state[f"layers.{i}.weight"], state[f"layers.{i}.bias"] = torch.randn(b, a), torch.randn(b)
    torch.save(state, path)
    return path


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _damage(folder: Path, name: str, how: str) -> None:
    path = folder / name
    data = path.read_bytes()
    if how == "empty":
        path.write_bytes(b"")
    elif how == "half":
        path.write_bytes(data[: len(data) // 2])
    elif how == "not_json":
        path.write_text('{"hidden_size": 32,')
    else:
        raise AssertionError(how)


# reward -> (options builder from (clip, videoalign, head, tmp), the damaged file's option and name, how,
# the message naming it)
CASES = {
    "pickscore_weights_0_bytes": ("pickscore", "model_path", "model.safetensors", "empty", "model.safetensors is empty (0 bytes)"),
    "pickscore_weights_truncated": ("pickscore", "model_path", "model.safetensors", "half", "model.safetensors is truncated"),
    "pickscore_config_broken": ("pickscore", "model_path", "config.json", "not_json", "config.json is not valid JSON"),
    "pickscore_processor_config_empty": ("pickscore", "processor_path", "processor_config.json", "empty", "processor_config.json is empty (0 bytes)"),
    "pickscore_tokenizer_broken": ("pickscore", "processor_path", "tokenizer.json", "not_json", "tokenizer.json is not valid JSON"),
    "clipscore_weights_truncated": ("clipscore", "model_path", "model.safetensors", "half", "model.safetensors is truncated"),
    "aesthetic_head_cut": ("aesthetic", "head_path", "sac+logos+ava1-l14-linearMSE.pth", "half", "is a damaged torch checkpoint"),
    "aesthetic_clip_config_empty": ("aesthetic", "clip_path", "config.json", "empty", "config.json is empty (0 bytes)"),
    "hpsv2_processor_tokenizer_empty": ("hpsv2", "processor_path", "tokenizer.json", "empty", "tokenizer.json is empty (0 bytes)"),
    "videoalign_weights_0_bytes": ("videoalign", "model_path", "model.safetensors", "empty", "model.safetensors is empty (0 bytes)"),
    "videoalign_preprocessor_broken": ("videoalign", "model_path", "preprocessor_config.json", "not_json", "preprocessor_config.json is not valid JSON"),
}  # fmt: skip


def _options(reward: str, clip: Path, videoalign: Path, head: Path, tmp: Path) -> dict[str, Path]:
    """A working folder (copied) for every path option of ``reward``."""
    if reward == "pickscore":
        return {"model_path": _copy(clip, tmp / "model"), "processor_path": _copy(clip, tmp / "processor")}
    if reward == "clipscore":
        return {"model_path": _copy(clip, tmp / "model")}
    if reward == "aesthetic":
        (tmp / "head").mkdir()
        shutil.copy(head, tmp / "head" / head.name)
        return {"clip_path": _copy(clip, tmp / "clip"), "head_path": tmp / "head"}
    if reward == "hpsv2":
        return {"processor_path": _copy(clip, tmp / "arch")}  # the checkpoint is checked on its own below
    if reward == "videoalign":
        return {"model_path": _copy(videoalign, tmp / "videoalign")}
    raise AssertionError(reward)


@pytest.mark.parametrize("case", list(CASES))
def test_a_damaged_file_is_refused_by_the_check_and_the_loader_alike(
    case, clip_dir, videoalign_dir, head_file, tmp_path, monkeypatch
):
    import transformers

    reward, option, name, how, message = CASES[case]
    options = _options(reward, clip_dir, videoalign_dir, head_file, tmp_path)
    if reward == "hpsv2":
        options["model_path"] = head_file  # only its processor folder is damaged here
    _damage(Path(options[option]), name, how)

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before its files were checked")

    monkeypatch.setattr(transformers.CLIPModel, "from_pretrained", no_loading)
    monkeypatch.setattr(
        transformers.Qwen2VLForConditionalGeneration, "from_pretrained", no_loading, raising=False
    )
    with pytest.raises(ResourceError) as checked:
        check_resources([reward], {reward: options})
    with pytest.raises(ResourceError) as built:
        build_rewards({reward: 1.0}, {reward: options})
    assert checked.value.problems == built.value.problems
    problem = next(p for p in checked.value.problems if message in p)
    assert f"reward.{reward}.{option}=" in problem, checked.value.problems


def test_working_folders_pass_and_a_missing_shard_or_rm_head_is_named(clip_dir, videoalign_dir, tmp_path):
    check_resources(
        ["pickscore", "clipscore"],
        {"pickscore": {"model_path": clip_dir}, "clipscore": {"model_path": clip_dir}},
    )
    check_resources(["videoalign"], {"videoalign": {"model_path": videoalign_dir}})
    # A sharded checkpoint whose index names a shard that is not there.
    sharded = _copy(clip_dir, tmp_path / "sharded")
    (sharded / "model.safetensors").unlink()
    index = {"weight_map": {"logit_scale": "model-00001-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        ResourceError,
        match="model.safetensors.index.json names model-00001-of-00002.safetensors, which is missing",
    ):
        check_resources(["clipscore"], {"clipscore": {"model_path": sharded}})
    # A Qwen2-VL folder without the reward head: named from the safetensors header, no weights read.
    from safetensors.torch import load_file, save_file

    headless = _copy(videoalign_dir, tmp_path / "headless")
    state = load_file(headless / "model.safetensors")
    del state["rm_head.weight"]
    save_file(state, headless / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ResourceError, match="holds no rm_head.weight"):
        check_resources(["videoalign"], {"videoalign": {"model_path": headless}})


def _stubs(root: Path, name: str) -> Path:
    """The issue's stub folder: every file a loader looks for, present, empty or '{}'."""
    folder = root / name
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    for file in ("model.safetensors", "preprocessor_config.json", "tokenizer.json"):
        (folder / file).write_bytes(b"")
    return folder


def test_stub_folders_are_listed_together_by_the_plan_the_dry_run_and_the_real_run(
    tmp_path, capsys, monkeypatch
):
    import torch.distributed as dist

    import train_grpo

    model, processor, clip = (
        _stubs(tmp_path, "pickscore"),
        _stubs(tmp_path, "laion"),
        _stubs(tmp_path, "clip"),
    )
    argv = ["--config", "configs/tiny_cpu.yaml", "--model.tiny-model-dir", str(REPO / ".cache" / "tiny-wan")]
    argv += ["--run.output-dir", str(tmp_path / "runs"), "--run.name", "bad", "--run.wandb-mode", "disabled"]
    argv += ["--run.no-progress", "--reward.weights.pickscore", "1", "--reward.gold", "clipscore"]
    argv += ["--reward.pickscore.model-path", str(model), "--reward.pickscore.processor-path", str(processor)]
    argv += ["--reward.clipscore.model-path", str(clip), "--eval.prompt-file", "miles/data/tiny_prompts.txt"]
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.chdir(REPO)
    assert train_grpo.main([*argv, "--dry-run", "--world-size", "1"]) == 2
    dry = capsys.readouterr().err
    assert train_grpo.main(argv) == 2
    real = capsys.readouterr().err
    assert not dist.is_initialized()
    assert dry == real, (dry, real)
    listed = [line for line in dry.splitlines() if line.startswith("  - ")]
    expected = [
        f"reward.pickscore.model_path='{model}': model.safetensors is empty (0 bytes)",
        f"reward.pickscore.processor_path='{processor}': preprocessor_config.json is empty (0 bytes)",
        f"reward.pickscore.processor_path='{processor}': tokenizer.json is empty (0 bytes)",
        f"reward.clipscore.model_path='{clip}': model.safetensors is empty (0 bytes)",
        f"reward.clipscore.model_path='{clip}': preprocessor_config.json is empty (0 bytes)",
        f"reward.clipscore.model_path='{clip}': tokenizer.json is empty (0 bytes)",
    ]
    assert dry.startswith(f"error: {len(expected)} inputs the run would refuse"), dry
    assert len(listed) == len(expected), dry
    for line, text in zip(listed, expected):
        assert text in line, (text, line)
    assert not (tmp_path / "runs").exists()

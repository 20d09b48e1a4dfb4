"""Inputs that cost far more than they look refused early, naming the file and the bound.

- a safetensors file whose header claims 40 GB (a sparse file: no disk used) in the model folder: its
  fingerprint (the plan, so the dry run and the real run) refuses it at once, where reading the
  claimed header raised ``MemoryError`` after 58 s; a header safetensors itself would refuse
  (offsets outside the file) too;
- a 2,000,000-line prompt file: the dry run refuses it before any tokenizer sees it (it aborted
  inside the tokenizer after 269 s).
"""

from __future__ import annotations

import json
import shutil
import struct
import time
from pathlib import Path

import pytest

from miles.models.fingerprint import MAX_HEADER_BYTES, model_fingerprint, safetensors_header

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / ".cache" / "tiny-wan" / "single_expert"


def test_a_header_claiming_tens_of_gb_is_refused_at_once(tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(TINY, folder, copy_function=lambda src, dst: Path(dst).symlink_to(src))
    weights = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.unlink()
    with open(weights, "wb") as f:
        f.write(struct.pack("<Q", 40 << 30))
        f.truncate((40 << 30) + 64)  # sparse: the file is as long as its header claims
    start = time.perf_counter()
    with pytest.raises(
        ValueError, match=rf"{weights} is not a safetensors file: its header claims 42949672960 bytes"
    ):
        model_fingerprint(folder)
    assert time.perf_counter() - start < 5
    assert MAX_HEADER_BYTES == 100_000_000  # safetensors' own MAX_HEADER_SIZE


def test_safetensors_own_reader_has_the_last_word(tmp_path):
    # A header whose JSON parses and whose last offset fits the file, but whose first tensor's offsets
    # do not start at 0 (a gap): only safetensors' own validation catches it.
    header = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}).encode()
    path = tmp_path / "gap.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    with pytest.raises(ValueError, match=r"gap.safetensors is not a valid safetensors file \(.*\)"):
        safetensors_header(path)


def test_a_prompt_file_of_two_million_lines_is_refused_by_the_dry_run(tmp_path, capsys, monkeypatch):
    import train_grpo

    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"a red disc moves left\n" * 2_000_000)
    monkeypatch.chdir(REPO)
    argv = ["--config", "configs/tiny_cpu.yaml", "--model.tiny-model-dir", str(REPO / ".cache" / "tiny-wan")]
    argv += ["--run.output-dir", str(tmp_path / "runs"), "--data.prompt-file", str(prompts)]
    start = time.perf_counter()
    assert train_grpo.main([*argv, "--dry-run", "--world-size", "1"]) == 2
    assert time.perf_counter() - start < 60
    err = capsys.readouterr().err
    assert err == (
        f"error: {prompts}: 2000000 lines; a prompt file may hold at most 1000000 prompts (each is read and "
        "tokenized before the first rollout): take a subset of it\n"
    )


def test_the_truncation_count_tokenizes_in_bounded_batches():
    from transformers import AutoTokenizer

    from miles.data.prompts import count_truncated

    tokenizer = AutoTokenizer.from_pretrained(TINY / "tokenizer")
    texts = [f"a disc {i}" if i % 1000 else "a very long prompt " * 40 for i in range(5000)]
    calls = []

    def counting(batch, **kwargs):
        calls.append(len(batch))
        return tokenizer(batch, **kwargs)

    assert count_truncated(texts, counting, 64) == 5  # prompts 0, 1000, ..., 4000
    assert calls == [4096, 904]

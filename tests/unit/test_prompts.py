"""Prompt loading and the per-rank group sampler."""

from pathlib import Path

import pytest

from miles.data.prompts import (
    TINY_PROMPTS,
    GroupSampler,
    Prompt,
    count_truncated,
    load_prompts,
    truncation_warning,
)

ROOT = Path(__file__).resolve().parents[2]
SHARED_DATA = Path("/work/shared/data")


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------- loader


def test_txt_skips_blank_lines(tmp_path):
    prompts = load_prompts(write(tmp_path, "p.txt", "a cat\n\n  \n a dog  \n"))
    assert [p.text for p in prompts] == ["a cat", "a dog"]
    assert prompts[0].metadata == {}


def test_jsonl_keeps_metadata(tmp_path):
    path = write(
        tmp_path,
        "p.jsonl",
        '{"prompt": "two cups", "tag": "counting", "include": [{"n": 2}]}\n\n{"prompt": "x"}\n',
    )
    prompts = load_prompts(path)
    assert prompts[0].text == "two cups"
    assert prompts[0].metadata == {"tag": "counting", "include": [{"n": 2}]}
    assert prompts[1].metadata == {}


@pytest.mark.parametrize(
    "content,match",
    [
        ('{"prompt": "ok"}\n[1, 2]\n', r"p\.jsonl:2: expected a JSON object"),
        ('{"prompt": "ok"}\n\n{"text": "no prompt"}\n', r"p\.jsonl:3: needs a non-empty string 'prompt'"),
        ('{"prompt": ""}\n', r"p\.jsonl:1: needs"),
        ('{"prompt": "ok"\n', r"p\.jsonl:1: not valid JSON"),
        ("\n\n", r"p\.jsonl: no prompts"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path, content, match):
    with pytest.raises(ValueError, match=match):
        load_prompts(write(tmp_path, "p.jsonl", content))


def test_other_errors(tmp_path):
    with pytest.raises(ValueError, match=r"e\.txt: no prompts"):
        load_prompts(write(tmp_path, "e.txt", ""))
    with pytest.raises(FileNotFoundError, match="missing.txt"):
        load_prompts(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match=r"\.txt or \.jsonl"):
        load_prompts(write(tmp_path, "p.csv", "a,b\n"))


@pytest.mark.parametrize("name", ["p.txt", "p.jsonl"])
def test_a_byte_order_mark_is_not_part_of_the_first_prompt(tmp_path, name):
    text = "a cat\na dog\n" if name == "p.txt" else '{"prompt": "a cat"}\n{"prompt": "a dog"}\n'
    path = tmp_path / name
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert [p.text for p in load_prompts(path)] == ["a cat", "a dog"]


@pytest.mark.parametrize("name", ["p.txt", "p.jsonl"])
def test_non_utf8_names_file_and_line(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(b'{"prompt": "a cat"}\n\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=rf"{name}:3: not UTF-8 text \(byte 0xe9 at column 16\)"):
        load_prompts(path)


def test_count_truncated_matches_the_pipeline_tokenizer():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ROOT / "miles/world/pipeline/tokenizer", local_files_only=True)
    texts = ["a red ball", "a big red ball moving left", "  a big\n red ball  "]
    lengths = [
        len(tokenizer(t)["input_ids"]) for t in ("a red ball", "a big red ball moving left", "a big red ball")
    ]
    limit = lengths[2]  # the third prompt, whitespace-cleaned as WanPipeline does, fits exactly
    assert count_truncated(texts, tokenizer, limit) == 1
    assert count_truncated(texts, tokenizer, lengths[1]) == 0
    warning = truncation_warning([Prompt(t) for t in texts], tokenizer, limit, "p.txt")
    assert warning.startswith(
        f"1 of 3 prompts in p.txt are longer than data.max_sequence_length = {limit} text tokens"
    )
    assert truncation_warning(texts, tokenizer, lengths[1], "p.txt") is None


def test_tiny_prompts_ship_with_the_package():
    prompts = load_prompts(TINY_PROMPTS)
    assert 12 <= len(prompts) <= 32 and len({p.text for p in prompts}) == len(prompts)


@pytest.mark.skipif(not SHARED_DATA.is_dir(), reason="shared prompt sets not present")
def test_real_prompt_sets_load():
    geneval = load_prompts(SHARED_DATA / "geneval" / "test_metadata.jsonl")
    assert len(geneval) == 2212  # 2,211 newlines; the last line has none
    assert geneval[0].text == "a photo of two wine glasses"
    assert geneval[0].metadata["tag"] == "counting" and "prompt" not in geneval[0].metadata
    ocr = load_prompts(SHARED_DATA / "ocr_prompts" / "test.txt")
    assert len(ocr) == 1018 and all('"' in p.text for p in ocr[:20])


# ---------------------------------------------------------------- group sampler


def take(sampler, n):
    return [next(sampler) for _ in range(n)]


def test_ranks_get_disjoint_whole_groups():
    dp_size, per_rank, group = 3, 2, 4
    samplers = [GroupSampler(20, per_rank, group, r, dp_size, seed=1) for r in range(dp_size)]
    for _ in range(3):  # 20 // 6 = 3 steps per epoch
        batches = [next(s) for s in samplers]
        seen = []
        for rank, b in enumerate(batches):
            assert len(b.prompt_indices) == per_rank * group
            for j in range(per_rank):
                chunk = b.prompt_indices[j * group : (j + 1) * group]
                assert len(set(chunk)) == 1  # one prompt repeated G times, back to back
                assert b.group_ids[j * group : (j + 1) * group] == [j * dp_size + rank] * group
                seen.append(chunk[0])
        assert len(seen) == len(set(seen)) == dp_size * per_rank  # disjoint across ranks
    # An epoch never repeats a prompt; the 2-prompt tail is dropped, then a new epoch starts.
    assert next(samplers[0]).epoch == 1


def test_epoch_is_a_permutation_and_sp_peers_agree():
    a, b = GroupSampler(12, 2, 2, 1, 2, seed=5), GroupSampler(12, 2, 2, 1, 2, seed=5)
    steps_a, steps_b = take(a, 6), take(b, 6)
    assert steps_a == steps_b  # sp peers pass the same dp_rank
    other = GroupSampler(12, 2, 2, 0, 2, seed=5)
    epoch0 = [p for s in take(other, 3) for p in s.prompt_indices[::2]]
    epoch0 += [p for s in steps_a[:3] for p in s.prompt_indices[::2]]
    assert sorted(epoch0) == list(range(12))
    assert [s.epoch for s in steps_a] == [0, 0, 0, 1, 1, 1]
    # Epochs are reshuffled and seeds matter.
    assert steps_a[:3] != steps_a[3:]
    assert take(GroupSampler(12, 2, 2, 1, 2, seed=6), 3) != steps_a[:3]


def test_state_round_trip():
    s = GroupSampler(10, 1, 3, 0, 2, seed=0)
    take(s, 7)
    state = s.state_dict()
    expected = take(s, 5)
    resumed = GroupSampler(10, 1, 3, 0, 2, seed=0)
    resumed.load_state_dict(state)
    assert take(resumed, 5) == expected
    with pytest.raises(ValueError, match="seed"):
        GroupSampler(10, 1, 3, 0, 2, seed=1).load_state_dict(state)


def test_invalid_arguments():
    with pytest.raises(ValueError, match="group_size"):
        GroupSampler(10, 1, 1, 0, 1)
    with pytest.raises(ValueError, match="fewer than one rollout"):
        GroupSampler(5, 3, 2, 0, 2)
    with pytest.raises(ValueError, match="dp_rank"):
        GroupSampler(10, 1, 2, 2, 2)

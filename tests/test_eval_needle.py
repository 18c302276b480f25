"""The needle grid: exact prompt lengths, the needle where it was asked, seeds, scoring, packed scoring, adapters."""

from __future__ import annotations

import json
import re

import peft
import pytest
import torch
from conftest import (
    FLOAT32_BOUND,
    TOKENIZER,
    assert_packed_scoring_is_exact,
    assert_relatively_close,
    frame_ids,
    save_tiny_model,
    tiny_model,
)
from transformers import AutoModelForCausalLM, AutoTokenizer, GlmConfig, GlmForCausalLM

from longalign.checkpoints import convert
from longalign.cli import main
from longalign.errors import ConfigError
from longalign.eval import needle as nd
from longalign.eval.models import LocalGenerator, Reply, chat_frame, load_model
from longalign.lora import merge_adapter


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER)


@pytest.fixture(scope="module")
def pool(tokenizer):
    return nd.haystack_pool(tokenizer, None, seed=0)


FIXED = nd.Needle(
    text="The password of the blue door is swordfish.",
    question="What is the password of the blue door?",
    answer="swordfish",
    answer_prefix="The password is",
)


def grid(tokenizer, pool, **settings):
    defaults = dict(lengths=[150, 333, 1000], depths=[0, 10, 25, 50, 75, 90, 100], samples=2, seed=0)
    return nd.build_cases(tokenizer, pool, **{**defaults, **settings})


def test_every_prompt_is_exactly_its_length_template_and_answer_prefix_included(tokenizer, pool):
    frame = chat_frame(tokenizer)
    plain = grid(tokenizer, pool)
    prefixed = grid(tokenizer, pool, with_answer_prefix=True)
    for cases in (plain, prefixed):
        assert [len(c.prompt.input_ids) for c in cases] == [c.length for c in cases]
    for case in plain:  # the rendered chat encoded in one pass
        text = frame.before + case.prompt.messages[0]["content"] + frame.after
        assert case.prompt.input_ids == tokenizer(text, add_special_tokens=False).input_ids
    for case in prefixed:
        assert re.search(r"special magic number for \S+ is$", tokenizer.decode(case.prompt.input_ids))


def test_the_needle_starts_within_one_sentence_of_its_depth(tokenizer, pool):
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    before, after = frame_ids(tokenizer)
    needle_ids = encode(" " + FIXED.text)
    question = encode(nd.QUESTION_FORM.format(question=FIXED.question))
    start = len(before) + len(encode(nd.INTRO))
    longest_sentence = max(map(len, pool))
    for case in grid(tokenizer, pool, needle=FIXED):
        haystack_len = case.length - start - len(needle_ids) - len(question) - len(after)
        target = start + case.depth / 100 * haystack_len
        assert abs(case.needle_start - target) <= longest_sentence, (case.length, case.depth)
        assert case.prompt.input_ids[case.needle_start : case.needle_start + len(needle_ids)] == needle_ids


def test_the_needle_sits_on_a_sentence_boundary_of_a_haystack_file(tokenizer, tmp_path):
    (tmp_path / "a.txt").write_text("One short line here. Another follows it! Does a third? " * 40)
    (tmp_path / "b.txt").write_text("Second file, first sentence. Second file, last sentence.")
    pool = nd.haystack_pool(tokenizer, tmp_path, seed=0)
    cases = grid(tokenizer, pool, lengths=[300, 900], needle=FIXED)
    assert [len(c.prompt.input_ids) for c in cases] == [c.length for c in cases]
    for case in cases:
        before = tokenizer.decode(case.prompt.input_ids[: case.needle_start])
        if case.depth not in (0, 100):
            assert before.rstrip().endswith((".", "!", "?")), before[-40:]


def test_the_same_seed_gives_the_same_prompts_and_another_seed_others(tokenizer, pool):
    first = grid(tokenizer, pool, seed=3)
    again = grid(tokenizer, nd.haystack_pool(tokenizer, None, seed=0), seed=3)
    other = grid(tokenizer, pool, seed=4)
    assert first == again
    assert [c.prompt.input_ids for c in first] != [c.prompt.input_ids for c in other]
    assert len({c.answer for c in first}) == len(first)  # a fresh 7-digit value per prompt


def test_a_length_that_cannot_hold_the_needle_is_one_line_before_anything_runs(tokenizer, pool):
    with pytest.raises(ConfigError, match=r"--lengths 40: too short .* tokens without any haystack"):
        grid(tokenizer, pool, lengths=[40])


NEEDLE_VALUE = re.compile(r"special magic number for \S+ is (\d+)")


class Oracle:
    """A model that reads the needle back out of the prompt it is given."""

    def generate(self, prompts, *, progress=None):
        return [Reply(f"It is {NEEDLE_VALUE.search(p.messages[0]['content'])[1]}.") for p in prompts]


class Silent:
    def generate(self, prompts, *, progress=None):
        return [Reply("") for _ in prompts]


@pytest.mark.parametrize(("generator", "expected"), [(Oracle(), 100.0), (Silent(), 0.0)])
def test_a_model_that_finds_the_needle_scores_100_and_one_that_says_nothing_0(
    tokenizer, pool, generator, expected
):
    cases = grid(tokenizer, pool)
    replies = generator.generate([c.prompt for c in cases])
    summary = nd.summary([nd.generation_row(c, r) for c, r in zip(cases, replies, strict=True)])
    assert summary["overall"] == expected
    assert set(summary["by_depth"].values()) == {expected}
    assert set(summary["by_length"].values()) == {expected}
    assert summary["n"] == len(cases) and summary["failed"] == 0


def test_a_failed_request_is_counted_not_scored(tokenizer, pool):
    cases = grid(tokenizer, pool, lengths=[150], depths=[50], samples=2)
    rows = [nd.generation_row(cases[0], Reply("", error="400 from the server: too long")),
            nd.generation_row(cases[1], Reply(cases[1].answer))]  # fmt: skip
    summary = nd.summary(rows)
    assert (summary["overall"], summary["n"], summary["failed"]) == (100.0, 2, 1)


def test_packed_scoring_equals_one_prompt_at_a_time_and_the_plain_model(tokenizer, pool):
    cases = grid(
        tokenizer, pool, lengths=[120, 200, 310], depths=[0, 50, 100], samples=1, with_answer_prefix=True
    )
    sequences = [(c.prompt.input_ids, c.answer_ids) for c in cases]
    assert len(nd.pack_rows([len(p) + len(a) - 1 for p, a in sequences], 1000)) == 2  # 9 prompts in 2 rows
    assert_packed_scoring_is_exact(sequences, pack_tokens=1000)


def test_scoring_is_100_when_greedy_decoding_gives_the_answer(tokenizer, pool):
    case = grid(tokenizer, pool, lengths=[150], depths=[50], samples=1, with_answer_prefix=True)[0]
    hit = nd.logprob_row(case, nd.AnswerScore(-0.1, True, case.answer_ids), tokenizer)
    miss = nd.logprob_row(
        case, nd.AnswerScore(-5.0, False, case.answer_ids[:1] * len(case.answer_ids)), tokenizer
    )
    assert (hit["score"], hit["output"].strip(), miss["score"]) == (100.0, case.answer, 0.0)


def test_a_lora_adapter_directory_scores_and_generates_as_its_merged_model(tokenizer, pool, tmp_path):
    base = tiny_model("llama", vocab_size=4096, max_position_embeddings=1024)
    base.save_pretrained(tmp_path / "base")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    adapted = peft.get_peft_model(base, config)
    adapted.peft_config["default"].base_model_name_or_path = str(tmp_path / "base")
    adapted.save_pretrained(tmp_path / "adapter")
    merge_adapter(tmp_path / "adapter", tmp_path / "merged")

    cases = grid(tokenizer, pool, lengths=[150, 260], depths=[0, 100], samples=1, with_answer_prefix=True)
    sequences = [(c.prompt.input_ids, c.answer_ids) for c in cases]
    scores = {}
    for name in ("adapter", "merged", "base"):
        model = load_model(str(tmp_path / name), dtype="float64", packed=True, attn_backend="sdpa_segments")
        scores[name] = [s.logprob for s in nd.score_answers(model, sequences, pack_tokens=1000)]
    # The merged copy on disk holds float32 weights (merged by float32 kernels, which round differently on
    # different CPUs); the adapter merges here in float64: a float32 bound.
    assert_relatively_close(scores["adapter"], scores["merged"], FLOAT32_BOUND)
    assert scores["adapter"] != pytest.approx(scores["base"], rel=1e-4)  # the adapter changes the model

    replies = {
        name: LocalGenerator(
            load_model(str(tmp_path / name), dtype="float64"), tokenizer, max_new_tokens=6, batch_size=2
        ).generate([c.prompt for c in cases])  # fmt: skip
        for name in ("adapter", "merged")
    }
    assert replies["adapter"] == replies["merged"]
    assert all(r.text for r in replies["adapter"])


def test_batched_generation_equals_one_prompt_at_a_time(tokenizer, pool):
    cases = grid(tokenizer, pool, lengths=[120, 200], depths=[0, 100], samples=1)
    model = tiny_model("llama", vocab_size=4096, max_position_embeddings=1024).double().eval()
    model.config.use_cache = True
    one = LocalGenerator(model, tokenizer, max_new_tokens=5, batch_size=1).generate([c.prompt for c in cases])
    four = LocalGenerator(model, tokenizer, max_new_tokens=5, batch_size=4).generate(
        [c.prompt for c in cases]
    )
    assert one == four


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A tiny random Llama with the sample tokenizer, saved as a run saves its output (positions up to 512)."""
    return save_tiny_model(tmp_path_factory.mktemp("model"), max_position_embeddings=512)


def test_logprob_grid_from_the_command_line(saved_model, tmp_path, capsys):
    out = tmp_path / "lp"
    args = ["eval", "needle", "--model", str(saved_model), "--score", "logprob", "--lengths", "150,300",
            "--depths", "0,100", "--samples-per-cell", "2", "--pack-tokens", "700", "--output", str(out)]  # fmt: skip
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert [r["prompt_tokens"] for r in rows] == [150] * 4 + [300] * 4
    assert all(r["logprob"] < 0 and r["score"] in (0.0, 100.0) for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mean_logprob"] == pytest.approx(sum(r["logprob"] for r in rows) / 8, rel=1e-12)
    assert summary["score"] == "logprob" and summary["n"] == 8
    assert (out / "summary.csv").read_text().splitlines()[0] == "length,depth,score,n,logprob"
    assert (out / "heatmap.png").stat().st_size > 0
    assert "needle: 8 prompts" in capsys.readouterr().out
    assert main(args) == 0  # an earlier eval output is replaced
    assert [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()] == rows


def test_a_length_over_the_models_limit_is_one_line(saved_model, tmp_path, capsys):
    args = ["eval", "needle", "--model", str(saved_model), "--lengths", "500", "--depths", "50",
            "--max-new-tokens", "32", "--output", str(tmp_path / "o")]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "a prompt of 500 tokens + 32 new tokens is over the model's limit of 512" in err
    assert not (tmp_path / "o").exists()


def test_a_chatglm_layout_checkpoint_scores_as_its_native_copy(tokenizer, pool, tmp_path):
    torch.manual_seed(0)
    config = GlmConfig(
        vocab_size=4096, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, pad_token_id=0, eos_token_id=[1, 2], max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0, "partial_rotary_factor": 0.5},
    )  # fmt: skip
    GlmForCausalLM(config).save_pretrained(tmp_path / "native")
    assert convert(str(tmp_path / "native"), tmp_path / "chatglm") == "chatglm"
    cases = grid(tokenizer, pool, lengths=[150, 260], depths=[0, 100], samples=1, with_answer_prefix=True)
    sequences = [(c.prompt.input_ids, c.answer_ids) for c in cases]
    scores = {
        name: nd.score_answers(
            load_model(str(tmp_path / name), dtype="float64", packed=True, attn_backend="sdpa_segments"),
            sequences,
            pack_tokens=1000,
        )
        for name in ("native", "chatglm")
    }
    assert scores["chatglm"] == scores["native"]  # the same weights, renamed: the same numbers

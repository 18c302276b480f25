"""Patched tiny models: a packed forward+backward equals running every sample alone."""

from __future__ import annotations

import copy
import re
import types

import pytest
import torch
import torch.nn.functional as F
from conftest import FLOAT64_BOUND, TINY, assert_relatively_close, tiny_model
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import longalign.patch
import longalign.patch.interface
from longalign.errors import InputError
from longalign.patch import ATTENTION_NAMES, UnsupportedModelError, apply, check_model

VOCAB = TINY["vocab_size"]
LENGTHS = [7, 1, 12, 5]  # a single-token sample, and samples longer than Mistral's window
# Mistral takes the generic path, here with a sliding window shorter than some samples.
MODELS = {"llama": {}, "glm": {}, "glm4": {}, "mistral": {"sliding_window": 4}}


def model_of(kind: str, seed: int = 0) -> torch.nn.Module:
    """A tiny model of ``kind`` in float64, so that packed == alone holds to rounding on any CPU."""
    return tiny_model(kind, seed=seed, **MODELS[kind]).double()


def packed_batch(lengths: list[int], *, boundaries: str = "cu_seq_lens") -> dict:
    """The collator's batch for one pack; ``boundaries="position_ids"`` leaves out the cu_seq_lens keys."""
    input_ids = torch.randint(3, VOCAB, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": input_ids, "position_ids": torch.cat([torch.arange(n) for n in lengths])[None]}
    if boundaries == "cu_seq_lens":
        cu_seq_lens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        batch |= {
            "cu_seq_lens_q": cu_seq_lens,
            "cu_seq_lens_k": cu_seq_lens,
            "max_length_q": max(lengths),
            "max_length_k": max(lengths),
        }
    return batch


def sample_slices(lengths: list[int]) -> list[slice]:
    ends = torch.tensor(lengths).cumsum(0).tolist()
    return [slice(end - n, end) for n, end in zip(lengths, ends, strict=True)]


def summed_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Next-token loss of one sample, summed (a single token has no target)."""
    return F.cross_entropy(logits[0, :-1], input_ids[0, 1:], reduction="sum")


def run_alone(model, batch, lengths):
    """Logits of every sample run on its own through transformers' sdpa attention, and the summed loss."""
    logits = [model(input_ids=batch["input_ids"][:, part]).logits for part in sample_slices(lengths)]
    loss = sum(
        summed_loss(out, batch["input_ids"][:, part])
        for out, part in zip(logits, sample_slices(lengths), strict=True)
    )
    return torch.cat(logits, dim=1), loss


def run_packed(model, batch, lengths):
    logits = model(**batch).logits
    loss = sum(summed_loss(logits[:, part], batch["input_ids"][:, part]) for part in sample_slices(lengths))
    return logits, loss


def grads(model) -> dict[str, torch.Tensor]:
    return {name: param.grad for name, param in model.named_parameters()}


@pytest.mark.parametrize(
    "checkpointing", [None, False, True], ids=["plain", "checkpointing", "reentrant_checkpointing"]
)
@pytest.mark.parametrize("boundaries", ["cu_seq_lens", "position_ids"])
@pytest.mark.parametrize("kind", list(MODELS))
def test_packed_equals_each_sample_alone(monkeypatch, kind, boundaries, checkpointing):
    model = model_of(kind).train()
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")  # eager takes its softmax in float32
    reference.config.use_cache = False
    apply(model)
    if checkpointing is not None:
        model.activation_checkpointing_enable({"use_reentrant": checkpointing})
    seen = []
    real_varlen_attention = longalign.patch.interface.varlen_attention

    def spy(q, k, v, cu_seqlens, max_seqlen, **options):
        seen.append((cu_seqlens.tolist(), max_seqlen, options["window"]))
        return real_varlen_attention(q, k, v, cu_seqlens, max_seqlen, **options)

    monkeypatch.setattr(longalign.patch.interface, "varlen_attention", spy)
    batch = packed_batch(LENGTHS, boundaries=boundaries)

    logits, loss = run_packed(model, batch, LENGTHS)
    loss.backward()
    expected_logits, expected_loss = run_alone(reference, batch, LENGTHS)
    expected_loss.backward()

    assert_relatively_close(logits, expected_logits, FLOAT64_BOUND)
    assert_relatively_close(loss, expected_loss, FLOAT64_BOUND)
    assert_relatively_close(grads(model), grads(reference), FLOAT64_BOUND)
    layers = model.config.num_hidden_layers
    window = model.config.sliding_window if kind == "mistral" else None
    # Each layer saw the pack's boundaries, again when checkpointing recomputed it during backward.
    assert seen == [([0, 7, 8, 20, 25], 12, window)] * layers * (1 if checkpointing is None else 2)


@pytest.mark.parametrize("use_cache, contaminated", [(True, True), (False, False)])
def test_transformers_sdpa_without_the_patch_leaks_across_samples_when_caching(use_cache, contaminated):
    """The failure the patch prevents: with a KV cache, transformers' sdpa ignores the position_ids packing."""
    model = model_of("llama")
    model.config.use_cache = use_cache
    model.set_attn_implementation("sdpa")
    batch = packed_batch(LENGTHS, boundaries="position_ids")
    with torch.no_grad():
        packed, _ = run_packed(model, batch, LENGTHS)
        alone, _ = run_alone(model, batch, LENGTHS)
    first = LENGTHS[0]
    assert_relatively_close(packed[:, :first], alone[:, :first], FLOAT64_BOUND)
    leak = (packed[:, first:] - alone[:, first:]).abs().max().item()
    assert (leak > 1e-2) if contaminated else (leak < 1e-4)


def test_apply_selects_varlen_attention_and_disables_the_cache():
    model = model_of("glm4")
    assert model.config.use_cache
    assert apply(model) is model
    assert model.config._attn_implementation == "longalign_varlen" and not model.config.use_cache
    apply(model, backend="sdpa_segments")
    assert model.config._attn_implementation == "longalign_varlen_segments"
    # transformers treats names with "flash" or "org/repo" shapes as its own kernels to load.
    assert not any("flash" in name or "/" in name or "sdpa" in name for name in ATTENTION_NAMES.values())
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        apply(model, backend="flash")


def test_named_backend_that_cannot_run_fails_at_first_forward():
    model = apply(model_of("llama"), backend="torch_varlen")
    with pytest.raises(ValueError, match="'torch_varlen' cannot run here: needs a CUDA device"):
        model(**packed_batch(LENGTHS))


@pytest.mark.parametrize("kind", ["llama", "glm", "glm4"])
def test_families_are_named(kind):
    assert check_model(model_of(kind)) == {"llama": "Llama 3", "glm": "GLM", "glm4": "GLM-4"}[kind]


def test_other_rotary_decoders_take_the_generic_path():
    assert check_model(model_of("mistral")) == "generic"


def test_learned_positions_are_refused_in_one_line_pointing_at_the_families_page():
    model = GPT2LMHeadModel(
        GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
    )
    with pytest.raises(UnsupportedModelError, match="no rotary position embedding") as error:
        apply(model)
    assert "docs/training/families.md" in str(error.value) and "\n" not in str(error.value)


def test_batch_dependent_rope_is_refused():
    config = LlamaConfig(
        **TINY, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    )
    with pytest.raises(UnsupportedModelError, match="rope_type 'dynamic' derives frequencies"):
        check_model(LlamaForCausalLM(config))


def test_remote_code_glm_points_to_the_native_loader():
    remote = type("ChatGLMForConditionalGeneration", (torch.nn.Module,), {})
    remote.__module__ = "transformers_modules.THUDM.glm-4-9b-chat.modeling_chatglm"
    model = remote()
    model.config = types.SimpleNamespace(model_type="chatglm")
    with pytest.raises(
        UnsupportedModelError, match="trust_remote_code.*longalign.checkpoints.load_model \\(GlmForCausalLM"
    ):
        apply(model)


def test_wrapped_models_are_refused_with_a_hint():
    wrapper = torch.nn.Module()
    wrapper.model = model_of("llama")
    with pytest.raises(
        UnsupportedModelError, match="call longalign.patch.apply on the model before wrapping"
    ):
        apply(wrapper)


def test_padding_is_an_error_and_an_all_ones_mask_is_not():
    model = apply(model_of("llama"))
    batch = packed_batch(LENGTHS)
    assert_relatively_close(
        model(**batch, attention_mask=torch.ones_like(batch["input_ids"])).logits,
        model(**batch).logits,
        FLOAT64_BOUND,
    )
    mask = torch.ones_like(batch["input_ids"])
    mask[0, -3:] = 0
    with pytest.raises(ValueError, match="the batch has padding"):
        model(**batch, attention_mask=mask)


def test_unpacked_rows_need_no_boundaries_and_multi_row_packs_are_refused():
    model = apply(model_of("llama"))
    input_ids = torch.randint(3, VOCAB, (2, 6))
    with torch.no_grad():
        rows = model(input_ids=input_ids).logits
        alone = torch.cat([model(input_ids=row[None]).logits for row in input_ids])
    assert_relatively_close(rows, alone, FLOAT64_BOUND)
    batch = packed_batch([3, 3]) | {"input_ids": input_ids, "position_ids": torch.arange(3).repeat(2, 2)}
    with pytest.raises(ValueError, match="or concatenate the packs into a single row"):
        model(**batch)


def patched_and_eager(kind: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A patched tiny model in float64, and an unpatched sdpa copy of it to run samples alone.

    Not eager: transformers' eager attention takes its softmax in float32 whatever the model's dtype.
    """
    model = model_of(kind).double()
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    reference.config.use_cache = False
    return apply(model), reference


@pytest.mark.parametrize("kind", ["llama", "glm", "glm4"])
def test_the_recipe_s_forward_call_reads_a_1d_mask_as_cu_seqlens(kind):
    """LongAlign's check of a patched model: one packed row, its boundaries as a 1D int32 attention_mask."""
    model, reference = patched_and_eager(kind)
    ids = packed_batch(LENGTHS)["input_ids"]
    with torch.no_grad():
        packed = model(
            input_ids=ids, attention_mask=torch.tensor([0, 7, 8, 20, 25], dtype=torch.int32)
        ).logits
        alone = torch.cat(
            [reference(input_ids=ids[:, part]).logits for part in sample_slices(LENGTHS)], dim=1
        )
    assert packed.shape == (1, sum(LENGTHS), VOCAB)
    torch.testing.assert_close(packed, alone, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("kind", ["llama", "glm", "glm4"])
def test_a_1d_mask_over_several_rows_marks_the_flattened_tokens(kind):
    """input_ids [2, 10] with boundaries over all 20 tokens; the third sample runs from row 0 into row 1."""
    model, reference = patched_and_eager(kind)
    lengths = [7, 1, 5, 7]
    ids = packed_batch(lengths)["input_ids"]
    mask = torch.tensor([0, 7, 8, 13, 20])
    with torch.no_grad():
        rows = model(input_ids=ids.view(2, 10), attention_mask=mask).logits
        alone = torch.cat(
            [reference(input_ids=ids[:, part]).logits for part in sample_slices(lengths)], dim=1
        )
    assert rows.shape == (2, 10, VOCAB)
    torch.testing.assert_close(rows, alone.view(2, 10, VOCAB), atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize(
    "mask, message",
    [
        (torch.tensor([0.0, 7.0, 25.0]), "has dtype torch.float32; it must be an integer tensor"),
        (torch.tensor([True, False]), "has dtype torch.bool"),
        (torch.tensor([25]), r"has fewer than 2 entries; it needs at least \[0, 25\]"),
        (torch.tensor([3, 7, 25]), "starts at 3, not 0"),
        (torch.tensor([0, 7, 7, 25]), "is not strictly increasing: entry 2 is 7 after 7"),
        (torch.tensor([0, 9, 7, 25]), "is not strictly increasing: entry 2 is 7 after 9"),
        (torch.tensor([0, 7, 24], dtype=torch.int32), "ends at 24, not at 25"),
        (torch.tensor([0, 7, 26]), "ends at 26, not at 25"),
    ],
)
def test_a_1d_mask_that_is_not_boundaries_is_a_one_line_error(mask, message):
    model = apply(model_of("llama"))
    with pytest.raises(
        InputError, match="read as cu_seqlens for input_ids \\[1, 25\\] \\(25 tokens\\)"
    ) as error:
        model(input_ids=packed_batch(LENGTHS)["input_ids"], attention_mask=mask)
    assert re.search(message, str(error.value)) and "\n" not in str(error.value)


def test_autocast_mixed_precision_runs_through_the_patch():
    model = apply(model_of("glm").float())  # autocast runs float32 layers in bf16
    batch = packed_batch(LENGTHS)
    with torch.no_grad():
        full = model(**batch).logits
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mixed = model(**batch).logits
    assert_relatively_close(mixed, full, 2e-2)  # bf16 rounding, no more

"""LoRA adapters on patched tiny models: targets per family, packed == each sample alone through the chunked
loss (adapter gradients included), adapted and trained heads, checkpointing, QLoRA, merging, and a run that
trains, resumes and merges."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    DEMO,
    FLOAT32_BOUND,
    FLOAT64_BOUND,
    TINY,
    TOKENIZER,
    assert_relatively_close,
    demo_train_arguments,
    pack_row,
    relative_error,
    save_packs,
    step_losses,
    tiny_model,
    train_demo,
)
from peft import PeftModel
from transformers import AutoModelForCausalLM

from longalign.batching import PackCollator
from longalign.cli import main
from longalign.config import LoraConfig, load_config
from longalign.errors import ConfigError, ModelError, PathError
from longalign.lora import (
    adapted_head,
    add_adapters,
    merge_adapter,
    quantization,
    save_base,
    target_modules,
    trainable_modules,
)
from longalign.loss import lm_head_spec, weighted_loss_sum
from longalign.run import load_model, parameter_summary

VOCAB = TINY["vocab_size"]
LENGTHS = [5, 9, 1, 12, 7]  # a single-token sample among them


def randomize_adapters(model: torch.nn.Module, seed: int = 3) -> torch.nn.Module:
    """Random B matrices (peft starts them at zero, where A's gradient is zero) and perturbed trained copies."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                param.add_(torch.randn(param.shape, generator=generator).to(param) * 0.1)
    return model


def adapted(kind: str = "llama", **settings) -> torch.nn.Module:
    """The tiny model with random adapters, in float64: identities then hold to rounding on any CPU."""
    model = tiny_model(kind, backend="sdpa_segments").double()
    lora = LoraConfig(**{"r": 4, "alpha": 8.0, **settings})
    return randomize_adapters(add_adapters(model, lora, base_model="tiny"))


def samples(seed: int = 1) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) per sample; each sample's first two tokens are prompt, not targets."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for length in LENGTHS:
        ids = torch.randint(3, VOCAB, (length,), generator=generator).tolist()
        out.append((ids, [-100] * min(2, length) + ids[2:]))
    return out


def packed_batch(items: list[tuple[list[int], list[int]]]) -> dict:
    offsets = [0]
    for ids, _ in items:
        offsets.append(offsets[-1] + len(ids))
    row = {
        "input_ids": [t for ids, _ in items for t in ids],
        "labels": [t for _, labels in items for t in labels],
        "cu_seqlens": offsets,
    }
    return PackCollator(weighting="token_level")([row])


def trained_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.grad.clone() for name, param in model.named_parameters() if param.requires_grad}


def each_sample_alone(model: torch.nn.Module, items) -> torch.Tensor:
    """Summed cross-entropy of every sample run on its own, through the model's full logits (no LossHead)."""
    total = torch.zeros(())
    for ids, labels in items:
        logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
        total = total + F.cross_entropy(
            logits[:-1], torch.tensor(labels[1:], dtype=torch.long), ignore_index=-100, reduction="sum"
        )
    return total


# --- what gets adapters and what trains ------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("llama", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
        ("glm", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"]),
        ("glm4", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"]),
        ("mistral", "all-linear"),
    ],
)
def test_default_targets_are_every_attention_and_mlp_projection(kind, expected):
    assert target_modules(tiny_model(kind, backend="sdpa_segments"), None) == expected
    model = adapted(kind)
    adapters = {name.split(".")[-4] for name, _ in model.named_parameters() if "lora_A" in name}
    projections = {
        name.rsplit(".", 1)[-1]
        for name, module in tiny_model(kind).named_modules()
        if isinstance(module, torch.nn.Linear) and name != "lm_head"
    }
    assert adapters == projections  # every linear layer of the decoder, never the head
    assert all(("lora_" in name) == param.requires_grad for name, param in model.named_parameters())


def test_trainable_groups_name_modules_by_role():
    model = tiny_model("glm4")
    assert trainable_modules(model, ["embeddings", "lm_head"]) == ["model.embed_tokens", "lm_head"]
    norms = trainable_modules(model, ["norms"])
    assert (
        len(norms) == 2 * 4 + 1 and "model.layers.1.post_mlp_layernorm" in norms and norms[-1] == "model.norm"
    )
    assert trainable_modules(model, ["input_layernorm", "norms"])[:2] == [
        "model.layers.0.input_layernorm",
        "model.layers.1.input_layernorm",
    ]


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            {"target_modules": ["qproj"]},
            r"lora.target_modules: 'qproj' names no linear layer of LlamaForCausalLM \(its linear layers: "
            r"down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj\)",
        ),
        ({"trainable": ["embedding"]}, "lora.trainable: 'embedding' names no module of LlamaForCausalLM"),
        (
            {"target_modules": ["q_proj", "lm_head"], "trainable": ["lm_head"]},
            "lora.trainable: lm_head also gets an adapter",
        ),
        ({"trainable": ["v_proj"]}, "lora.trainable: model.layers.0.self_attn.v_proj also gets an adapter"),
    ],
)
def test_names_that_match_nothing_or_clash_are_one_line_errors(settings, message):
    with pytest.raises(ConfigError, match=message):
        add_adapters(tiny_model(backend="sdpa_segments"), LoraConfig(**settings), base_model="tiny")


# --- exactness through the chunked loss -----------------------------------------------------------------

SETTINGS = {
    "projections": {},
    "head_adapter_trained_embeddings_norms": {
        "target_modules": ["q_proj", "v_proj", "o_proj", "down_proj", "lm_head"],
        "trainable": ["embeddings", "norms"],
    },
    "trained_head": {"trainable": ["lm_head", "norms"]},
}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("kind", ["llama", "glm4"])
def test_packed_equals_each_sample_alone_with_adapters(kind, setting):
    """One pack through the patched attention and the chunked loss in the head == every sample alone with full
    logits: the same loss and the same gradient for every adapter and trained module."""
    model = adapted(kind, **SETTINGS[setting])
    items = samples()
    packed = weighted_loss_sum(model, packed_batch(items), chunk_size=3, read_head=adapted_head)
    packed.backward()
    got = trained_grads(model)
    model.zero_grad()
    expected = each_sample_alone(model, items)
    expected.backward()
    want = trained_grads(model)
    assert got.keys() == want.keys() and len(got) > 0
    assert_relatively_close(packed, expected, FLOAT64_BOUND)
    assert_relatively_close(got, want, FLOAT64_BOUND)


def test_dropout_of_a_head_adapter_is_the_one_peft_applies():
    """With dropout the widened head draws the same mask as peft's own forward: the same loss and gradients
    under the same seed, and other ones under another."""
    model = adapted(target_modules=["lm_head"], dropout=0.5).train()
    items = samples()[:1]

    def through_loss_head(seed: int):
        torch.manual_seed(seed)
        loss = weighted_loss_sum(model, packed_batch(items), read_head=adapted_head)
        return loss, torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad])

    torch.manual_seed(7)
    expected = each_sample_alone(model, items)
    expected_grads = torch.autograd.grad(expected, [p for p in model.parameters() if p.requires_grad])
    loss, grads = through_loss_head(7)
    assert_relatively_close(loss, expected, FLOAT64_BOUND)
    assert_relatively_close(grads, expected_grads, FLOAT64_BOUND)
    other = through_loss_head(8)[0].detach()
    assert abs(float(other - expected.detach())) > 1e-3  # the test can fail: dropout is on


def test_heads_inside_peft_models_are_read_and_unsupported_ones_named():
    frozen = adapted()
    assert type(frozen.get_output_embeddings()) is torch.nn.Linear
    assert lm_head_spec(frozen, adapted_head).weight is frozen.get_output_embeddings().weight
    assert not frozen.get_output_embeddings().weight.requires_grad
    copy = lm_head_spec(adapted(trainable=["lm_head"]), adapted_head)  # the trained copy is read
    assert copy.weight.requires_grad and copy.weight.shape == (TINY["vocab_size"], TINY["hidden_size"])
    lora = adapted(target_modules=["lm_head"])
    assert not lm_head_spec(lora, adapted_head).weight.requires_grad  # the frozen base; the reader adds B A
    with pytest.raises(
        ModelError,
        match="PeftModelForCausalLM: output layer is Linear; the chunked loss reads a torch.nn.Linear",
    ):
        lm_head_spec(lora)  # the loss alone does not read adapters: their module brings the reader

    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    dora = get_peft_model(
        tiny_model(backend="sdpa_segments"), PeftLoraConfig(target_modules=["lm_head"], use_dora=True)
    )
    with pytest.raises(ValueError, match="PeftModel: output layer has a LoRA adapter .*DoRA"):
        weighted_loss_sum(dora, packed_batch(samples()), read_head=adapted_head)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_keeps_adapter_gradients(reentrant):
    items = samples()
    plain = adapted()
    weighted_loss_sum(plain, packed_batch(items), read_head=adapted_head).backward()
    checkpointed = adapted()
    checkpointed.activation_checkpointing_enable({"use_reentrant": reentrant})
    weighted_loss_sum(checkpointed, packed_batch(items), read_head=adapted_head).backward()
    assert_relatively_close(trained_grads(checkpointed), trained_grads(plain), FLOAT64_BOUND)
    # Frozen embeddings still hand the first layer an input that needs a gradient (checkpointing or not).
    assert adapted().get_input_embeddings()(torch.tensor([[3, 4]])).requires_grad


def test_trained_embeddings_stay_tied_to_the_head():
    base = tiny_model(backend="sdpa_segments", tie_word_embeddings=True).double()
    model = randomize_adapters(
        add_adapters(base, LoraConfig(r=4, trainable=["embeddings"]), base_model="tiny")
    )
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert head.modules_to_save["default"].weight is embedding.modules_to_save["default"].weight
    items = samples()
    packed = weighted_loss_sum(model, packed_batch(items), read_head=adapted_head)
    assert_relatively_close(packed, each_sample_alone(model, items), FLOAT64_BOUND)


def test_parameter_summary_counts_what_trains():
    model = adapted()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    assert (
        parameter_summary(model)
        == f"parameters: {trainable:,} trainable of {total:,} ({trainable / total:.2%})"
    )
    full = tiny_model()
    assert parameter_summary(full).endswith(f"trainable of {total - trainable:,} (100.00%)")


# --- QLoRA ------------------------------------------------------------------------------------------------


def test_quantization_runs_on_cpu_and_is_refused_elsewhere_in_one_line():
    cpu = torch.device("cpu")
    assert quantization(None, dtype=torch.bfloat16, device=cpu) == {}
    assert quantization(LoraConfig(), dtype=torch.bfloat16, device=cpu) == {}
    four = quantization(LoraConfig(load_in_4bit=True), dtype=torch.bfloat16, device=cpu)
    config = four["quantization_config"]
    assert four["device_map"] == {"": cpu} and config.load_in_4bit and config.bnb_4bit_quant_type == "nf4"
    assert config.bnb_4bit_use_double_quant and config.bnb_4bit_compute_dtype == torch.bfloat16
    assert quantization(LoraConfig(load_in_8bit=True), dtype=torch.float32, device=cpu)[
        "quantization_config"
    ].load_in_8bit
    with pytest.raises(
        ConfigError,
        match=r"^lora.load_in_4bit: bitsandbytes quantizes on CUDA and CPU here; this run is on meta$",
    ):
        quantization(LoraConfig(load_in_4bit=True), dtype=torch.bfloat16, device=torch.device("meta"))
    cfg = load_config(DEMO, ["lora.load_in_4bit=true"])
    with pytest.raises(ConfigError, match="a checkpoint is quantized as it loads"):
        load_model(cfg)  # a run saves the random base first (longalign.run.saved_random_base)


needs_bitsandbytes = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None,
    reason="QLoRA needs bitsandbytes (pip install 'longalign[qlora]')",
)
QLORA_DEVICE = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
QLORA_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "head_dim": 16}  # bitsandbytes blocks of 64


@needs_bitsandbytes
@pytest.mark.parametrize("bits", [4, 8])
def test_qlora_trains_adapters_on_a_quantized_base(tmp_path, bits):
    """A saved tiny Llama loads quantized (on the GPU, else the CPU); packed == each sample alone, to bf16
    precision."""
    tiny_model(**QLORA_SHAPE).save_pretrained(tmp_path / "base")
    cfg = load_config(
        None,
        [f"model.model_name_or_path='{tmp_path / 'base'}'", "model.torch_dtype='bfloat16'",
         "model.attn_backend='sdpa_segments'", f"lora.load_in_{bits}bit=true", "lora.r=4"],
    )  # fmt: skip
    device = QLORA_DEVICE
    base = load_model(cfg, device)
    layer = base.model.layers[0].self_attn.q_proj
    assert type(layer).__name__ == ("Linear4bit" if bits == 4 else "Linear8bitLt")
    assert type(base.lm_head) is torch.nn.Linear  # bitsandbytes leaves the head alone
    model = randomize_adapters(add_adapters(base, cfg.lora, base_model=str(tmp_path / "base")))
    items = samples()
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in packed_batch(items).items()}
    packed = weighted_loss_sum(model, batch, read_head=adapted_head)
    packed.backward()
    got = trained_grads(model)
    model.zero_grad()
    total = torch.zeros((), device=device)
    for ids, labels in items:
        logits = model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0].float()
        target = torch.tensor(labels[1:], dtype=torch.long, device=device)
        total = total + F.cross_entropy(logits[:-1], target, ignore_index=-100, reduction="sum")
    total.backward()
    want = trained_grads(model)
    assert_relatively_close(packed, total, 2e-2)  # bf16 weights: a bf16 bound
    assert_relatively_close(got, want, 5e-2)
    assert "trainable of" in parameter_summary(model)


def one_step_run(tmp_path: Path, base: Path, name: str, *overrides: str):
    """The config of one plain-SGD step (no clipping, no decay, constant rate) of ``[lora]`` on one pack."""
    run_file = tmp_path / f"{name}.toml"
    run_file.write_text(
        f"[data]\ntrain_file = '{tmp_path / 'packs'}'\nmax_seq_len = 64\n"
        f"[training]\noutput_dir = '{tmp_path / name}'\nmax_steps = 1\nlearning_rate = 1.0\noptim = 'sgd'\n"
        "lr_scheduler_type = 'constant'\nmax_grad_norm = 0.0\nweight_decay = 0.0\nuse_cpu = true\n"
        "save_strategy = 'no'\nlogging_steps = 1\nreport_to = 'none'\ndisable_tqdm = true\n"
        f"[model]\nmodel_name_or_path = '{base}'\ntokenizer = '{TOKENIZER}'\ntorch_dtype = 'float32'\n"
        "attn_backend = 'sdpa_segments'\n[lora]\nr = 4\nalpha = 8.0\n"
    )
    return load_config(run_file, list(overrides))


def trained_step(cfg, start: dict[str, torch.Tensor] | None = None) -> tuple[dict, dict, torch.nn.Module]:
    """The adapters before and after one step of the real run (``build_trainer``, then ``train``), and the
    trained model; ``start`` sets the adapters first (by default their B matrices are randomized)."""
    from longalign.run import build_trainer, close, release

    trainer = build_trainer(cfg)
    trained = dict(trainer.model.named_parameters())
    with torch.no_grad():
        if start is None:
            randomize_adapters(trainer.model)  # B != 0: A gets a gradient too
        else:
            assert sorted(start) == sorted(name for name, p in trained.items() if p.requires_grad)
            for name, value in start.items():
                trained[name].copy_(value)
    before = {name: p.detach().clone() for name, p in trained.items() if p.requires_grad}
    model = trainer.model
    trainer.train()
    after = {name: p.detach().clone() for name, p in trained.items() if p.requires_grad}
    release(trainer)
    close()
    return before, after, model


@needs_bitsandbytes
def test_a_qlora_step_on_cpu_updates_the_adapters_as_lora_on_the_dequantized_base(tmp_path):
    """One SGD step of the real run with a 4-bit base on CPU gives the adapters the update that plain LoRA
    gives on the dequantized weights (``bnb.functional.dequantize_4bit``), to float32 rounding.

    bitsandbytes' CPU backend computes a 4-bit layer as ``x @ dequantize_4bit(W).T``, forward and backward:
    the two steps run the same float32 operations on the same weights, so their updates can differ only by
    rounding, which ``FLOAT32_BOUND`` (1e-5, relative over all adapters) bounds on any CPU; measured: 0.0,
    bit-identical. The control, the same step on the unquantized base, moves the update by 27%.
    """
    import bitsandbytes as bnb

    shipped_tokenizer = {"vocab_size": 4096, "bos_token_id": 4088, "eos_token_id": 4092, "pad_token_id": 4093}
    tiny_model(**QLORA_SHAPE, **shipped_tokenizer).save_pretrained(tmp_path / "base")
    save_packs(tmp_path / "packs", [pack_row(samples())])
    before, qlora, model = trained_step(
        one_step_run(tmp_path, tmp_path / "base", "qlora", "lora.load_in_4bit=true")
    )

    quantized = {
        name.removesuffix(".base_layer"): module
        for name, module in model.get_base_model().named_modules()
        if isinstance(module, torch.nn.Linear) and "lora_" not in name and name != "lm_head"
    }
    assert len(quantized) == 2 * 7  # q k v o gate up down in each layer
    for name, module in quantized.items():
        assert type(module) is bnb.nn.Linear4bit, name
        assert module.weight.quant_type == "nf4" and module.weight.quant_state.nested  # double quantization
        assert module.compute_dtype == torch.float32
    assert type(model.get_base_model().lm_head) is torch.nn.Linear

    dequantized = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    with torch.no_grad():
        for name, module in quantized.items():
            weight = bnb.functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
            dequantized.get_submodule(name).weight.copy_(weight)
    dequantized.save_pretrained(tmp_path / "dequantized")
    start, lora, _ = trained_step(one_step_run(tmp_path, tmp_path / "dequantized", "lora"), before)

    assert all(torch.equal(before[name], start[name]) for name in before)
    update = {name: qlora[name] - before[name] for name in before}
    expected = {name: lora[name] - before[name] for name in before}
    assert all(value.norm() > 0 for value in expected.values())  # every adapter matrix moved
    assert_relatively_close(update, expected, FLOAT32_BOUND)
    _, unquantized, _ = trained_step(one_step_run(tmp_path, tmp_path / "base", "full-precision"), before)
    assert relative_error({name: unquantized[name] - before[name] for name in before}, expected) > 1e-2


# --- merging ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "glm4"])
def test_merged_model_gives_the_adapted_model_logits(tmp_path, kind):
    base = tiny_model(kind, backend="sdpa_segments")
    base_dir = save_base(base, tmp_path / "run")
    lora = LoraConfig(
        r=4, target_modules=["q_proj", "down_proj", "lm_head"], trainable=["embeddings", "norms"]
    )
    model = randomize_adapters(add_adapters(base, lora, base_model=base_dir)).eval()
    model.save_pretrained(tmp_path / "adapter")
    saved = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == base_dir == str((tmp_path / "run" / "base_model").resolve())

    assert merge_adapter(tmp_path / "adapter", tmp_path / "merged") == tmp_path / "merged"
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert merged.config.use_cache and not any("lora" in name for name, _ in merged.named_parameters())
    ids = torch.tensor([[5, 9, 17, 3, 40, 41, 2]])
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
        reloaded = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(base_dir), tmp_path / "adapter"
        )
        assert_relatively_close(reloaded.eval()(input_ids=ids).logits, expected)
        assert_relatively_close(merged(input_ids=ids).logits, expected)
        unchanged = AutoModelForCausalLM.from_pretrained(base_dir)(input_ids=ids).logits
        assert (expected - unchanged).abs().max() > 1e-2  # the test can fail: the adapters change the logits

    with pytest.raises(PathError, match="no adapter_config.json"):
        merge_adapter(tmp_path / "merged", tmp_path / "again")


# --- a run: train, checkpoint, resume, merge -------------------------------------------------------------

ADAPTER_RUN = ["lora.r=8", "lora.alpha=16", "lora.trainable=['norms']", "training.learning_rate=1e-2"]


def train(tokenized: Path, output_dir: Path, *overrides: str):
    """A demo run with adapters."""
    train_demo(tokenized, output_dir, *ADAPTER_RUN, *overrides)


@pytest.mark.integration
def test_adapter_run_resumes_like_an_uninterrupted_one_and_merges(tokenized_sample, tmp_path, capsys):
    straight = tmp_path / "straight"
    train(tokenized_sample, straight, "training.max_steps=4")  # saves at 2 and 4
    expected = step_losses(straight)
    assert sorted(expected) == [1, 2, 3, 4] and expected[4] < expected[1]
    printed = capsys.readouterr().out
    assert "parameters: " in printed and "trainable of" in printed
    assert "(100.00%)" not in printed

    # A run stopped after its checkpoint at step 2, resumed from its last checkpoint up to 4.
    resumed = tmp_path / "resumed"
    shutil.copytree(straight / "checkpoint-2", resumed / "checkpoint-2")
    train(tokenized_sample, resumed, "training.max_steps=4", "training.resume_from_checkpoint='last'")
    got = step_losses(resumed)
    for step in (3, 4):  # the adapters, optimizer and pack order all came back
        assert got[step] == pytest.approx(expected[step], rel=1e-4)
    checkpoint = resumed / "checkpoint-4"
    assert (checkpoint / "adapter_model.safetensors").is_file() and not (
        checkpoint / "model.safetensors"
    ).exists()
    record = json.loads((checkpoint / "longalign_checkpoint.json").read_text())
    assert record["decides"]["lora.r"] == 8 and record["decides"]["lora.trainable"] == ["norms"]

    # Other adapter settings, or none at all, would train something else from the checkpoint: refused
    # before the model loads (here, in this process, as the console command runs it).
    other = ("training.max_steps=8", "training.resume_from_checkpoint='last'", "lora.r=4")
    assert main(["train", *demo_train_arguments(tokenized_sample, resumed, *ADAPTER_RUN, *other)]) == 2
    refusal = capsys.readouterr().err
    assert "lora.r 8 -> 4" in refusal and "Traceback" not in refusal

    merged = tmp_path / "merged"
    assert main(["merge", "--adapter", str(straight), "--output", str(merged)]) == 0
    base = AutoModelForCausalLM.from_pretrained(straight / "base_model")
    ids = torch.tensor([[4088, 5, 6, 7, 300, 301]])
    with torch.no_grad():
        adapted_logits = PeftModel.from_pretrained(base, straight).eval()(input_ids=ids).logits
        merged_logits = AutoModelForCausalLM.from_pretrained(merged).eval()(input_ids=ids).logits
    assert_relatively_close(merged_logits, adapted_logits)
    assert (merged / "tokenizer_config.json").is_file()

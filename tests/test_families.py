"""Every causal-LM family of the installed transformers: exact when packed, or refused in one line.

For each model type of transformers' causal-LM registry, a tiny model of its own config class
(``tests/tiny_configs.py``: windows and chunks of 16 tokens, shorter than the samples) is decided by
``longalign.patch.families.decide``. A family the decision accepts must train on one packed row of three
samples (45, 70 and 29 tokens) as the family's own eager model trains on each sample alone: the logits,
and the gradients of the summed next-token loss. A family it refuses must be refused in one line. A family
that is neither (accepted and different, or accepted and crashing) fails. Each family that packs exactly
also runs with its MLPs tiled (``training.sequence_tiling = "mlp"``, tiles of 7 tokens) against the same
model untiled: the logits, the gradients, and the router logits with a gradient through them where the
family records some (mixtures of experts); or its decision refuses the tiling in one line. Each exact
family's layers are also tiled (``sequence_tiling = "layer"``) on the same packed row: the same logits and
gradients as untiled, or refused in one line.

The families run in this one process, float64, on tiny models. ``docs/training/families.md`` holds the
table of outcomes; the last test checks that it is this run's (``LONGALIGN_WRITE_FAMILIES=1`` rewrites it).
"""

from __future__ import annotations

import copy
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import ROOT, pack_row
from tiny_configs import FIRST_SAFE_ID, VOCAB, build, tiny_config
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import longalign.patch
from longalign.errors import ModelError
from longalign.patch import families

TYPES = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
LENGTHS = (45, 70, 29)
# Norm-relative bounds, float64 models: a family's own float32 steps (norms, routers, RoPE tables computed in
# float32) put packed and alone about 1e-8 apart; a sample that sees another, or a position counted from
# the row's start, puts them 1e-4 to 1 apart.
LOGITS_BOUND = 1e-6
GRADS_BOUND = 1e-5
LAYER_TILE_TOKENS = 40  # the tiled layer's tiles: 40, 40, 40 and 24 of the 144 tokens
TABLE = ROOT / "docs" / "training" / "families.md"


@dataclass(frozen=True)
class Outcome:
    """What the registry test found for one model type."""

    model_type: str
    architecture: str
    status: str  # "exact", "refused", or a failure: "wrong", "crash"
    detail: str  # the refusal, the figures, or the error
    features: tuple[str, ...] = ()
    tiled: str = ""  # with sequence_tiling = "mlp", of an exact family: "exact", "refused", "wrong", "crash"
    tiled_detail: str = ""
    tiled_layer: str = ""  # the tiled layer: "exact: ...", "refused: ...", or a failure (exact families only)


def relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[0, :-1].double(), ids[0, 1:], reduction="sum")


def packed_against_alone(model: torch.nn.Module) -> tuple[float, float, str]:
    """(logits error, gradients error), norm-relative (the gradients as one vector): ``model`` packed (patched copy) against each
    sample alone through ``model`` itself (eager); and the tiled layer's outcome (:func:`layer_tiled_against_untiled`)."""
    packed_model = longalign.patch.apply(copy.deepcopy(model), backend="sdpa_segments")
    ids = torch.randint(FIRST_SAFE_ID, VOCAB, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(1))
    ends = torch.tensor(LENGTHS).cumsum(0).tolist()
    parts = [slice(end - n, end) for n, end in zip(LENGTHS, ends, strict=True)]
    cu_seqlens = torch.tensor([0, *ends], dtype=torch.int32)
    batch = {
        "input_ids": ids,
        "position_ids": torch.cat([torch.arange(n) for n in LENGTHS])[None],
        "cu_seq_lens_q": cu_seqlens,
        "cu_seq_lens_k": cu_seqlens,
        "max_length_q": max(LENGTHS),
        "max_length_k": max(LENGTHS),
    }
    packed = packed_model(**batch, use_cache=False).logits

    def packed_loss(logits: torch.Tensor) -> torch.Tensor:
        return sum(_loss(logits[:, part], ids[:, part]) for part in parts)

    packed_loss(packed).backward()
    tiled = layer_tiled_against_untiled(model, packed_model, batch, packed, packed_loss)
    alone = [model(input_ids=ids[:, part], use_cache=False).logits for part in parts]
    sum(_loss(logits, ids[:, part]) for logits, part in zip(alone, parts, strict=True)).backward()
    logits_error = relative(packed.double(), torch.cat(alone, dim=1).double())
    names = [name for name, p in model.named_parameters() if p.grad is not None]
    actual = dict(packed_model.named_parameters())
    grads_error = relative(
        torch.cat([actual[name].grad.double().flatten() for name in names]),
        torch.cat([model.get_parameter(name).grad.double().flatten() for name in names]),
    )
    return logits_error, grads_error, tiled


def layer_tiled_against_untiled(
    model: torch.nn.Module, packed_model: torch.nn.Module, batch: dict, packed: torch.Tensor, loss
) -> str:
    """The family's decoder layers tiled (``tile_layers``, 4 tiles of the 144 tokens, their edges inside the
    samples) on the packed batch against ``packed_model`` untiled: "exact", "refused: ..." (by the
    decision, before any data), "refused at its first forward: ..." (a layer that calls attention twice),
    "wrong: ..." or "crash: ..."."""
    try:
        tiled_model = longalign.patch.tile_layers(
            longalign.patch.apply(copy.deepcopy(model), backend="sdpa_segments"),
            tile_tokens=LAYER_TILE_TOKENS,
        )
    except ModelError as err:
        return f"refused: {err}"
    try:
        tiled = tiled_model(**batch, use_cache=False).logits
        loss(tiled).backward()
    except ModelError as err:  # what the layer's structure shows only when it runs
        return f"refused at its first forward: {err}"
    except Exception as err:  # noqa: BLE001 - a family the tiled layer accepts and fails on is the finding
        first = (str(err).strip().splitlines() or [""])[0]
        return f"crash: {type(err).__name__}: {first}"
    names = [name for name, p in packed_model.named_parameters() if p.grad is not None]
    actual = dict(tiled_model.named_parameters())
    logits_error = relative(tiled.double(), packed.double())
    grads_error = relative(
        torch.cat([actual[name].grad.double().flatten() for name in names]),
        torch.cat([packed_model.get_parameter(name).grad.double().flatten() for name in names]),
    )
    exact = logits_error <= LOGITS_BOUND and grads_error <= GRADS_BOUND
    return f"{'exact' if exact else 'wrong'}: logits {logits_error:.1e}, gradients {grads_error:.1e}"


MLP_TILE_TOKENS = 7  # 2 tiles (7 and 6) of the 13 tokens the tiled MLPs run on
MLP_TILED_LENGTH = 13


def mlp_tiled_against_untiled(model: torch.nn.Module) -> tuple[float, float, float]:
    """(logits, gradients, router logits) errors, norm-relative: ``model`` with its MLPs tiled (a copy)
    against ``model`` itself, on one row of 13 tokens. The loss adds a random weighting of the router
    logits, where the family records them, so that their gradients reach the routers through the tiles."""
    model.zero_grad(set_to_none=True)  # the gradients of the packed comparison
    tiled = longalign.patch.tile_mlp(copy.deepcopy(model), tile_tokens=MLP_TILE_TOKENS)
    ids = torch.randint(
        FIRST_SAFE_ID, VOCAB, (1, MLP_TILED_LENGTH), generator=torch.Generator().manual_seed(3)
    )
    routers = "router_logits" in (getattr(type(model), "_can_record_outputs", None) or {})

    def step(which: torch.nn.Module) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
        extra = {"output_router_logits": True} if routers else {}
        out = which(input_ids=ids, use_cache=False, **extra)
        recorded = tuple(out.router_logits) if routers else ()
        weights = torch.Generator().manual_seed(4)
        loss = _loss(out.logits, ids) + sum(
            (logits.double() * torch.randn(logits.shape, generator=weights, dtype=torch.float64)).sum()
            for logits in recorded
        )
        loss.backward()
        grads = torch.cat(
            [p.grad.double().flatten() for _, p in sorted(which.named_parameters()) if p.grad is not None]
        )
        return out.logits.detach(), tuple(logits.detach() for logits in recorded), grads

    want, got = step(model), step(tiled)
    model.zero_grad(set_to_none=True)
    assert len(got[1]) == len(want[1]), f"{len(got[1])} router logits tiled, {len(want[1])} untiled"
    router_error = relative(torch.cat(got[1]), torch.cat(want[1])) if want[1] else 0.0
    return relative(got[0], want[0]), relative(got[2], want[2]), router_error


@functools.cache
def outcome(model_type: str) -> Outcome:
    """The family's decision, and for an accepted one, packed against alone (on one thread: the tiny
    float64 operations run several times slower split over threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _outcome(model_type)
    finally:
        torch.set_num_threads(threads)


def _outcome(model_type: str) -> Outcome:
    transformers.logging.set_verbosity_error()
    try:
        config = tiny_config(model_type)
    except Exception:  # noqa: BLE001 - a config the rules cannot shrink is decided at its defaults
        config = AutoConfig.for_model(model_type)
    decision = families.decide(config, backend="sdpa_segments")
    features = tuple(decision.features.described())
    if not decision.exact:
        return Outcome(model_type, decision.architecture, "refused", decision.message(), features)
    torch.manual_seed(0)
    try:
        model = build(config).train()  # dropout is off in the tiny configs; train() as training runs
        logits_error, grads_error, tiled_layer = packed_against_alone(model)
    except Exception as err:  # noqa: BLE001 - an accepted family that fails is the finding
        first = (str(err).strip().splitlines() or [""])[0]
        return Outcome(model_type, decision.architecture, "crash", f"{type(err).__name__}: {first}", features)
    status = "exact" if logits_error <= LOGITS_BOUND and grads_error <= GRADS_BOUND else "wrong"
    tiled, tiled_detail = _tiled_outcome(model, decision.mlp_tiling)
    if tiled_layer.startswith("refused: ") and (
        decision.layer_tiling is None or decision.layer_tiling not in tiled_layer
    ):
        tiled_layer = (
            f"crash: tile_layers refused what the decision did not ({decision.layer_tiling}): {tiled_layer}"
        )
    return Outcome(
        model_type,
        decision.architecture,
        status,
        f"logits {logits_error:.1e}, gradients {grads_error:.1e} (norm-relative)",
        features,
        tiled,
        tiled_detail,
        tiled_layer,
    )


def _tiled_outcome(model: torch.nn.Module, problem: str | None) -> tuple[str, str]:
    if problem:
        return "refused", problem
    try:
        errors = mlp_tiled_against_untiled(model)
    except Exception as err:  # noqa: BLE001 - a family whose MLP tiling the decision accepts and that fails
        first = (str(err).strip().splitlines() or [""])[0]
        return "crash", f"{type(err).__name__}: {first}"
    exact = errors[0] <= LOGITS_BOUND and errors[1] <= GRADS_BOUND and errors[2] <= LOGITS_BOUND
    detail = "logits {:.1e}, gradients {:.1e}, router logits {:.1e} (norm-relative)".format(*errors)
    return ("exact" if exact else "wrong"), detail


@pytest.mark.parametrize("model_type", TYPES)
def test_every_family_is_exact_when_packed_or_refused_in_one_line(model_type):
    found = outcome(model_type)
    assert found.status in ("exact", "refused"), f"{model_type}: {found.status}: {found.detail}"
    if found.status == "refused":
        assert "\n" not in found.detail and "cannot train on packed samples exactly" in found.detail


def test_the_families_the_manual_names_are_exact():
    """The families users fine-tune in 2026, the ones packing needed work for among them."""
    named = [
        "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "glm", "glm4", "glm4_moe", "deepseek_v3",
        "gemma2", "gemma3_text", "gpt_oss", "llama4_text", "granite", "cohere2", "qwen3_next", "qwen3_5_text",
        "phi3", "olmo2", "smollm3",
    ]  # fmt: skip
    assert {name: outcome(name).status for name in named} == dict.fromkeys(named, "exact")


def test_every_exact_family_s_mlps_tile_exactly_or_are_refused_in_one_line():
    """``training.sequence_tiling = "mlp"`` on every family that packs exactly, dense or mixture of experts:
    the same logits, gradients and router logits as untiled, or a one-line refusal from the decision."""
    exact = [found for found in map(outcome, TYPES) if found.status == "exact"]
    failed = {
        found.model_type: f"{found.tiled}: {found.tiled_detail}"
        for found in exact
        if found.tiled not in ("exact", "refused")
    }
    assert not failed, failed
    assert all("\n" not in found.tiled_detail for found in exact)
    named = ["llama", "qwen3_moe", "qwen2_moe", "glm4_moe", "deepseek_v3", "gpt_oss", "gemma3_text", "phi3", "olmo2", "granite", "cohere2", "qwen3_next"]  # fmt: skip
    assert {name: outcome(name).tiled for name in named} == dict.fromkeys(named, "exact")
    manual = (ROOT / "docs" / "training" / "long-context.md").read_text()
    refused = [found.model_type for found in exact if found.tiled == "refused"]
    assert all(f"`{model_type}`" in manual for model_type in refused), refused  # the manual names each


def test_every_exact_family_s_tiled_layer_is_the_untiled_one_or_refused_in_one_line():
    """``sequence_tiling = "layer"`` on every family that packs exactly: the same logits and gradients as the
    untiled packed model, or a one-line refusal that the decision gave before any data (``Decision.layer_tiling``)."""
    found = {model_type: outcome(model_type) for model_type in TYPES}
    exact = {model_type: tiled.tiled_layer for model_type, tiled in found.items() if tiled.status == "exact"}
    failed = {
        model_type: tiled for model_type, tiled in exact.items() if not tiled.startswith(("exact", "refused"))
    }
    assert not failed, failed
    refused = [tiled for tiled in exact.values() if tiled.startswith("refused")]
    assert all("\n" not in tiled and "longalign cannot tile" in tiled for tiled in refused)
    named = ["llama", "qwen3_moe", "glm4_moe", "gpt_oss", "gemma3_text", "gemma4_text", "deepseek_v3", "phi3"]
    named += ["olmo2", "smollm3", "ministral", "granite", "cohere2", "exaone4", "seed_oss", "llama4_text"]
    named += ["qwen3_next", "qwen3_5_text", "kimi_linear"]  # linear attention: the token mixer runs whole
    assert {name: exact[name].split(":")[0] for name in named} == dict.fromkeys(named, "exact")
    # attention called twice a layer, counted on the meta device: refused before any data
    for name in ("diffllama", "longcat_flash"):
        assert exact[name].startswith("refused: ") and "call the attention function 2 times" in exact[name]


def table() -> str:
    """The manual's table: every model type, its decision and why."""
    outcomes = [outcome(model_type) for model_type in TYPES]
    exact = sum(found.status == "exact" for found in outcomes)
    lines = [
        f"{exact} of {len(outcomes)} causal-LM families of transformers {transformers.__version__} pack exactly; "
        f"{len(outcomes) - exact} are refused before any data is prepared.",
        "",
        "| model type | class | packed | what packing follows, or why it is refused |",
        "|---|---|---|---|",
    ]
    for found in outcomes:
        if found.status == "refused":
            why = found.detail.partition("exactly: ")[2].partition(". Choose a model")[0]
        else:
            why = ", ".join(found.features) or "causal attention"
        lines.append(f"| `{found.model_type}` | `{found.architecture}` | {found.status} | {why} |")
    return "\n".join(lines) + "\n"


def test_the_manual_s_table_is_this_run_s():
    text = TABLE.read_text()
    begin, end = "<!-- families table: begin -->\n", "<!-- families table: end -->"
    head, _, rest = text.partition(begin)
    current, _, tail = rest.partition(end)
    if os.environ.get("LONGALIGN_WRITE_FAMILIES"):
        TABLE.write_text(head + begin + table() + end + tail)
    assert current == table(), f"run LONGALIGN_WRITE_FAMILIES=1 pytest {__file__} to rewrite the table"


# The families packing needed work for, each through one plain SGD step of the real run.
STEPPED = [
    "llama4_text",
    "gemma2",
    "gpt_oss",
    "granite",
    "cohere2",
    "qwen3_moe",
    "qwen3_next",
    "qwen3_5_text",
]
# Float32 runs (the experts' default kernels have no float64 CPU path): the update, norm-relative.
UPDATE_BOUND = 1e-4


def _samples() -> list[tuple[list[int], list[int]]]:
    generator = torch.Generator().manual_seed(2)
    samples = []
    for length in LENGTHS:
        ids = torch.randint(FIRST_SAFE_ID, VOCAB, (length,), generator=generator).tolist()
        samples.append((ids, [-100, *ids[1:]]))  # every next token a target; the first has no context
    return samples


def expected_update(model: torch.nn.Module, samples) -> dict[str, torch.Tensor]:
    """Minus the gradient of the token-level loss over the samples, each alone through the eager model,
    plus the router loss of the pack (its tokens' router logits, as transformers' own loss takes them)."""
    targets = sum(len(ids) - 1 for ids, _ in samples)
    coef = model.config.router_aux_loss_coef if getattr(model.config, "output_router_logits", False) else 0.0
    total, routers = 0.0, []
    for ids, _ in samples:
        out = model(input_ids=torch.tensor([ids]), use_cache=False, output_router_logits=bool(coef))
        total = total + _loss(out.logits, torch.tensor([ids])) / targets
        routers.append(out.router_logits if coef else None)
    if coef:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

        layers = [torch.cat(per_layer, dim=0) for per_layer in zip(*routers, strict=True)]
        total = total + coef * load_balancing_loss_func(
            tuple(layers), model.config.num_experts, model.config.num_experts_per_tok
        )
    total.backward()
    return {name: -p.grad for name, p in model.named_parameters() if p.grad is not None}


def run_one_step(
    model_type: str, tmp_path: Path, lora: str = "", training: str = ""
) -> tuple[torch.nn.Module, list]:
    """One plain SGD step (learning rate 1) of ``longalign train`` on one pack of the samples, from a tiny
    random base of ``model_type`` saved in ``tmp_path / "base"``, with ``[lora]`` settings and more
    ``[training]`` lines if given; the base (eager attention) and the samples."""
    from conftest import TOKENIZER, save_packs

    from longalign.cli import main

    config = tiny_config(model_type)
    if model_type == "qwen3_moe":
        config.output_router_logits, config.router_aux_loss_coef = True, 0.5
    torch.manual_seed(0)
    build(config).float().save_pretrained(tmp_path / "base")
    samples = _samples()
    packs = save_packs(tmp_path / "packs", [pack_row(samples)])
    run_file = tmp_path / "run.toml"
    run_file.write_text(
        f"[data]\ntrain_file = '{packs}'\nmax_seq_len = {sum(LENGTHS)}\n[loss]\nweighting = 'token_level'\n"
        f"[training]\noutput_dir = '{tmp_path / 'run'}'\nmax_steps = 1\nlearning_rate = 1.0\noptim = 'sgd'\n"
        "lr_scheduler_type = 'constant'\nmax_grad_norm = 0.0\nweight_decay = 0.0\nuse_cpu = true\n"
        f"save_strategy = 'no'\nlogging_steps = 1\nreport_to = 'none'\ndisable_tqdm = true\n{training}\n"
        f"[model]\nmodel_name_or_path = '{tmp_path / 'base'}'\ntokenizer = '{TOKENIZER}'\n"
        "torch_dtype = 'float32'\nattn_backend = 'sdpa_segments'\n" + (f"[lora]\n{lora}\n" if lora else "")
    )
    assert main(["train", "--config", str(run_file)]) == 0
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="eager")
    return base, samples


def relative_update(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    names = sorted(want)
    assert names and set(got) >= set(names), sorted(set(names) - set(got))
    return relative(
        torch.cat([got[name].detach().double().flatten() for name in names]),
        torch.cat([want[name].double().flatten() for name in names]),
    )


@pytest.mark.integration
@pytest.mark.parametrize("model_type", STEPPED)
def test_one_sgd_step_of_the_run_equals_the_family_s_own_model_on_each_sample_alone(model_type, tmp_path):
    before, samples = run_one_step(model_type, tmp_path)
    # The saved weights with the base's config: the run's saved config names the tokenizer's special tokens.
    after = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run", config=before.config)
    got = {name: p - before.get_parameter(name) for name, p in after.named_parameters()}
    error = relative_update(got, expected_update(before.train(), samples))
    assert error < UPDATE_BOUND, f"{model_type}: the update is {error:.1e} off"


# Sequence tiling under activation checkpointing with its inputs offloaded, by layer: a dense family, a
# mixture of experts with its router loss, sandwich norms, attention sinks (with a sliding window), linear
# attention (its token mixer run whole); by MLP: the mixture of experts, its routers trained through the tiles.
TILED_STEPS = [
    ("layer", "llama"),
    ("layer", "qwen3_moe"),
    ("layer", "gemma3_text"),
    ("layer", "gpt_oss"),
    ("layer", "qwen3_next"),
    ("mlp", "qwen3_moe"),
]


@pytest.mark.integration
@pytest.mark.parametrize("tiling, model_type", TILED_STEPS)
def test_one_sgd_step_with_tiling_checkpointed_and_offloaded_is_the_family_s_own(
    tiling, model_type, tmp_path
):
    settings = (
        f"sequence_tiling = '{tiling}'\nmlp_tile_tokens = {LAYER_TILE_TOKENS if tiling == 'layer' else 16}\n"
    )
    settings += "activation_checkpointing = true\noffload_activations = true\n"
    before, samples = run_one_step(model_type, tmp_path, training=settings)
    after = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run", config=before.config)
    got = {name: p - before.get_parameter(name) for name, p in after.named_parameters()}
    want = expected_update(before.train(), samples)
    if model_type == "qwen3_moe":
        assert any(".gate." in name and want[name].abs().max() > 0 for name in want)  # the routers trained
    error = relative_update(got, want)
    assert error < UPDATE_BOUND, f"{tiling} tiling, {model_type}: the update is {error:.1e} off"


@pytest.mark.integration
def test_one_lora_step_on_a_mixture_of_experts_equals_its_own_model_on_each_sample_alone(tmp_path):
    """Adapters on Qwen3-MoE's attention, router and experts, with the router loss: the step's update of
    every adapter is the gradient of the model's own loss on each sample alone. peft starts each B at zero,
    where A gets no gradient: the trained adapter with its B set back to zero is the one the step began at."""
    from peft import PeftModel

    before, samples = run_one_step("qwen3_moe", tmp_path, lora="r = 4\nalpha = 8.0")
    adapted = PeftModel.from_pretrained(before, tmp_path / "run", is_trainable=True)
    trained = {name: p.detach().clone() for name, p in adapted.named_parameters() if p.requires_grad}
    assert any(".experts." in name for name in trained) and any(".gate." in name for name in trained)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.zero_()
    want = expected_update(adapted.train(), samples)
    assert all("lora_B" in name for name in want if want[name].abs().max() > 0)  # A: no gradient at B = 0
    got = {name: trained[name] - (0 if "lora_B" in name else trained[name]) for name in trained}
    error = relative_update(got, want)
    assert error < UPDATE_BOUND, f"the adapters' update is {error:.1e} off"


def test_a_refusal_is_one_line_from_the_dry_run_before_any_data_is_prepared(tmp_path, capsys):
    from conftest import DEMO, SAMPLE

    from longalign.cli import main

    gpt2 = '{model_type = "gpt2", vocab_size = 4096, n_layer = 1, n_embd = 16, n_head = 2}'
    status = main(
        ["train", "--dry-run", "--config", str(DEMO), f"model.init_from_config={gpt2}"]
        + [f"data.train_file='{SAMPLE}'", f"training.output_dir='{tmp_path / 'run'}'"]
    )
    error = capsys.readouterr().err.strip()
    assert status == 2 and len(error.splitlines()) == 1
    assert "GPT2LMHeadModel (model type 'gpt2') cannot train on packed samples exactly" in error
    assert "no rotary position embedding" in error
    assert not (tmp_path / "run").exists()

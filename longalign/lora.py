"""LoRA and QLoRA adapters from peft on a patched model, the adapted LM head for the chunked loss, and merging.

A run with a ``[lora]`` section trains adapters on a frozen base instead of every weight::

    model = longalign.patch.apply(AutoModelForCausalLM.from_pretrained(name))   # varlen attention first
    model = add_adapters(model, cfg.lora, base_model=name)                       # a peft.PeftModel
    ...                                          # checkpoints hold the adapter in peft's format
    merge_adapter("out/run", "out/merged")       # base + adapter -> one model for from_pretrained

What trains for Llama 3 with ``r = 16`` and ``trainable = ["embeddings", "norms"]`` (LongLoRA's recipe)::

    model.embed_tokens                       trained whole (a copy: peft's modules_to_save)
    model.layers.N.*_layernorm, model.norm   trained whole
    model.layers.N.self_attn.{q,k,v,o}_proj  frozen W + B A * alpha / r    A [16, in], B [out, 16]
    model.layers.N.mlp.{gate,up,down}_proj   frozen W + B A * alpha / r
    lm_head                                  frozen

Packing, weighting and the chunked loss are untouched by adapters: the patch runs before peft wraps the
model, peft's layers pass the batch's keyword arguments through, and :func:`adapted_head` keeps the loss
contract of ``longalign.loss`` for a head that peft wrapped.
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import peft
import torch
from peft.tuners.lora import Linear as LoraLinear
from peft.utils import ModulesToSaveWrapper
from torch import nn
from transformers import AutoTokenizer, BitsAndBytesConfig

from longalign import checkpoints
from longalign.artifacts import stage_output
from longalign.chatglm_layout import CHATGLM, NATIVE, RECORD_KEY
from longalign.config import LoraConfig
from longalign.errors import ConfigError, ModelError, PathError
from longalign.loss import LinearInputs, linear_head
from longalign.patch import check_model

# Every attention and MLP projection of a family (GLM fuses gate and up into one layer).
TARGET_MODULES = {
    "Llama 3": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    "GLM": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"),
    "GLM-4": ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"),
}
# Other decoders: every linear layer except the output layer, as peft resolves this name.
GENERIC_TARGETS = "all-linear"
# Names ``[lora] trainable`` takes for whole modules by role, whatever the family calls them.
TRAINABLE_GROUPS = ("embeddings", "norms", "lm_head")
ADAPTER_NAME = "default"  # peft's name for a model's one adapter
BASE_MODEL_DIR = "base_model"  # in output_dir: a random init_from_config base, for merge


def target_modules(model: nn.Module, names: list[str] | None) -> list[str] | str:
    """The layers that get adapters: ``names`` (each must end the name of a linear layer), or by default
    every attention and MLP projection of the model's family (``"all-linear"`` for other decoders)::

        target_modules(llama, None)     ->  ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        target_modules(mistral, None)   ->  "all-linear"
        target_modules(llama, ["qproj"])    ConfigError: 'qproj' names no linear layer ... (its linear layers: ...)
    """
    if names is None:
        family = check_model(model)
        return list(TARGET_MODULES[family]) if family in TARGET_MODULES else GENERIC_TARGETS
    linear = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    for name in names:
        if not any(_names_module(name, full) for full in linear):
            leaves = sorted({full.rsplit(".", 1)[-1] for full in linear})
            raise ConfigError(
                f"lora.target_modules: {name!r} names no linear layer of {type(model).__name__} "
                f"(its linear layers: {', '.join(leaves)})"
            )
    return list(names)


def trainable_modules(model: nn.Module, names: list[str]) -> list[str]:
    """Full names of the modules ``[lora] trainable`` trains whole, next to the adapters.

    ``"embeddings"`` is the input embedding, ``"norms"`` every normalisation layer (a class whose name
    ends in ``Norm``), ``"lm_head"`` the output layer; any other entry ends module names, as in
    ``target_modules``::

        ["embeddings", "norms"]  ->  ["model.embed_tokens", "model.layers.0.input_layernorm", ..., "model.norm"]
    """
    module_names = {module: name for name, module in model.named_modules()}
    out: list[str] = []
    for entry in names:
        if entry == "embeddings":
            found = [module_names[model.get_input_embeddings()]]
        elif entry == "lm_head":
            found = [module_names[model.get_output_embeddings()]]
        elif entry == "norms":
            found = [name for name, module in model.named_modules() if type(module).__name__.endswith("Norm")]
        else:
            found = [name for name in module_names.values() if name and _names_module(entry, name)]
        if not found:
            raise ConfigError(
                f"lora.trainable: {entry!r} names no module of {type(model).__name__} "
                f"(use {', '.join(TRAINABLE_GROUPS)}, or module names)"
            )
        out += [name for name in found if name not in out]
    return out


def _names_module(entry: str, name: str) -> bool:
    """Whether ``entry`` names the module ``name`` the way peft matches: the whole name, or its end."""
    return name == entry or name.endswith("." + entry)


def peft_config(model: nn.Module, settings: LoraConfig) -> peft.LoraConfig:
    """peft's ``LoraConfig`` for ``[lora]`` on ``model`` (the family's targets, the trainable modules)."""
    targets = target_modules(model, settings.target_modules)
    trainable = trainable_modules(model, settings.trainable)
    output_layer = model.get_output_embeddings()
    for name in trainable:
        module = model.get_submodule(name)
        adapted = (
            isinstance(module, nn.Linear) and module is not output_layer
            if targets == GENERIC_TARGETS
            else any(_names_module(target, name) for target in targets)
        )
        if adapted:
            raise ConfigError(
                f"lora.trainable: {name} also gets an adapter (lora.target_modules); train it one way"
            )
    module_names = {module: name for name, module in model.named_modules()}
    embeddings = {module_names[model.get_input_embeddings()], module_names[output_layer]}
    tied = model.config.get_text_config().tie_word_embeddings and bool(embeddings & set(trainable))
    return peft.LoraConfig(
        task_type="CAUSAL_LM",
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=targets,
        modules_to_save=trainable or None,
        # A trained copy of one of two tied matrices must stay tied to the other (input and output).
        ensure_weight_tying=tied,
    )


def add_adapters(model: nn.Module, settings: LoraConfig, *, base_model: str) -> peft.PeftModel:
    """``model`` (already patched) with ``[lora]``'s adapters; everything else frozen.

    ``base_model`` is what merging loads under the adapter (a hub name or a directory); it is written
    into every saved ``adapter_config.json``.
    """
    config = peft_config(model, settings)
    with warnings.catch_warnings():
        # peft reads transformers' deprecated is_gradient_checkpointing: a note for peft, not for our users.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        adapted = peft.get_peft_model(model, config)
    adapted.peft_config[ADAPTER_NAME].base_model_name_or_path = base_model
    if not any(param.requires_grad for param in adapted.get_input_embeddings().parameters()):
        # Reentrant activation checkpointing backpropagates into a layer only when its input needs a
        # gradient; with frozen embeddings nothing before the first layer does.
        model.enable_input_require_grads()
    return adapted


# Where bitsandbytes quantizes and trains: CUDA, and CPU through its CPU backend (NF4 with double
# quantization and int8, forward and backward, checked on bitsandbytes 0.50.2). Other devices are unchecked.
QUANTIZING_DEVICES = ("cuda", "cpu")


def quantization_problem(settings: LoraConfig | None, device: torch.device) -> str | None:
    """Why ``[lora]``'s 4- or 8-bit base cannot load on ``device``, as ``key: reason``; ``None`` when it can."""
    if settings is None or not (settings.load_in_4bit or settings.load_in_8bit):
        return None
    key = "lora.load_in_4bit" if settings.load_in_4bit else "lora.load_in_8bit"
    if device.type not in QUANTIZING_DEVICES:
        return f"{key}: bitsandbytes quantizes on CUDA and CPU here; this run is on {device}"
    if importlib.util.find_spec("bitsandbytes") is None:
        return f"{key}: needs bitsandbytes: pip install 'longalign[qlora]'"
    return None


def try_quantized_layer(settings: LoraConfig, device: torch.device) -> None:
    """Quantize a 64 x 64 layer as ``[lora]`` asks and run it forward and backward on ``device``.

    Raises what bitsandbytes raises where its backend for the device is missing or broken; the preflight
    runs it on every rank before any weight loads.
    """
    import bitsandbytes as bnb

    generator = torch.Generator().manual_seed(0)  # the run's own random state stays untouched
    weight = torch.randn(64, 64, generator=generator)
    if settings.load_in_4bit:
        layer = bnb.nn.Linear4bit(64, 64, bias=False, compute_dtype=torch.float32, quant_type="nf4")
        layer.weight = bnb.nn.Params4bit(
            weight, requires_grad=False, compress_statistics=True, quant_type="nf4"
        )
    else:
        layer = bnb.nn.Linear8bitLt(64, 64, bias=False, has_fp16_weights=False)
        layer.weight = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False)
    inputs = torch.randn(2, 64, generator=generator).to(device).requires_grad_()
    layer.to(device)(inputs).sum().backward()
    if not torch.isfinite(inputs.grad).all():
        raise RuntimeError("a quantized layer gave a non-finite gradient")


def quantization(settings: LoraConfig | None, *, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """``from_pretrained`` keyword arguments that load the frozen base in 4 or 8 bits (QLoRA), or none.

    4-bit is NF4 with double quantization and ``dtype`` as the compute dtype (the QLoRA recipe). The
    layers bitsandbytes leaves alone (embeddings, norms, the LM head) stay in ``dtype``: peft's
    ``prepare_model_for_kbit_training`` would upcast them to float32, which at 64k tokens doubles the
    checkpointed residual stream. bitsandbytes runs on CUDA and, with its CPU backend, on CPU.
    """
    if settings is None or not (settings.load_in_4bit or settings.load_in_8bit):
        return {}
    problem = quantization_problem(settings, device)
    if problem is not None:
        raise ConfigError(problem)
    if settings.load_in_4bit:
        config = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        )
    else:
        config = BitsAndBytesConfig(load_in_8bit=True)
    # Quantized weights are made on the device as they load: each rank loads onto its own device.
    return {"quantization_config": config, "device_map": {"": device}}


def save_base(model: nn.Module, output_dir: str | Path) -> str:
    """Write a random base (``init_from_config``) to ``output_dir/base_model``; return its absolute path.

    The adapters only make sense on the weights they were trained with: merging loads this copy, and
    ``adapter_config.json`` names it. Rewritten on every start (a resume rebuilds the same weights from
    the same seed).
    """
    target = (Path(output_dir) / BASE_MODEL_DIR).resolve()
    with stage_output(target, stage="base model") as staging:
        model.save_pretrained(staging)
    return str(target)


def adapter_saver(
    base_model: str, save_format: str, *, trust_remote_code: bool = False
) -> Callable[[nn.Module, Path, Mapping[str, torch.Tensor] | None], None] | None:
    """How a ``[lora]`` run writes its final adapter on a ChatGLM-layout base: peft's files, with that
    layout's names (``chatglm_layout.adapter_to_chatglm``) and the base's tokenizer files; ``None`` otherwise.
    """
    checkpoint = checkpoints.find_checkpoint(base_model, trust_remote_code=trust_remote_code)
    if save_format == NATIVE or checkpoint.layout != CHATGLM:
        return None

    def save(model: nn.Module, output_dir: Path, state: Mapping[str, torch.Tensor] | None) -> None:
        # peft would read the base's config.json as the native class's to see whether the vocabulary was
        # resized; for this layout it reads defaults. Trained embeddings are saved as modules_to_save anyway.
        model.save_pretrained(output_dir, state_dict=state, save_embedding_layers=False)
        checkpoints.rewrite_adapter(output_dir, checkpoint.config, to=CHATGLM)
        checkpoints.copy_tokenizer_files(checkpoint.path, output_dir)

    return save


def adapted_head(head: nn.Module) -> Callable[[torch.Tensor], LinearInputs]:
    """The loss's :data:`~longalign.loss.HeadReader` for a model with adapters: ``hidden -> (hidden', weight,
    bias)`` with ``head(hidden) == hidden' @ weight^T + bias``; raises ``ModelError`` for a wrapping the
    chunked loss cannot follow.

    A head left alone is read as the ``torch.nn.Linear`` it is. A trained copy (``modules_to_save``) is read as its copy. A LoRA adapter on the head,
    ``x W^T + b + s * dropout(x) A^T B^T`` with ``s = alpha / r``, is one linear map over hidden states
    widened by the adapter's ``r`` inputs. Built inside the head's own call on every step, so the
    adapter's gradient flows through the loss's backward, dropout included::

        hidden'  [x | s * dropout(x) A^T]      [T, H + r]
        weight   [W | B]                       [V, H + r]
    """
    if type(head) is nn.Linear:
        return linear_head(head)
    if isinstance(head, ModulesToSaveWrapper):
        active = head.active_adapters
        layer = (
            head.original_module if head.disable_adapters or not active else head.modules_to_save[active[0]]
        )
        if type(layer) is not nn.Linear:
            raise ModelError(
                f"output layer is a trained copy of {type(layer).__name__}, not a torch.nn.Linear"
            )
        return lambda hidden: (hidden, layer.weight, layer.bias)
    if not isinstance(head, LoraLinear):
        raise ModelError(
            f"output layer is peft's {type(head).__name__}, which the chunked loss does not read"
        )
    base = head.get_base_layer()
    if type(base) is not nn.Linear:
        raise ModelError(f"output layer is a LoRA adapter on {type(base).__name__}, not on a torch.nn.Linear")
    active = [name for name in head.active_adapters if name in head.lora_A]
    if head.merged or head.disable_adapters or not active:
        return lambda hidden: (hidden, base.weight, base.bias)
    if len(active) > 1 or active[0] in head.lora_variant or head.lora_bias[active[0]] or head.fan_in_fan_out:
        raise ModelError(
            "output layer has a LoRA adapter the chunked loss does not fold in (several active adapters, "
            "DoRA or another variant, or an adapter bias); plain LoRA on the head is supported"
        )
    name = active[0]

    def as_linear(hidden: torch.Tensor) -> LinearInputs:
        down = head.lora_A[name]
        inputs = down(head.lora_dropout[name](hidden.to(down.weight.dtype))) * head.scaling[name]
        up = head.lora_B[name].weight
        weight = torch.cat([base.weight, up.to(base.weight.dtype)], dim=1)
        return torch.cat([hidden, inputs.to(hidden.dtype)], dim=-1), weight, base.bias

    return as_linear


def merge_adapter(
    adapter_dir: str | Path, output_dir: str | Path, *, base_model: str | None = None, dtype: str = "auto"
) -> Path:
    """Fold the adapter saved in ``adapter_dir`` into its base; write the full model (and tokenizer).

    The base is ``base_model``, else the one ``adapter_config.json`` names: the hub model or directory
    the run started from, or for a random ``init_from_config`` base the copy the run saved as
    ``output_dir/base_model``. The base is built with the run's ``config_overrides`` (RoPE past its
    window), which the run noted next to the adapter, so the merged model carries them. A QLoRA adapter
    merges into the base in ``dtype``, unquantized. The output follows the rules of every stage's
    ``--output``; the result loads with ``AutoModelForCausalLM.from_pretrained``, or for a ChatGLM-layout
    base is written in that layout (its config, tokenizer and code files copied), whichever layout the
    adapter was saved in, unless the overrides are more than that layout holds (YaRN, trained with
    ``model.save_format = "native"``).
    """
    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_config.json").is_file():
        raise PathError(
            f"{adapter_dir}: no adapter_config.json; expected a checkpoint or output of a [lora] run"
        )
    base = base_model or peft.PeftConfig.from_pretrained(str(adapter_dir)).base_model_name_or_path
    if not base:
        raise ConfigError(f"{adapter_dir}: its adapter_config.json names no base model; pass --base")
    if Path(base).is_absolute() and not Path(base).is_dir():
        raise PathError(f"{adapter_dir}: its base model {base} is not there (moved?); pass --base")
    checkpoint = checkpoints.find_checkpoint(base)
    with (
        stage_output(output_dir, stage="merge", inputs=[adapter_dir]) as staging,
        tempfile.TemporaryDirectory() as tmp,
    ):
        config = checkpoints.adapter_base_config(adapter_dir, base)  # the run's config_overrides, if any
        model = checkpoints.load_model(
            base, config=config, dtype=dtype if dtype == "auto" else getattr(torch, dtype)
        )
        adapter = str(adapter_dir)
        if checkpoints.is_chatglm_adapter(adapter_dir):  # peft loads it onto GlmForCausalLM's names
            for name in ("adapter_model.safetensors", "adapter_config.json"):
                shutil.copyfile(adapter_dir / name, Path(tmp) / name)
            checkpoints.rewrite_adapter(Path(tmp), checkpoint.config, to=NATIVE)
            adapter = tmp
        merged = peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()
        # The run switched the KV cache off for packed training; generation wants it back.
        merged.config.use_cache = True
        if checkpoint.layout == CHATGLM and getattr(merged.config, RECORD_KEY, None):
            checkpoints.save_chatglm(
                merged.state_dict(), staging, source=checkpoint.path, config=merged.config
            )
        else:
            merged.save_pretrained(staging)
            if (adapter_dir / "tokenizer_config.json").is_file():
                AutoTokenizer.from_pretrained(adapter_dir).save_pretrained(staging)
    return Path(output_dir)

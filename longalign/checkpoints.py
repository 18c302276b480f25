"""Model loading for every entry point: native transformers checkpoints, and GLM-4-9B's ChatGLM layout.

GLM-4-9B (glm-4-9b, glm-4-9b-chat, LongWriter-glm4-9b) ships for its own remote code: ``model_type =
"chatglm"``, fused weights, a tiktoken rank file. longalign never imports that code: it reads
``config.json`` as JSON, builds transformers' own ``GlmForCausalLM`` and renames the weights in memory::

    model = load_model("THUDM/glm-4-9b-chat", dtype=torch.bfloat16)   # GlmForCausalLM, no remote code run
    tokenizer = rank_file_tokenizer(path)                              # tokenizer.model -> fast BPE
    save_chatglm(model.state_dict(), "out/model", source=path)         # back in the layout it came in
    convert("THUDM/glm-4-9b-chat", "out/native")                       # offline, either way
    rewrite_adapter(adapter_dir, checkpoint.config, to=CHATGLM)        # a peft LoRA adapter, either way

The mapping itself, config keys and weight names both ways, is :mod:`longalign.chatglm_layout`'s; this
module finds the checkpoint, reads and writes its files, and builds the rank file's tokenizer.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from longalign.chatglm_layout import (
    CHATGLM,
    NATIVE,
    PEFT_PREFIX,
    RECORD_KEY,
    adapter_to_chatglm,
    adapter_to_native,
    chatglm_config,
    glm_config,
    native_weights,
    override_chatglm_config,
    to_chatglm,
)
from longalign.config import rope_warnings
from longalign.errors import ConfigError, ModelError, PathError, did_you_mean

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

# The special tokens that follow the ranks of a GLM-4 rank file, in id order.
GLM4_SPECIAL_TOKENS = (
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|begin_of_image|>",
    "<|end_of_image|>",
    "<|begin_of_video|>",
    "<|end_of_video|>",
)
# GLM-4's pre-tokenizer split (the cl100k one): contractions, letters, 1-3 digits, punctuation, whitespace.
GLM4_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
RANK_FILE = "tokenizer.model"

_WEIGHT_FILES = re.compile(r".*\.(safetensors|bin)$|.*\.(safetensors|bin)\.index\.json$")


@dataclass(frozen=True)
class Checkpoint:
    """A model named by the user: where it is on this machine and its ``config.json``, read as JSON."""

    name: str  # as the user wrote it
    path: Path | None  # the local directory (a Hub id through the local cache); None: not on this machine
    config: dict[str, Any] | None  # config.json; None when there is none here

    @property
    def layout(self) -> str:
        """``chatglm`` for GLM-4-9B's remote-code layout, else ``native``."""
        return CHATGLM if (self.config or {}).get("model_type") == CHATGLM else NATIVE


def find_checkpoint(name: str, *, trust_remote_code: bool = False) -> Checkpoint:
    """The checkpoint ``name`` (a directory, or a Hub id resolved through the local cache only).

    Refuses, before anything is imported, a checkpoint whose ``auto_map`` points to remote code longalign
    cannot map (see :func:`check_remote_code`).
    """
    path = local_dir(name)
    config = None
    if path is not None and (path / "config.json").is_file():
        config = _read_json(path / "config.json")
    checkpoint = Checkpoint(name, path, config)
    check_remote_code(checkpoint, trust_remote_code=trust_remote_code)
    return checkpoint


def local_dir(name: str) -> Path | None:
    """``name`` as a local directory: itself, or the cached snapshot of a Hub id; None when neither."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        return None
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(name, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        return None


def check_remote_code(checkpoint: Checkpoint, *, trust_remote_code: bool) -> None:
    """Refuse a checkpoint whose ``auto_map`` would run code with the weights, unless its layout maps.

    The ChatGLM layout maps onto ``GlmForCausalLM``. Other remote code is refused whenever it would be
    needed: its model type is unknown to transformers, or ``trust_remote_code`` asks for it.
    """
    config = checkpoint.config or {}
    auto_map = config.get("auto_map")
    model_type = config.get("model_type")
    if not auto_map or model_type == CHATGLM:
        return
    from transformers import CONFIG_MAPPING

    native = model_type in CONFIG_MAPPING
    if native and not trust_remote_code:
        return  # transformers uses its own class and ignores auto_map
    modules = sorted({str(entry).split(".")[0] for entry in _flatten(auto_map.values())})
    fix = (
        f"load it without trust_remote_code to use transformers' own {model_type!r} class"
        if native
        else "supported: transformers' own model types, and 'chatglm' (GLM-4-9B's layout, read as GlmForCausalLM)"
    )
    raise ModelError(
        f"{checkpoint.name}: config.json's auto_map points to remote code ({', '.join(modules)}) for model type "
        f"{model_type!r}, and longalign never runs a checkpoint's code; {fix}"
    )


def _flatten(values: Any) -> list[Any]:
    out = []
    for value in values:
        out += _flatten(value) if isinstance(value, list | tuple) else [value] if value else []
    return out


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise ModelError(f"{path}: not valid JSON ({err})") from None


# --- config overrides --------------------------------------------------------------------------------------

_ROPE_BASE_KEYS = ("rope_theta", "partial_rotary_factor")  # the pretrained weights', kept by a new rope_type
OVERRIDES_RECORD = "config_overrides.json"  # next to a [lora] run's adapter: the base's config_overrides


def override_config(
    config: PretrainedConfig, overrides: Mapping[str, Any], *, save_format: str = "auto"
) -> PretrainedConfig:
    """``config`` with ``[model] config_overrides`` applied: what the model is built, trained and saved with.

    A key replaces the checkpoint's value. RoPE keys keep their meaning whatever transformers stores them
    in (5.x keeps every RoPE setting in ``rope_parameters``, fills a table without ``rope_theta`` with
    10000, and ignores a top-level ``rope_theta`` when the table has one)::

        rope_theta = 1e6                                 rope_parameters.rope_theta = 1e6
        rope_parameters = { factor = 16.0 }              only factor changes
        rope_parameters = { rope_type = "yarn", factor = 4.0 }
            the checkpoint's scaling is replaced; its rope_theta and partial_rotary_factor stay (the
            pretrained weights were trained with them), original_max_position_embeddings is the
            checkpoint's max_position_embeddings unless given

    A RoPE key that no rope type has, one the type does not read, or a missing one it needs is an error
    (transformers only warns about the first two). A ChatGLM-layout checkpoint's recorded ``config.json``
    (see :func:`glm_config`) follows, for saving back: ``max_position_embeddings`` as ``seq_length``, plain
    RoPE's base as ``rope_ratio``; what the layout cannot hold (YaRN, another rotary share, ...) is refused,
    unless ``save_format`` is native, which drops the record and saves ``GlmForCausalLM`` instead.
    """
    plain = {
        key: value for key, value in overrides.items() if key not in ("rope_parameters", *_ROPE_BASE_KEYS)
    }
    settings = config.to_dict() | plain
    if overrides.keys() & {"rope_parameters", *_ROPE_BASE_KEYS}:
        settings["rope_parameters"] = _overridden_rope(config, overrides)
    # Built with the checkpoint's window first: transformers fills in what a RoPE type needs from
    # max_position_embeddings (a scaled RoPE's original window), and that must be the checkpoint's.
    settings["max_position_embeddings"] = config.max_position_embeddings
    with rope_warnings():  # said again below, where the window is the new one
        staged = _built(type(config), settings)
    window = plain.get("max_position_embeddings", config.max_position_embeddings)
    with rope_warnings() as warned:  # the whole config validated again, with its new window
        built = _built(type(config), staged.to_dict() | {"max_position_embeddings": window})
    if warned:
        raise ConfigError(f"model.config_overrides.rope_parameters: {warned[0]}")
    record = getattr(built, RECORD_KEY, None)
    if record:
        try:
            setattr(built, RECORD_KEY, override_chatglm_config(record, built, overrides))
        except ConfigError:
            if save_format != NATIVE:
                raise
            delattr(built, RECORD_KEY)  # saved as GlmForCausalLM; convert refuses what the layout cannot hold
    return built


def _overridden_rope(config: PretrainedConfig, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint's ``rope_parameters`` with the overrides' RoPE keys, as :func:`override_config` says."""
    from transformers.modeling_rope_utils import RopeParameters

    rope = json.loads(json.dumps(config.rope_parameters or {}))  # a deep copy
    layers = config.nested_rope_parameter_keys(rope)  # one table per layer type, or one for all
    tables = {layer: rope[layer] for layer in layers} if layers else {None: rope}
    new = overrides.get("rope_parameters")
    if new is not None:
        if not isinstance(new, Mapping):
            raise ConfigError(f"model.config_overrides.rope_parameters: expected a table, got {new!r}")
        by_layer = new if layers else {None: new}
        for layer, table in by_layer.items():
            where = "model.config_overrides.rope_parameters" + (f".{layer}" if layer else "")
            if layer not in tables or not isinstance(table, Mapping):
                raise ConfigError(
                    f"{where}: this checkpoint has one RoPE table per layer type ({', '.join(layers)}); "
                    "give a table for each one you change"
                )
            for key in table:
                if key not in RopeParameters.__annotations__:
                    known = list(RopeParameters.__annotations__)
                    raise ConfigError(f"{where}.{key}: not a RoPE setting{did_you_mean(key, known)}")
            old = tables[layer]
            if "rope_type" in table:  # a new scaling, on the checkpoint's base
                kept = {key: old[key] for key in _ROPE_BASE_KEYS if key in old and key not in table}
                tables[layer] = {**table, **kept}
            else:
                tables[layer] = {**old, **table}
    for key in _ROPE_BASE_KEYS:
        if key in overrides:
            for table in tables.values():
                table[key] = overrides[key]
    return tables if layers else tables[None]


def _built(cls: type[PretrainedConfig], settings: dict[str, Any]) -> PretrainedConfig:
    """``cls.from_dict(settings)``; what it refuses is an error about the overrides, in one line."""
    try:
        return cls.from_dict(settings)
    except (KeyError, ValueError, TypeError) as err:  # KeyError: a rope type without a key it needs
        text = err.args[0] if isinstance(err, KeyError) and err.args else err  # a KeyError's str is quoted
        raise ConfigError(f"model.config_overrides: {(str(text).strip().splitlines() or [''])[0]}") from None


def overrides_record(overrides: Mapping[str, Any], save_format: str) -> dict[str, Any]:
    """What a ``[lora]`` run writes as :data:`OVERRIDES_RECORD` next to each adapter it saves, so that merging
    and eval build the base as the run trained it (:func:`adapter_base_config`)."""
    return {"config_overrides": dict(overrides), "save_format": save_format}


def config_value(config: PretrainedConfig, key: str) -> Any:
    """The value of an override's ``key`` in ``config``: RoPE base keys are read from ``rope_parameters``."""
    if key in _ROPE_BASE_KEYS:
        rope = config.rope_parameters or {}
        layers = config.nested_rope_parameter_keys(rope)
        return {layer: rope[layer].get(key) for layer in layers} if layers else rope.get(key)
    return getattr(config, key, None)


def adapter_base_config(adapter_dir: Path, base: str) -> PretrainedConfig | None:
    """The config the adapter in ``adapter_dir`` was trained on: ``base``'s, with the overrides the run noted
    (:func:`overrides_record`); ``None`` when it noted none."""
    path = Path(adapter_dir) / OVERRIDES_RECORD
    if not path.is_file():
        return None
    record = _read_json(path)
    return override_config(model_config(base), record["config_overrides"], save_format=record["save_format"])


# --- weight files ------------------------------------------------------------------------------------------


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in ``path``: safetensors or ``.bin`` (``weights_only``), sharded or not."""
    from safetensors.torch import load_file

    for index_name, single in (
        ("model.safetensors.index.json", "model.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    ):
        index = path / index_name
        files = sorted(set(_read_json(index)["weight_map"].values())) if index.is_file() else [single]
        if all((path / file).is_file() for file in files):
            state: dict[str, torch.Tensor] = {}
            for file in files:
                if file.endswith(".safetensors"):
                    state.update(load_file(path / file))
                else:
                    state.update(torch.load(path / file, map_location="cpu", weights_only=True))
            return state
    raise PathError(f"{path}: no model.safetensors, pytorch_model.bin or their index.json")


def write_weights(state: Mapping[str, torch.Tensor], path: Path) -> None:
    """Write ``state`` as safetensors shards of at most 5 GB, with an index when there is more than one."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    split = split_torch_state_dict_into_shards(dict(state), max_shard_size="5GB")
    for file, keys in split.filename_to_tensors.items():
        save_file({key: state[key].contiguous() for key in keys}, path / file, metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (path / "model.safetensors.index.json").write_text(
            json.dumps(index, indent=2) + "\n", encoding="utf-8"
        )


# --- loading -----------------------------------------------------------------------------------------------


def model_config(name: str, *, trust_remote_code: bool = False) -> PretrainedConfig:
    """The transformers config of ``name``: ``GlmConfig`` for the ChatGLM layout, else ``AutoConfig``'s."""
    checkpoint = find_checkpoint(name, trust_remote_code=trust_remote_code)
    if checkpoint.layout == CHATGLM:
        return glm_config(checkpoint.config, f"{name}/config.json")
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)


def load_model(
    name: str,
    *,
    config: PretrainedConfig | None = None,
    dtype: torch.dtype | str = "auto",
    trust_remote_code: bool = False,
    **kwargs: Any,
) -> PreTrainedModel:
    """The causal LM at ``name``; a ChatGLM-layout checkpoint becomes ``GlmForCausalLM`` without its code.

    ``config`` is the one to build it with (:func:`model_config`'s, changed by :func:`override_config`);
    default: the checkpoint's own. ``kwargs`` go to ``from_pretrained`` (quantization, device map).
    """
    checkpoint = find_checkpoint(name, trust_remote_code=trust_remote_code)
    if checkpoint.layout == NATIVE:
        from transformers import AutoModelForCausalLM

        if "quantization_config" not in kwargs and _quant_method(checkpoint.config) == "mxfp4":
            # MXFP4 experts (gpt-oss as published) cannot train, and their kernels come from the hub: the weights
            # are dequantized to ``dtype`` as they load
            from transformers import Mxfp4Config

            kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
        return AutoModelForCausalLM.from_pretrained(
            name,
            **({"config": config} if config is not None else {}),
            dtype=dtype,
            trust_remote_code=trust_remote_code,
            **kwargs,
        )
    from transformers import GlmForCausalLM

    config = config or glm_config(checkpoint.config, f"{name}/config.json")
    state = native_weights(read_weights(checkpoint.path), checkpoint.config, config, name=name)
    return GlmForCausalLM.from_pretrained(None, config=config, state_dict=state, dtype=dtype, **kwargs)


def _quant_method(config: Mapping[str, Any] | None) -> str | None:
    """The ``quant_method`` of a checkpoint's ``config.json`` (``"mxfp4"``, ``"bitsandbytes"``...), or None."""
    quantization = (config or {}).get("quantization_config")
    return quantization.get("quant_method") if isinstance(quantization, Mapping) else None


def layout_note(name: str, *, trust_remote_code: bool = False, save_format: str = "auto") -> str | None:
    """One line for the run, the preflight and the probe when ``name`` is in the ChatGLM layout; else None.

    ``ChatGLM layout, read as GlmForCausalLM (weights renamed in memory, its code not run); saved back in
    the ChatGLM layout; trust_remote_code is not needed for it``
    """
    checkpoint = find_checkpoint(name, trust_remote_code=trust_remote_code)
    if checkpoint.layout != CHATGLM:
        return None
    saved = (
        "saved as GlmForCausalLM (model.save_format = native)"
        if save_format == NATIVE
        else "saved back in the ChatGLM layout"
    )
    note = f"ChatGLM layout, read as GlmForCausalLM (weights renamed in memory, its code not run); {saved}"
    return note + ("; trust_remote_code is not needed for it" if trust_remote_code else "")


# --- saving ------------------------------------------------------------------------------------------------


def save_chatglm(
    state: Mapping[str, torch.Tensor],
    output_dir: str | Path,
    *,
    source: Path | None,
    config: PretrainedConfig | None = None,
) -> None:
    """Write ``GlmForCausalLM`` weights in the ChatGLM layout.

    With ``source`` (the ChatGLM checkpoint the model came from) its ``config.json``, tokenizer files and
    ``.py`` files are copied unchanged, except a ``config.json`` that ``config`` changed (its
    ``config_overrides``, see :func:`override_config`); without ``source`` it is written from ``config``.
    """
    output = Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    write_weights(to_chatglm(state), output)
    if source is not None:
        for file in sorted(source.iterdir()):
            if file.is_file() and not _WEIGHT_FILES.fullmatch(file.name) and not file.name.startswith("."):
                shutil.copyfile(file, output / file.name)
    written = chatglm_config(config) if config is not None else None
    if written is not None and (source is None or written != _read_json(source / "config.json")):
        (output / "config.json").write_text(json.dumps(written, indent=2) + "\n", encoding="utf-8")


def layout_saver(
    name: str | None, save_format: str, *, trust_remote_code: bool = False
) -> Callable[[torch.nn.Module, Path, Mapping[str, torch.Tensor] | None], None] | None:
    """How a run writes its model when it does not save natively: ``save(model, output_dir, state_dict)``.

    ``None`` when the model came in natively, or ``model.save_format = "native"``.
    """
    if not name or save_format == NATIVE:
        return None
    checkpoint = find_checkpoint(name, trust_remote_code=trust_remote_code)
    if checkpoint.layout != CHATGLM:
        return None

    def save(model: torch.nn.Module, output_dir: Path, state: Mapping[str, torch.Tensor] | None) -> None:
        state = model.state_dict() if state is None else state
        save_chatglm(state, output_dir, source=checkpoint.path, config=model.config)

    return save


def convert(source: str, output_dir: str | Path, *, to: str | None = None, dtype: str = "auto") -> str:
    """Convert the checkpoint ``source`` to the other layout (or ``to``); returns the layout written.

    ChatGLM -> native writes ``GlmForCausalLM`` with ``tokenizer.json``; native -> ChatGLM writes the
    weights and ``config.json`` (the original when the native copy records it). Tensors are renamed and
    split or joined, never changed, unless ``dtype`` asks for a cast.
    """
    from longalign.artifacts import stage_output

    checkpoint = find_checkpoint(source)
    if checkpoint.path is None or checkpoint.config is None:
        raise PathError(
            f"{source}: no config.json there (a checkpoint directory, or a Hub id in the local cache)"
        )
    to = to or (NATIVE if checkpoint.layout == CHATGLM else CHATGLM)
    if to == checkpoint.layout:
        raise ConfigError(f"--to {to}: {source} is in the {to} layout already")
    state = read_weights(checkpoint.path)
    if dtype != "auto":
        state = {key: _cast(tensor, getattr(torch, dtype)) for key, tensor in state.items()}
    with stage_output(output_dir, stage="convert", inputs=[checkpoint.path]) as staging:
        if to == NATIVE:
            from transformers import GlmForCausalLM

            config = glm_config(checkpoint.config, f"{source}/config.json")
            if dtype != "auto":
                config.dtype = dtype
            model = GlmForCausalLM.from_pretrained(
                None, config=config, state_dict=native_weights(state, checkpoint.config, config, name=source)
            )
            model.save_pretrained(staging)
            if (checkpoint.path / RANK_FILE).is_file():
                rank_file_tokenizer(checkpoint.path).save_pretrained(staging)
        else:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(checkpoint.path)
            save_chatglm(state, staging, source=None, config=config)
            if dtype != "auto":
                _set_dtype(staging / "config.json", dtype)
    return to


def _cast(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def _set_dtype(path: Path, dtype: str) -> None:
    config = _read_json(path)
    config["torch_dtype"] = dtype
    path.write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


# --- adapters ----------------------------------------------------------------------------------------------


def is_chatglm_adapter(path: Path) -> bool:
    """Whether the peft adapter in ``path`` is written for the ChatGLM layout."""
    from safetensors import safe_open

    with safe_open(path / "adapter_model.safetensors", "pt") as file:
        return any(key.startswith(PEFT_PREFIX + "transformer.") for key in file.keys())


def rewrite_adapter(path: Path, chatglm: Mapping[str, Any], *, to: str) -> None:
    """Rewrite the peft adapter in ``path`` (``adapter_model.safetensors``, ``adapter_config.json``) for layout ``to``."""
    from safetensors.torch import load_file, save_file

    convert_adapter = adapter_to_chatglm if to == CHATGLM else adapter_to_native
    state, settings = convert_adapter(
        load_file(path / "adapter_model.safetensors"), _read_json(path / "adapter_config.json"), chatglm
    )
    save_file(
        {key: value.contiguous() for key, value in state.items()},
        path / "adapter_model.safetensors",
        metadata={"format": "pt"},
    )
    (path / "adapter_config.json").write_text(
        json.dumps(settings, indent=2, sort_keys=True) + "\n", encoding="utf-8"
    )


def copy_tokenizer_files(source: Path, output_dir: Path) -> None:
    """Copy the ChatGLM checkpoint's tokenizer files (rank file, its config, its remote class) unchanged."""
    for file in sorted(source.iterdir()):
        if file.is_file() and (file.name.startswith("tokeniz") or file.name == "special_tokens_map.json"):
            shutil.copyfile(file, output_dir / file.name)


# --- the tokenizer -----------------------------------------------------------------------------------------


def read_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken rank file: one ``base64-token rank`` per line -> ``{token bytes: rank}``."""
    ranks: dict[bytes, int] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise ModelError(
            f"{path}: not a tiktoken rank file (binary: a SentencePiece model, as ChatGLM2/3 ship, is not read)"
        ) from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise ModelError(
                f"{path} line {number}: expected 'base64-token rank', got {line[:60]!r}"
            ) from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ModelError(f"{path}: the ranks are not 0..{len(ranks) - 1}, each once")
    return ranks


def byte_alphabet() -> dict[int, str]:
    """Byte-level BPE's printable stand-in for each byte: printable Latin-1 bytes are themselves, the other
    68 become the characters from U+0100 on, in byte order (``b" "`` -> ``"Ġ"``, ``b"\\n"`` -> ``"Ċ"``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [byte for byte in range(256) if byte not in printable]
    return {
        **{byte: chr(byte) for byte in printable},
        **{byte: chr(256 + i) for i, byte in enumerate(others)},
    }


def bpe_from_ranks(ranks: Mapping[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The vocabulary and merges of a byte-level BPE that splits text as tiktoken does with ``ranks``.

    tiktoken joins, again and again, the adjacent pair whose concatenation has the lowest rank. So every
    split of a token into two tokens is a merge, ranked by the token it makes::

        ranks  {a: 0, b: 1, c: 2, ab: 3, abc: 4}  ->  merges  (a, b) for ab;  (ab, c) for abc

    Both pick the lowest rank first and the leftmost pair among equals; they could differ only where two
    different splits of one token overlap in a word (``x+y == y+z``), which the tests have not met.
    """
    alphabet = byte_alphabet()

    def text(token: bytes) -> str:
        return "".join(alphabet[byte] for byte in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                merges.append((rank, ranks[left], text(left), text(right)))
    merges.sort()
    return vocab, [(left, right) for _, _, left, right in merges]


def is_rank_file_tokenizer(path: Path) -> bool:
    """Whether ``path`` holds a ChatGLM tokenizer (``tokenizer.model`` with a remote ChatGLM tokenizer class)."""
    config_file = path / "tokenizer_config.json"
    if not (path / RANK_FILE).is_file() or not config_file.is_file():
        return False
    config = _read_json(config_file)
    remote = json.dumps(config.get("auto_map", {}))
    return str(config.get("tokenizer_class", "")).startswith("ChatGLM") or "tokenization_chatglm" in remote


def rank_file_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """GLM-4's tokenizer from its files alone: ``tokenizer.model`` ranks, 14 special tokens, the chat template.

    A fast byte-level BPE (``PreTrainedTokenizerFast``) whose ids equal tiktoken's on the same text; the
    special tokens take the ids after the ranks (``<|endoftext|>`` = the number of ranks), and eos and pad
    are ``tokenizer_config.json``'s, ``<|endoftext|>`` by default.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    vocab, merges = bpe_from_ranks(read_ranks(path / RANK_FILE))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(GLM4_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in GLM4_SPECIAL_TOKENS]
    )
    config = _read_json(path / "tokenizer_config.json")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((entry["template"] for entry in template if entry.get("name") == "default"), None)
    special = {
        key: config[key] if isinstance(config.get(key), str) else GLM4_SPECIAL_TOKENS[0]
        for key in ("eos_token", "pad_token")
    }
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=template,
        clean_up_tokenization_spaces=False,
        model_max_length=config.get("model_max_length", 131072),
        **special,
    )


def open_tokenizer(name: str, *, trust_remote_code: bool = False) -> PreTrainedTokenizerFast | None:
    """The ChatGLM tokenizer at ``name`` built from its rank file, or None when ``name`` is not one.

    Refuses first a checkpoint whose remote code longalign cannot map (:func:`check_remote_code`).
    """
    path = local_dir(name)
    if path is None:
        return None
    find_checkpoint(name, trust_remote_code=trust_remote_code)
    return rank_file_tokenizer(path) if is_rank_file_tokenizer(path) else None

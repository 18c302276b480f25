"""Run configuration: one dataclass per TOML section, ``section.key=value`` overrides, strict checking.

A run file looks like::

    [data]
    train_file = "out/packed"          # a pre-tokenized or a packed dataset directory
    max_seq_len = 65536

    [packing]
    strategy = "bfd"

    [loss]
    weighting = "sequence_level"

    [training]                         # any transformers.TrainingArguments field
    per_device_batch_size = 1
    gradient_accumulation_steps = 8
    learning_rate = 2e-5

    [model]
    model_name_or_path = "meta-llama/Llama-3.1-8B-Instruct"

An unknown section or key, or a value of the wrong type, is an error that names it.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

WEIGHTINGS = ("sequence_level", "token_level")
STRATEGIES = ("bfd", "ffd", "greedy", "sorted")


class ConfigError(ValueError):
    """A run configuration that cannot be used; the message names the key."""


@dataclass
class DataConfig:
    train_file: str = ""  # pre-tokenized dir (packed on the fly, cached) or packed dir (used as is)
    eval_file: str | None = None  # same kinds as train_file; eval loss uses the same weighting
    max_seq_len: int = 65536  # token budget of one pack
    packed_cache_dir: str | None = None  # where on-the-fly packs go; default: <output_dir>/packed


@dataclass
class PackingConfig:
    packing: bool = True  # false: one sample per row, no packing (the padding-free baseline)
    strategy: str = "bfd"  # bfd | ffd | greedy | sorted (LongAlign's sorted batching)
    sort_by_length: bool = False  # LongAlign's flag for sorted batching; same as strategy = "sorted"
    batch_size: int = 8  # samples per batch for the sorted strategy
    seed: int = 42  # pack order and sorted-batch shuffle
    drop_long: bool = False  # drop samples over max_seq_len instead of failing

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"packing.strategy: {self.strategy!r} is not one of {', '.join(STRATEGIES)}")
        if self.sort_by_length:
            if self.strategy not in ("bfd", "sorted"):
                raise ConfigError(
                    f"packing.sort_by_length = true means strategy 'sorted', but strategy is {self.strategy!r}"
                )
            self.strategy = "sorted"
        if self.batch_size < 1:
            raise ConfigError(f"packing.batch_size: must be >= 1, got {self.batch_size}")


@dataclass
class LossConfig:
    weighting: str = "sequence_level"  # sequence_level (LongAlign: samples equal) | token_level
    ignore_index: int = -100  # label value that is not a target
    chunk_size: int = 4096  # tokens per logits chunk; smaller saves memory, larger is faster

    def __post_init__(self) -> None:
        if self.weighting not in WEIGHTINGS:
            raise ConfigError(f"loss.weighting: {self.weighting!r} is not one of {', '.join(WEIGHTINGS)}")
        if self.chunk_size < 1:
            raise ConfigError(f"loss.chunk_size: must be >= 1, got {self.chunk_size}")


@dataclass
class ModelConfig:
    model_name_or_path: str = ""  # hub name or local directory
    init_from_config: dict[str, Any] | None = None  # random weights from this config (needs model_type)
    tokenizer: str | None = None  # defaults to model_name_or_path
    trust_remote_code: bool = False
    use_flash_attention: bool = True  # false: the exact per-sample sdpa path everywhere
    attn_backend: str = "auto"  # auto | flash_attn | flash_attn_cute | torch_varlen | sdpa_segments
    torch_dtype: str = "auto"  # auto | float32 | bfloat16 | float16

    def __post_init__(self) -> None:
        if not self.model_name_or_path and self.init_from_config is None:
            raise ConfigError("model: set model_name_or_path, or init_from_config for a random model")
        if self.init_from_config is not None and "model_type" not in self.init_from_config:
            raise ConfigError("model.init_from_config: needs a 'model_type' key (e.g. 'llama')")
        if self.torch_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"model.torch_dtype: {self.torch_dtype!r} is not auto/float32/bfloat16/float16")

    @property
    def backend(self) -> str:
        """The attention backend to request: ``use_flash_attention = false`` pins the CPU-exact path."""
        return self.attn_backend if self.use_flash_attention else "sdpa_segments"


# Names users already write for LongAlign-style runs, mapped onto TrainingArguments fields.
TRAINING_ALIASES = {
    "per_device_batch_size": "per_device_train_batch_size",
    "warmup_ratio": "warmup_steps",  # TrainingArguments reads a value below 1 as a fraction of all steps
}


@dataclass
class TrainingConfig:
    output_dir: str = "runs/longalign"
    preflight: bool | None = None  # run the multi-rank checks before the first step; default: when ranks > 1
    args: dict[str, Any] = field(default_factory=dict)  # every other key, for transformers.TrainingArguments

    @classmethod
    def from_table(cls, table: dict[str, Any]) -> TrainingConfig:
        known = {f.name for f in dataclasses.fields(cls)} - {"args"}
        own = {k: v for k, v in table.items() if k in known}
        args = {}
        for key, value in table.items():
            if key in known:
                continue
            name = TRAINING_ALIASES.get(key, key)
            _check_training_arg(name, value, key)
            args[name] = value
        _check_fields(cls, own, "training")
        return cls(**own, args=args)


@dataclass
class Config:
    data: DataConfig
    packing: PackingConfig
    loss: LossConfig
    training: TrainingConfig
    model: ModelConfig

    def to_dict(self) -> dict[str, Any]:
        """The config as plain TOML-able tables (training args flattened back into ``[training]``)."""
        out = {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}
        out["training"].update(out["training"].pop("args"))
        return out


SECTIONS = {
    "data": DataConfig,
    "packing": PackingConfig,
    "loss": LossConfig,
    "training": TrainingConfig,
    "model": ModelConfig,
}


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a TOML run file (or start empty) and apply ``section.key=value`` overrides, then check it all."""
    tables: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: config file not found")
        try:
            tables = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{path}: not valid TOML: {err}") from None
    for item in overrides:
        _apply_override(tables, item)
    unknown = [name for name in tables if name not in SECTIONS]
    if unknown:
        raise ConfigError(f"unknown section [{unknown[0]}]; sections are {', '.join(SECTIONS)}")
    for name, value in tables.items():
        if not isinstance(value, dict):
            raise ConfigError(f"{name}: expected a [{name}] table, got {type(value).__name__}")
    built = {}
    for name, cls in SECTIONS.items():
        table = tables.get(name, {})
        if cls is TrainingConfig:
            built[name] = TrainingConfig.from_table(table)
        else:
            _check_fields(cls, table, name)
            built[name] = cls(**table)
    return Config(**built)


def _apply_override(tables: dict[str, Any], item: str) -> None:
    """Apply one ``section.key=value`` override; the value is read as TOML, else taken as a string."""
    key, sep, raw = item.partition("=")
    if not sep or "." not in key:
        raise ConfigError(f"override {item!r}: expected section.key=value")
    section, _, name = key.strip().partition(".")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    table = tables.setdefault(section, {})
    if not isinstance(table, dict):
        raise ConfigError(f"override {item!r}: {section} is not a table")
    table[name] = value


def _check_fields(cls: type, table: dict[str, Any], section: str) -> None:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init and f.name != "args"]
    for key, value in table.items():
        if key not in names:
            raise ConfigError(f"{section}.{key}: unknown key{_suggest(key, names)}")
        if not _matches(value, hints[key]):
            raise ConfigError(
                f"{section}.{key}: expected {_describe(hints[key])}, got {type(value).__name__} {value!r}"
            )


def _check_training_arg(name: str, value: Any, written: str) -> None:
    from transformers import TrainingArguments

    fields = {f.name: f for f in dataclasses.fields(TrainingArguments) if f.init}
    if name not in fields:
        choices = list(fields) + list(TRAINING_ALIASES)
        raise ConfigError(
            f"training.{written}: unknown key (not a TrainingArguments field){_suggest(written, choices)}"
        )
    annotation = fields[name].type
    if isinstance(annotation, str):  # postponed annotations: check only what is simple to read
        annotation = {"int": int, "float": float, "bool": bool, "str": str}.get(annotation, Any)
    if not _matches(value, annotation, lenient=True):
        raise ConfigError(
            f"training.{written}: expected {_describe(annotation)}, got {type(value).__name__} {value!r}"
        )


def _matches(value: Any, annotation: Any, lenient: bool = False) -> bool:
    """Whether a TOML value fits a type hint; ``lenient`` accepts hints this checker cannot read."""
    if annotation is Any:
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg, lenient) for arg in typing.get_args(annotation))
    if origin is Literal:
        return value in typing.get_args(annotation)
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin in (list, tuple) or annotation in (list, tuple):
        return isinstance(value, list)
    if origin is dict or annotation is dict:
        return isinstance(value, dict)
    if isinstance(annotation, type) and issubclass(annotation, str):  # str enums: the value is checked later
        return isinstance(value, str)
    return lenient


def _describe(annotation: Any) -> str:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "nothing"
    return getattr(annotation, "__name__", str(annotation))


def _suggest(key: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(key, choices, n=1)
    return f"; did you mean {close[0]!r}?" if close else ""

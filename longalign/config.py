"""Run configuration: one dataclass per TOML section, ``section.key=value`` overrides, strict checking.

A run file looks like::

    [data]
    train_file = "chats.jsonl"         # raw chats (prepared and cached), or a tokenized or packed directory
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

    [lora]                             # optional: train LoRA adapters instead of every weight
    r = 16

    [eval_tasks]                       # optional: long-context scores while training
    needle = { lengths = [4096, 16384], depths = [0, 50, 100], every_steps = 200 }

Names that LongAlign-style run files use for a setting (``sort_by_length``, ``use_flash_attention``, ...)
are accepted as aliases of one canonical key each (``ALIASES``). The file is read first, then the command
line's overrides; within one of them, an alias and its canonical key that disagree are an error naming
both, and the command line wins over the file. An unknown section or key, or a value of the wrong type,
is an error that names it; a table's field is overridden as ``section.key.field=value`` (``eval_tasks.needle.
every_steps=50``). ``Config.sources`` says where every setting came from.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import sys
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from longalign.arguments import parse_length
from longalign.errors import ConfigError, InputError, did_you_mean

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

# The names a run file chooses from. The stages that act on them import them from here, so that the checker
# of a run file sits above the stages it describes and needs none of them.
BACKENDS = ("flash_attn", "flash_attn_cute", "torch_varlen", "sdpa_segments")  # longalign.attention
# How the loss counts (longalign.batching): every sample equally (LongAlign) or every target token equally,
# exactly over the whole step; then two references that reproduce what released code computes.
EXACT_WEIGHTINGS = ("sequence_level", "token_level")
WEIGHTINGS = (*EXACT_WEIGHTINGS, "pack_token_mean", "longwriter")
# The label of a token that is not a target (longalign.labels writes it, the loss skips it).
IGNORE_INDEX = -100
STRATEGIES = ("bfd", "ffd", "greedy", "sorted", "none")  # longalign.packing.pack
TRUNCATIONS = ("right", "left", "drop")  # longalign.tokenize: what becomes of a sample over max_seq_len
TORCH_DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")  # float64: CPU checks of identities
SEQUENCE_TILING = (
    "",
    "mlp",
    "layer",
)  # [training] sequence_tiling: off, the MLP alone, every token-wise part
# The needle grid's defaults, in the run file's [eval_tasks] and in `longalign eval needle`.
NEEDLE_LENGTHS = (1000, 2000, 4000, 8000)
NEEDLE_DEPTHS = (0, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100)
RULER_LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)  # [eval_tasks] ruler's and `longalign eval ruler`'s


@dataclass(frozen=True)
class Source:
    """One input of a run or of pre-tokenize, with how much of it a mix takes (at most one of three).

    A ``[[data.sources]]`` table of a run file, or a ``--input`` of pre-tokenize; ``longalign.sources``
    reads what it names.
    """

    path: str  # a raw file, a directory of them, a saved datasets directory, or a Hub dataset id
    split: str | None = None  # datasets and Hub datasets: which split (default "train")
    columns: Mapping[str, str] = field(default_factory=dict)  # our field name -> the source's
    weight: float | None = None  # share of the weighted part of the mix, relative to other weights
    num_samples: int | None = None  # exactly this many samples
    fraction: float | None = None  # this fraction of the source's samples

    def __post_init__(self) -> None:
        rules = [name for name in ("weight", "num_samples", "fraction") if getattr(self, name) is not None]
        if len(rules) > 1:
            raise InputError(
                f"{self.path}: set one of weight, num_samples and fraction, not {' and '.join(rules)}"
            )
        if self.weight is not None and self.weight <= 0:
            raise InputError(f"{self.path}: weight must be > 0, got {self.weight}")
        if self.num_samples is not None and self.num_samples < 0:
            raise InputError(f"{self.path}: num_samples must be >= 0, got {self.num_samples}")
        if self.fraction is not None and not 0 <= self.fraction <= 1:
            raise InputError(f"{self.path}: fraction must be between 0 and 1, got {self.fraction}")

    @property
    def rule(self) -> str | None:
        """How much the mix takes, as reports write it (``"fraction 0.5"``); ``None``: all of it."""
        for name in ("fraction", "num_samples", "weight"):
            if getattr(self, name) is not None:
                return f"{name} {getattr(self, name)}"
        return None

    @property
    def name(self) -> str:
        """How reports and errors name it: the path, with its split when one is set."""
        return f"{self.path}[{self.split}]" if self.split else self.path


@dataclass
class DataConfig:
    train_file: str = ""  # raw chats (file, directory, dataset, Hub id), or a tokenized or packed dir
    eval_file: str | None = None  # same kinds as train_file; eval loss uses the same weighting
    sources: list[dict[str, Any]] = field(default_factory=list)  # [[data.sources]]: a mix instead
    truncation: str | None = None  # raw data over max_seq_len: right (default) | left | drop
    num_proc: int = 1  # processes that pre-tokenize raw data
    max_seq_len: int = 65536  # token budget of one pack
    min_seq_len: int = 0  # samples with fewer tokens are dropped when packing (counted)
    max_seq_len_filter: int | None = None  # samples with more tokens are dropped, not truncated (counted)
    cache_dir: str | None = None  # where prepared data (tokenized, packed) goes; default: <output_dir>/data

    def __post_init__(self) -> None:
        if self.max_seq_len < 1:
            raise ConfigError(f"data.max_seq_len: must be >= 1, got {self.max_seq_len}")
        if self.truncation is not None and self.truncation not in TRUNCATIONS:
            raise ConfigError(f"data.truncation: {self.truncation!r} is not one of {', '.join(TRUNCATIONS)}")
        if self.max_seq_len_filter is not None and self.truncation not in (None, "drop"):
            raise ConfigError(
                f"data.truncation = {self.truncation!r} would cut the long samples that data.max_seq_len_filter "
                "drops; leave truncation unset (long samples are then dropped and counted)"
            )
        if self.num_proc < 1:
            raise ConfigError(f"data.num_proc: must be >= 1, got {self.num_proc}")
        if self.sources and self.train_file:
            raise ConfigError("data.sources and data.train_file: set one (sources is a mix of several)")
        self.train_sources()  # checks every [[data.sources]] table
        if self.min_seq_len < 0:
            raise ConfigError(f"data.min_seq_len: must be >= 0, got {self.min_seq_len}")
        if self.max_seq_len_filter is not None and not 1 <= self.max_seq_len_filter <= self.max_seq_len:
            raise ConfigError(
                f"data.max_seq_len_filter: must be between 1 and data.max_seq_len ({self.max_seq_len}), "
                f"got {self.max_seq_len_filter}"
            )

    @property
    def raw_truncation(self) -> str:
        """How pre-tokenize treats raw samples over max_seq_len: dropped when a length filter is set."""
        return self.truncation or ("drop" if self.max_seq_len_filter is not None else "right")

    def train_sources(self) -> list[Source]:
        """The training data as sources: ``[[data.sources]]``, or ``train_file`` alone."""
        if not self.sources:
            return [Source(self.train_file)] if self.train_file else []
        fields = [f.name for f in dataclasses.fields(Source)]
        out = []
        for i, table in enumerate(self.sources):
            where = f"data.sources[{i}]"
            if not isinstance(table, dict) or "path" not in table:
                raise ConfigError(f"{where}: a table with at least a path")
            for key, value in table.items():
                if key not in fields:
                    raise ConfigError(f"{where}.{key}: unknown key{did_you_mean(key, fields)}")
                hint = typing.get_type_hints(Source)[key]
                if not _matches(value, hint):
                    raise ConfigError(
                        f"{where}.{key}: expected {_describe(hint)}, got {type(value).__name__} {value!r}"
                    )
            try:
                out.append(Source(**table))
            except InputError as err:
                raise ConfigError(f"{where}: {err}") from None
        return out


@dataclass
class PackingConfig:
    strategy: str = "bfd"  # bfd | ffd | greedy | sorted (LongAlign's sorted batching) | none (no packing)
    # Order the samples by length before the strategy: with greedy, LongAlign's sort-and-group (next-fit over
    # the sorted samples); bfd, ffd and sorted sort anyway. With packing off (strategy none) or nothing said
    # about packing, the strategy becomes sorted.
    sort_by_length: bool = False
    batch_size: int = 8  # samples per batch for the sorted strategy
    seed: int = 42  # pack order and sorted-batch shuffle
    drop_long: bool = False  # drop samples over max_seq_len instead of failing
    pad_to_max: bool = False  # pad every pack to max_seq_len with a no-target filler (static shapes)
    attention_mask_type: str = "1d_varlen"  # the only mode: sample boundaries as cu_seqlens

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"packing.strategy: {self.strategy!r} is not one of {', '.join(STRATEGIES)}")
        if self.attention_mask_type != "1d_varlen":
            raise ConfigError(
                f'packing.attention_mask_type: {self.attention_mask_type!r} is not supported; only "1d_varlen": '
                "samples are kept apart by cu_seqlens in varlen attention, without a 2D mask of T x T entries"
            )
        if self.batch_size < 1:
            raise ConfigError(f"packing.batch_size: must be >= 1, got {self.batch_size}")
        if self.seed < 0:
            raise ConfigError(f"packing.seed: must be >= 0, got {self.seed}")


@dataclass
class LossConfig:
    weighting: str = (
        "sequence_level"  # sequence_level (LongAlign) | token_level | pack_token_mean | longwriter
    )
    chunk_size: int = 4096  # tokens per logits chunk; smaller saves memory, larger is faster
    longwriter_divisor: float = 30.0  # the constant of the longwriter reference loss

    def __post_init__(self) -> None:
        if self.weighting not in WEIGHTINGS:
            raise ConfigError(f"loss.weighting: {self.weighting!r} is not one of {', '.join(WEIGHTINGS)}")
        if self.chunk_size < 1:
            raise ConfigError(f"loss.chunk_size: must be >= 1, got {self.chunk_size}")
        if self.longwriter_divisor <= 0:
            raise ConfigError(f"loss.longwriter_divisor: must be > 0, got {self.longwriter_divisor}")


@dataclass
class ModelConfig:
    model_name_or_path: str = ""  # hub name or local directory
    init_from_config: dict[str, Any] | None = None  # random weights from this config (needs model_type)
    tokenizer: str | None = None  # defaults to model_name_or_path
    trust_remote_code: bool = False
    attn_backend: str = "auto"  # auto (the fastest that runs) | flash_attn | flash_attn_cute | ...
    torch_dtype: str = "auto"  # auto | float32 | bfloat16 | float16 | float64 (CPU checks of identities)
    save_format: str = "auto"  # auto: the layout the model was loaded in (ChatGLM stays ChatGLM) | native
    # Settings of the checkpoint's config changed before its weights load, and saved with the trained model:
    # RoPE past the checkpoint's window, e.g. { max_position_embeddings = 1048576, rope_parameters =
    # { rope_type = "yarn", factor = 8.0 } }, or a new rope_theta (longalign.checkpoints.override_config).
    config_overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.model_name_or_path and self.init_from_config is None:
            raise ConfigError("model: set model_name_or_path, or init_from_config for a random model")
        if self.init_from_config is not None:
            _check_model_settings(self.init_from_config)
            if self.config_overrides:
                raise ConfigError(
                    "model.config_overrides: changes a pretrained checkpoint's config; a random model takes "
                    "these settings in model.init_from_config"
                )
        if "model_type" in self.config_overrides:
            raise ConfigError("model.config_overrides.model_type: the checkpoint's model type cannot change")
        if self.attn_backend not in ("auto", *BACKENDS):
            raise ConfigError(
                f"model.attn_backend: {self.attn_backend!r} is not one of auto, {', '.join(BACKENDS)}"
            )
        if self.save_format not in ("auto", "native"):
            raise ConfigError(f"model.save_format: {self.save_format!r} is not one of auto, native")
        if self.torch_dtype not in TORCH_DTYPES:
            raise ConfigError(
                f"model.torch_dtype: {self.torch_dtype!r} is not one of {', '.join(TORCH_DTYPES)}"
            )


def check_config_overrides(overrides: Mapping[str, Any], model_type: str) -> None:
    """``config_overrides`` keys must mean something to the checkpoint's config (of ``model_type``): a typo
    is an error naming the key, as in ``init_from_config``."""
    # RoPE tables are checked against the checkpoint's own (checkpoints.override_config), not a default one.
    rest = {key: value for key, value in overrides.items() if key != "rope_parameters"}
    _check_model_settings({"model_type": model_type, **rest}, where="model.config_overrides")


@contextlib.contextmanager
def rope_warnings() -> Iterator[list[str]]:
    """What transformers' RoPE validation warns about while the block runs (it warns, we refuse)."""
    logger = logging.getLogger("transformers.modeling_rope_utils")
    caught: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            caught.append(record.getMessage())

    handler, level, propagate = Catch(logging.WARNING), logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)  # also when transformers' verbosity hides warnings
    logger.propagate = False  # said once, as the error
    try:
        yield caught
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def _check_model_settings(settings: Mapping[str, Any], where: str = "model.init_from_config") -> None:
    """``init_from_config`` keys must mean something to the model type's config: a typo is an error.

    A key that the config neither has as a field nor consumes (``rope_theta`` is folded into
    ``rope_parameters``) would be kept as a stray attribute and silently ignored by the model.
    """
    from transformers import CONFIG_MAPPING, AutoConfig

    if "model_type" not in settings:
        raise ConfigError(f"{where}: needs a 'model_type' key (e.g. 'llama')")
    # A deep copy: transformers fills defaults into the tables it is given (rope_parameters).
    rest = copy.deepcopy({key: value for key, value in settings.items() if key != "model_type"})
    if settings["model_type"] not in CONFIG_MAPPING:
        raise ConfigError(
            f"{where}.model_type: unknown model type {settings['model_type']!r}"
            + did_you_mean(str(settings["model_type"]), list(CONFIG_MAPPING))
        )
    try:
        # Its RoPE validated against the type's defaults, not the checkpoint's: what it warns is not said
        with rope_warnings():
            fresh = AutoConfig.for_model(settings["model_type"])
            built = AutoConfig.for_model(settings["model_type"], **rest)
    except (ValueError, TypeError, KeyError) as err:
        text = err.args[0] if isinstance(err, KeyError) and err.args else err  # a KeyError's str is quoted
        message = (str(text).strip().splitlines() or [type(err).__name__])[0]
        raise ConfigError(f"{where}: {message}") from None
    known = set(vars(fresh)) | set(fresh.attribute_map)
    for key in rest:
        if key in vars(built) and key not in known:
            raise ConfigError(
                f"{where}.{key}: not a field of {type(fresh).__name__}{did_you_mean(key, sorted(known))}"
            )


@dataclass
class LoraConfig:
    """``[lora]``: LoRA adapters (peft) on a frozen base; the section's absence means full fine-tuning."""

    r: int = 16  # rank of each adapter
    alpha: float = 32.0  # the adapter's output is scaled by alpha / r
    dropout: float = 0.0  # dropout on the adapters' input
    target_modules: list[str] | None = None  # default: every attention and MLP projection of the family
    # Whole modules trained (and saved) next to the adapters: "embeddings", "norms", "lm_head" or module
    # names. LongLoRA trains ["embeddings", "norms"] too when extending the context.
    trainable: list[str] = field(default_factory=list)
    load_in_4bit: bool = False  # QLoRA: the frozen base in 4-bit NF4 (bitsandbytes; CUDA or CPU)
    load_in_8bit: bool = False  # the frozen base in 8-bit (bitsandbytes; CUDA or CPU)

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ConfigError(f"lora.r: must be >= 1, got {self.r}")
        if self.alpha <= 0:
            raise ConfigError(f"lora.alpha: must be > 0, got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"lora.dropout: must be >= 0 and < 1, got {self.dropout}")
        for key in ("target_modules", "trainable"):
            names = getattr(self, key)
            if names is None:
                continue
            if key == "target_modules" and not names:
                raise ConfigError(
                    "lora.target_modules: an empty list adapts nothing; leave it out for the default"
                )
            bad = [name for name in names if not isinstance(name, str) or not name.strip(".")]
            if bad:
                raise ConfigError(f"lora.{key}: expected module names, got {bad[0]!r}")
            repeated = [name for name in names if names.count(name) > 1]
            if repeated:
                raise ConfigError(f"lora.{key}: {repeated[0]!r} is listed twice")
        if self.load_in_4bit and self.load_in_8bit:
            raise ConfigError("lora.load_in_4bit and lora.load_in_8bit: set one")


@dataclass
class TrainingConfig:
    output_dir: str = "runs/longalign"
    preflight: bool | None = None  # run the multi-rank checks before the first step; default: when ranks > 1
    resume_ignore_changes: bool = False  # resume although the data, packing or loss settings changed
    sequence_parallel_size: int = 1  # ranks each pack is split over (DeepSpeed Ulysses); 1 = off
    # Token-wise work run over the tokens in tiles, each recomputed in backward (exact): "mlp" each layer's
    # MLP, "layer" every part of each decoder layer but the attention kernel; "" off. (tiled_mlp = true: "mlp")
    sequence_tiling: str = ""
    mlp_tile_tokens: int = (
        0  # tokens per tile, either level; 0: the model's hidden size (ceil(tokens / hidden))
    )
    offload_activations: bool = False  # checkpointed layer inputs wait for backward in (pinned) host memory
    # The tiled layer keeps each layer's attention output and log-sum-exp from forward (offloaded with its
    # input), so its backward runs no attention forward
    keep_attention: bool = False
    activation_checkpointing_layers: int = 1  # checkpoint every n-th decoder layer (1: all of them)
    args: dict[str, Any] = field(default_factory=dict)  # every other key, for transformers.TrainingArguments

    def __post_init__(self) -> None:
        if self.sequence_parallel_size < 1:
            raise ConfigError(
                f"training.sequence_parallel_size: must be >= 1, got {self.sequence_parallel_size}"
            )
        if self.mlp_tile_tokens < 0:
            raise ConfigError(
                f"training.mlp_tile_tokens: must be >= 0 (0: the model's hidden size), got {self.mlp_tile_tokens}"
            )
        if self.sequence_tiling not in SEQUENCE_TILING:
            raise ConfigError(
                f"training.sequence_tiling: expected one of {', '.join(map(repr, SEQUENCE_TILING))} ('' is off), "
                f"got {self.sequence_tiling!r}"
            )
        if self.mlp_tile_tokens and not self.sequence_tiling:
            raise ConfigError(
                f"training.mlp_tile_tokens = {self.mlp_tile_tokens} sizes the tiles of training.sequence_tiling, "
                'which is off; set training.sequence_tiling = "layer" (or "mlp")'
            )
        if self.keep_attention and not (self.sequence_tiling == "layer" and self.offload_activations):
            raise ConfigError(
                "training.keep_attention = true keeps each tiled layer's attention output in host memory with "
                'its offloaded input; set training.sequence_tiling = "layer" and training.offload_activations = true'
            )
        if self.activation_checkpointing_layers < 1:
            raise ConfigError(
                "training.activation_checkpointing_layers: must be >= 1 (checkpoint every n-th layer), got "
                f"{self.activation_checkpointing_layers}"
            )
        # transformers' own names for the two settings below: one key each, the longalign one.
        for key, ours in (
            ("every_n_layers", "activation_checkpointing_layers"),
            ("offload", "offload_activations"),
        ):
            for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
                if isinstance(self.args.get(name), dict) and key in self.args[name]:
                    raise ConfigError(f"training.{name}.{key}: set training.{ours} instead")
        checkpointing = self.args.get("activation_checkpointing") or self.args.get("gradient_checkpointing")
        if not checkpointing:
            if self.offload_activations:
                raise ConfigError(
                    "training.offload_activations = true moves the inputs that activation checkpointing keeps; "
                    "turn checkpointing on: training.activation_checkpointing = true"
                )
            if self.activation_checkpointing_layers != 1:
                raise ConfigError(
                    f"training.activation_checkpointing_layers = {self.activation_checkpointing_layers} picks "
                    "the layers activation checkpointing recomputes; turn checkpointing on: "
                    "training.activation_checkpointing = true"
                )


@dataclass
class NeedleTaskConfig:
    """``[eval_tasks] needle``: the grid of ``longalign eval needle --score logprob``, scored while training.

    The same settings give the same prompts as the command's flags of the same names.
    """

    every_steps: int  # score after every this many optimizer steps (required)
    lengths: list[int | str] = field(default_factory=lambda: list(NEEDLE_LENGTHS))  # whole prompt: 4096, "4k"
    depths: list[int] = field(default_factory=lambda: list(NEEDLE_DEPTHS))  # percent of the haystack
    samples_per_cell: int = 1  # prompts per length and depth
    seed: int = 0  # the prompts' randomness: each prompt's key and value, where its haystack starts
    haystack: str | None = None  # a .txt file or a directory of them; default: generated filler sentences
    pack_tokens: int | None = None  # tokens per packed row; default: the longest prompt with its answer

    def __post_init__(self) -> None:
        where = "eval_tasks.needle"
        _check_task_counts(where, self, ("every_steps", "samples_per_cell", "pack_tokens"))
        self.lengths = _token_counts(f"{where}.lengths", self.lengths)
        bad = [d for d in self.depths if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d <= 100]
        if bad or not self.depths:
            raise ConfigError(f"{where}.depths: expected percentages from 0 to 100, got {self.depths!r}")
        self.depths = sorted(set(self.depths))  # as the command reads --depths


@dataclass
class RulerTaskConfig:
    """``[eval_tasks] ruler``: RULER's tasks as ``longalign eval ruler --score logprob`` builds them, scored
    while training. The same settings give the same prompts as the command's flags of the same names."""

    every_steps: int  # score after every this many optimizer steps (required)
    tasks: list[str] | None = None  # default: every task whose answer has one order (qa_hotpot: with hotpot)
    lengths: list[int | str] = field(default_factory=lambda: list(RULER_LENGTHS))  # whole prompt: 4096, "4k"
    samples_per_task: int = 100  # prompts per task and length
    seed: int = 0  # the prompts' randomness
    haystack: str | None = None  # essays: RULER's PaulGrahamEssays.json, .txt file(s); default: filler
    hotpot: str | None = None  # HotpotQA's JSON, for qa_hotpot
    pack_tokens: int | None = None  # tokens per packed row; default: the longest prompt with its answer
    threshold: float | None = None  # of the effective length; default: RULER's 85.6

    def __post_init__(self) -> None:
        where = "eval_tasks.ruler"
        _check_task_counts(where, self, ("every_steps", "samples_per_task", "pack_tokens"))
        self.lengths = _token_counts(f"{where}.lengths", self.lengths)
        if self.tasks is not None and (not self.tasks or not all(isinstance(t, str) for t in self.tasks)):
            raise ConfigError(
                f"{where}.tasks: expected task names, got {self.tasks!r}; leave it out for the default"
            )
        if self.threshold is not None and not 0 <= self.threshold <= 100:
            raise ConfigError(f"{where}.threshold: expected a score from 0 to 100, got {self.threshold}")


def _check_task_counts(where: str, settings: Any, keys: tuple[str, ...]) -> None:
    for key in keys:
        value = getattr(settings, key)
        if value is not None and value < 1:
            raise ConfigError(f"{where}.{key}: must be >= 1, got {value}")


def _token_counts(where: str, values: list[Any]) -> list[int]:
    """Lengths written 4096 or "4k", smallest first without repeats (as the commands read ``--lengths``)."""
    lengths = set()
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise ConfigError(f'{where}: expected token counts such as 4096 or "4k", got {value!r}')
        if isinstance(value, int) and value < 1:
            raise ConfigError(f"{where}: expected positive token counts, got {value}")
        try:
            lengths.add(parse_length(value) if isinstance(value, str) else value)
        except ConfigError as err:
            raise ConfigError(f"{where}: {err}") from None
    if not lengths:
        raise ConfigError(f"{where}: an empty list scores nothing; leave it out for the default")
    return sorted(lengths)


# The tasks of [eval_tasks]: the key that names each, and the settings of its table.
EVAL_TASKS = {"needle": NeedleTaskConfig, "ruler": RulerTaskConfig}


@dataclass
class EvalTasksConfig:
    """``[eval_tasks]``: long-context tasks the trainer's own model scores teacher-forced while it trains.

    ``needle = { lengths = [4096, 16384], every_steps = 200 }``, ``ruler = { tasks = ["vt"], every_steps = 500 }``:
    one table per task (``EVAL_TASKS``), checked by ``tasks()``.
    """

    needle: dict[str, Any] | None = None  # NeedleTaskConfig's fields
    ruler: dict[str, Any] | None = None  # RulerTaskConfig's fields
    on_start: bool = True  # also score the model as it starts, before the first step (not on a resume)

    def __post_init__(self) -> None:
        if not self.tasks():
            raise ConfigError(
                f"[eval_tasks]: names no task; add one of {', '.join(EVAL_TASKS)}, e.g. needle = {{ every_steps = 200 }}"
            )

    def tasks(self) -> dict[str, Any]:
        """The settings of every task named, by task: ``{"needle": NeedleTaskConfig(...)}``."""
        return {
            name: _table_settings(f"eval_tasks.{name}", getattr(self, name), cls)
            for name, cls in EVAL_TASKS.items()
            if getattr(self, name) is not None
        }


def _table_settings(where: str, table: Any, cls: type) -> Any:
    """``cls(**table)`` for a run file's inline table, every key known and of its type; errors name ``where``."""
    if not isinstance(table, dict):
        raise ConfigError(
            f"{where}: expected a table, e.g. {{ every_steps = 200 }}, got {type(table).__name__}"
        )
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    names = [f.name for f in fields]
    for key, value in table.items():
        if key not in names:
            raise ConfigError(f"{where}.{key}: unknown key{did_you_mean(key, names)}")
        if not _matches(value, hints[key]):
            raise ConfigError(
                f"{where}.{key}: expected {_describe(hints[key])}, got {type(value).__name__} {value!r}"
            )
    required = [
        f.name
        for f in fields
        if f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
        and f.name not in table
    ]
    if required:
        raise ConfigError(f"{where}.{required[0]}: missing; it is required")
    return cls(**table)


_OWN_TRAINING_KEYS = [f.name for f in dataclasses.fields(TrainingConfig) if f.name != "args"]

SECTIONS = {
    "data": DataConfig,
    "packing": PackingConfig,
    "loss": LossConfig,
    "training": TrainingConfig,
    "model": ModelConfig,
    "lora": LoraConfig,  # optional: only a run file (or override) that names it trains adapters
    "eval_tasks": EvalTasksConfig,  # optional: only a run file (or override) that names it scores tasks
}
_OPTIONAL_SECTIONS = ("lora", "eval_tasks")


@dataclass(frozen=True)
class Alias:
    """A key users write for the canonical ``key``.

    ``values`` maps what they write to the canonical value (``None``: the value itself, checked as the
    canonical key's). Aliases with ``values`` are boolean switches; a value in ``excludes`` sets nothing
    but contradicts the canonical values listed for it (``packing = true`` with ``strategy = "none"``).
    """

    key: str
    values: Mapping[Any, Any] | None = None
    excludes: Mapping[Any, tuple[Any, ...]] = field(default_factory=dict)


ALIASES = {
    "data.packing": Alias("packing.strategy", {False: "none"}, excludes={True: ("none", "sorted")}),
    "packing.packing": Alias("packing.strategy", {False: "none"}, excludes={True: ("none", "sorted")}),
    "data.sort_by_length": Alias("packing.sort_by_length"),  # see _resolve_sorting
    "loss.normalize_by_tokens": Alias("loss.weighting", {True: "token_level", False: "sequence_level"}),
    # true lets `auto` pick flash-attn where it runs; false pins the exact per-sample path.
    "model.use_flash_attention": Alias(
        "model.attn_backend", {False: "sdpa_segments"}, excludes={True: ("sdpa_segments",)}
    ),
    "training.per_device_batch_size": Alias("training.per_device_train_batch_size"),
    # The first switch of sequence tiling, before the whole layer could be tiled.
    "training.tiled_mlp": Alias("training.sequence_tiling", {True: "mlp"}, excludes={False: ("mlp",)}),
    # TrainingArguments reads a warmup_steps value below 1 as a fraction of all steps.
    "training.warmup_ratio": Alias("training.warmup_steps"),
    # peft's own LoraConfig names.
    "lora.lora_alpha": Alias("lora.alpha"),
    "lora.lora_dropout": Alias("lora.dropout"),
    "lora.modules_to_save": Alias("lora.trainable"),
}

# Keys that run files carry for a value longalign fixes: the one value accepted (it sets nothing), and why.
FIXED = {
    "loss.ignore_index": (
        IGNORE_INDEX,
        "labels mark non-targets with -100: pre-tokenize writes it, the loss reads it",
    ),
}

# Keys that say the same thing two ways: a layer (the command line) that sets one drops the other from the
# layers before it (the file); one layer setting both is an error.
EXCLUSIVE = {"data.train_file": ("data.sources",), "data.sources": ("data.train_file",)}

# TrainingArguments fields with a smallest sensible value that transformers does not check itself.
TRAINING_MINIMUMS = {
    "per_device_train_batch_size": 1,
    "per_device_eval_batch_size": 1,
    "gradient_accumulation_steps": 1,
    "learning_rate": 0,
    "num_train_epochs": 0,
    "warmup_steps": 0,
    "weight_decay": 0,
    "max_grad_norm": 0,
    "seed": 0,
    "dataloader_num_workers": 0,
}

# TrainingArguments fields the run sets itself: the value it needs, and why.
RESERVED_TRAINING_ARGS = {
    "remove_unused_columns": (
        False,
        "pack rows carry cu_seqlens and loss weights that the model's forward does not name",
    ),
}


@dataclass
class Config:
    data: DataConfig
    packing: PackingConfig
    loss: LossConfig
    training: TrainingConfig
    model: ModelConfig
    lora: LoraConfig | None = None  # None: full fine-tuning
    eval_tasks: EvalTasksConfig | None = None  # None: no long-context scores while training
    # "section.key" -> where its value came from: a file path or "command line", with the alias written
    sources: dict[str, str] = field(default_factory=dict)

    def source(self, key: str) -> str:
        """Where the setting ``section.key`` came from: a file, the command line, or ``"default"``."""
        return self.sources.get(key, "default")

    def to_dict(self) -> dict[str, Any]:
        """The config as plain TOML-able tables (training args flattened back into ``[training]``)."""
        out = {
            name: dataclasses.asdict(getattr(self, name))
            for name in SECTIONS
            if getattr(self, name) is not None
        }
        out["training"].update(out["training"].pop("args"))
        return out


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a TOML run file (or start empty) and apply ``section.key=value`` overrides, then check it all."""
    layers: list[tuple[str, dict[str, Any]]] = []
    if path is not None:
        layers.append((str(path), _read_toml(Path(path))))
    layers.append(("command line", _overrides_table(overrides)))
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for origin, tables in layers:
        layer = _canonical(tables)
        for key, (value, written) in layer.items():
            for other in EXCLUSIVE.get(key, ()):  # the later layer's choice replaces the earlier one's
                if other not in layer:
                    values.pop(other, None)
                    sources.pop(other, None)
            where = origin if written == key else f"{origin} (as {written})"
            if isinstance(value, _Fields) and isinstance(values.get(key), dict):  # into the file's table
                value, where = {**values[key], **value}, f"{sources[key]} + {where}"
            values[key] = dict(value) if isinstance(value, _Fields) else value
            sources[key] = where
    _resolve_sorting(values, sources, packing_on=any(_says_packing(tables) for _, tables in layers))
    built: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        if name in _OPTIONAL_SECTIONS and not any(name in tables for _, tables in layers):
            continue  # no [lora] anywhere: full fine-tuning; no [eval_tasks]: no scores
        table = {key.partition(".")[2]: value for key, value in values.items() if key.startswith(name + ".")}
        if cls is TrainingConfig:
            own = {key: table.pop(key) for key in _OWN_TRAINING_KEYS if key in table}
            built[name] = TrainingConfig(**own, args=table)
        else:
            built[name] = cls(**table)
    return Config(**built, sources=sources)


def _says_packing(tables: dict[str, Any]) -> bool:
    """Whether a layer turns packing on by name (``data.packing = true`` or ``packing.packing = true``)."""
    return any(
        isinstance(t, dict) and t.get("packing") is True for t in (tables.get("data"), tables.get("packing"))
    )


def _resolve_sorting(values: dict[str, Any], sources: dict[str, str], *, packing_on: bool) -> None:
    """Give ``packing.sort_by_length`` its meaning next to the strategy, in place.

    With packing on (a packing strategy, or ``packing = true``) the samples are sorted before packing:
    ``packing = true, sort_by_length = true, strategy = "greedy"`` is LongAlign's sort-and-group. With
    packing off (``packing = false``: strategy ``none``), or packing not mentioned at all, it is sorted
    batching, strategy ``sorted``. ``sort_by_length = false`` written next to strategy ``sorted`` is a
    contradiction.
    """
    sort = values.get("packing.sort_by_length")
    strategy = values.get("packing.strategy")
    if sort is False and strategy == "sorted":
        raise ConfigError(
            f"packing.sort_by_length = false ({sources['packing.sort_by_length']}) contradicts "
            f'packing.strategy = "sorted" ({sources["packing.strategy"]}), which sorts by length'
        )
    if sort and (strategy == "none" or (strategy is None and not packing_on)):
        values["packing.strategy"] = "sorted"
        how = sources["packing.sort_by_length"]
        sources["packing.strategy"] = how if strategy is None else f"{sources['packing.strategy']} + {how}"


def _read_toml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML: {err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start})") from None


class _Fields(dict):
    """Fields of a table set one by one on the command line (``section.key.field=value``): merged into the
    table an earlier layer set, where a plain value replaces it."""


def _overrides_table(overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """``section.key=value`` (and ``section.key.field=value``) items as tables; a value is read as TOML, else
    taken as a string."""
    tables: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or "." not in key:
            raise ConfigError(f"override {item!r}: expected section.key=value")
        section, _, name = key.strip().partition(".")
        name, _, inner = name.partition(".")
        try:
            value = tomllib.loads(f"v = {raw.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw.strip()
        table = tables.setdefault(section, {})
        if "." in inner:
            raise ConfigError(f"override {item!r}: expected section.key=value or section.key.field=value")
        if inner:
            if name in table and not isinstance(table[name], _Fields):
                raise ConfigError(
                    f"override {item!r}: {section}.{name} is also set whole; set one or the other"
                )
            table.setdefault(name, _Fields())[inner] = value
        elif isinstance(table.get(name), _Fields):
            raise ConfigError(
                f"override {item!r}: {section}.{name} has fields set one by one too; set one or the other"
            )
        else:
            table[name] = value
    return tables


def _canonical(tables: dict[str, Any]) -> dict[str, tuple[Any, str]]:
    """One layer's settings as ``{"section.key": (value, key as written)}``, aliases resolved and checked."""
    unknown = [name for name in tables if name not in SECTIONS]
    if unknown:
        raise ConfigError(f"unknown section [{unknown[0]}]; sections are {', '.join(SECTIONS)}")
    written: dict[str, Any] = {}
    for section, table in tables.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{section}: expected a [{section}] table, got {type(table).__name__}")
        written.update({f"{section}.{key}": value for key, value in table.items()})
    out: dict[str, tuple[Any, str]] = {}
    for key, value in written.items():
        if key in FIXED:
            fixed, why = FIXED[key]
            if value != fixed:
                raise ConfigError(f"{key}: only {fixed} is accepted ({why}), got {_shown(value)}")
        elif key not in ALIASES:
            _check_value(key, value, key)
            out[key] = (value, key)
    excluded: list[tuple[str, Any, Alias]] = []
    for key, value in written.items():
        alias = ALIASES.get(key)
        if alias is None:
            continue
        if alias.values is None:
            _check_value(alias.key, value, key)
            canonical = value
        elif not isinstance(value, bool):
            raise ConfigError(f"{key}: expected bool, got {type(value).__name__} {value!r}")
        elif value in alias.excludes:
            excluded.append((key, value, alias))
            continue
        else:
            canonical = alias.values[value]
        if alias.key in out and out[alias.key][0] != canonical:
            raise ConfigError(
                f"{key} = {_shown(value)} means {alias.key} = {_shown(canonical)}, but "
                + _setting(out[alias.key], written)
            )
        out.setdefault(alias.key, (canonical, key))  # agreeing with the canonical key: that one is the source
    for key, value, alias in excluded:
        if alias.key in out and out[alias.key][0] in alias.excludes[value]:
            raise ConfigError(f"{key} = {_shown(value)} contradicts " + _setting(out[alias.key], written))
    return out


def _setting(resolved: tuple[Any, str], written: dict[str, Any]) -> str:
    """How a resolved setting was written: ``strategy = "ffd"`` or ``packing = false (means "none")``."""
    value, key = resolved
    text = f"{key} = {_shown(written[key])}"
    return text if written[key] == value and key not in ALIASES else f"{text} (means {_shown(value)})"


def _check_value(key: str, value: Any, written: str) -> None:
    """Check that ``key`` ("section.key", canonical) exists and ``value`` fits its type; errors name ``written``."""
    section, _, name = key.partition(".")
    if section == "training" and name not in _OWN_TRAINING_KEYS:
        _check_training_arg(name, value, written)
        return
    cls = SECTIONS[section]
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init and f.name != "args"]
    if name not in names:
        choices = names + [k.partition(".")[2] for k in ALIASES if k.startswith(section + ".")]
        raise ConfigError(f"{written}: unknown key{did_you_mean(name, choices)}")
    if not _matches(value, hints[name]):
        raise ConfigError(
            f"{written}: expected {_describe(hints[name])}, got {type(value).__name__} {value!r}"
        )


def _check_training_arg(name: str, value: Any, written: str) -> None:
    from transformers import TrainingArguments

    fields = {f.name: f for f in dataclasses.fields(TrainingArguments) if f.init}
    if name not in fields:
        choices = list(fields) + [k.partition(".")[2] for k in ALIASES if k.startswith("training.")]
        raise ConfigError(
            f"{written}: unknown key (not a TrainingArguments field){did_you_mean(name, choices)}"
        )
    if name in RESERVED_TRAINING_ARGS:
        needed, why = RESERVED_TRAINING_ARGS[name]
        if value != needed:
            raise ConfigError(f"{written}: longalign sets it to {_shown(needed)} ({why})")
    annotation = fields[name].type
    if isinstance(annotation, str):  # postponed annotations: check only what is simple to read
        annotation = {"int": int, "float": float, "bool": bool, "str": str}.get(annotation, Any)
    if not _matches(value, annotation, lenient=True):
        raise ConfigError(
            f"{written}: expected {_describe(annotation)}, got {type(value).__name__} {value!r}"
        )
    lowest = TRAINING_MINIMUMS.get(name)
    if lowest is not None and isinstance(value, int | float) and value < lowest:
        raise ConfigError(f"{written}: must be >= {lowest}, got {value!r}")


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
    if origin in (dict, Mapping) or annotation in (dict, Mapping):
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


def _shown(value: Any) -> str:
    """A value as a run file writes it: ``true``, ``"bfd"``, ``8``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else repr(value)

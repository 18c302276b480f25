"""Run configuration: TOML sections, overrides, and errors that name the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from longalign.config import load_config
from longalign.errors import ConfigError

RUN = """
[data]
train_file = "out/packed"
max_seq_len = 4096

[packing]
strategy = "ffd"

[loss]
weighting = "token_level"

[training]
per_device_batch_size = 2
gradient_accumulation_steps = 4
learning_rate = 2e-5
warmup_ratio = 0.1
lr_scheduler_type = "cosine"
bf16 = true

[model]
model_name_or_path = "some/model"
use_flash_attention = false
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_sections_and_aliases(tmp_path):
    cfg = load_config(write(tmp_path, RUN))
    assert cfg.data.train_file == "out/packed" and cfg.data.max_seq_len == 4096
    assert cfg.packing.strategy == "ffd"
    assert cfg.loss.weighting == "token_level" and not hasattr(cfg.loss, "ignore_index")
    assert cfg.training.args == {
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 4,
        "learning_rate": 2e-5,
        "warmup_steps": 0.1,
        "lr_scheduler_type": "cosine",
        "bf16": True,
    }
    assert cfg.model.attn_backend == "sdpa_segments"  # use_flash_attention = false pins the exact CPU path
    assert cfg.source("model.attn_backend") == f"{tmp_path / 'run.toml'} (as model.use_flash_attention)"
    assert cfg.source("training.per_device_train_batch_size").endswith("(as training.per_device_batch_size)")
    assert cfg.source("packing.strategy") == str(tmp_path / "run.toml")
    assert cfg.source("packing.seed") == "default"


def test_overrides_are_typed_and_win(tmp_path):
    cfg = load_config(
        write(tmp_path, RUN),
        [
            "data.max_seq_len=8192",
            "loss.weighting=sequence_level",
            "training.max_steps=3",
            "model.attn_backend=auto",
        ],
    )
    assert cfg.data.max_seq_len == 8192
    assert cfg.loss.weighting == "sequence_level"
    assert cfg.training.args["max_steps"] == 3
    assert cfg.model.attn_backend == "auto"
    assert cfg.source("model.attn_backend") == "command line"


M = "model.model_name_or_path=m"


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["data.sort_by_length=true"], ("packing.strategy", "sorted")),  # packing not mentioned
        (["data.sort_by_length=false"], ("packing.strategy", "bfd")),
        (["data.packing=false", "data.sort_by_length=true"], ("packing.strategy", "sorted")),
        (["data.packing=true", "data.sort_by_length=true"], ("packing.strategy", "bfd")),
        (["packing.strategy='greedy'", "data.sort_by_length=true"], ("packing.sort_by_length", True)),
        (["packing.packing=false"], ("packing.strategy", "none")),
        (["packing.packing=true", "packing.strategy='greedy'"], ("packing.strategy", "greedy")),
        (["model.use_flash_attention=false"], ("model.attn_backend", "sdpa_segments")),
        (["model.use_flash_attention=true"], ("model.attn_backend", "auto")),
        (["training.warmup_ratio=0.1"], ("training.warmup_steps", 0.1)),
    ],
)
def test_aliases_resolve_to_one_canonical_key(overrides, expected):
    cfg = load_config(None, [M, *overrides])
    key, value = expected
    section, _, name = key.partition(".")
    got = cfg.training.args[name] if section == "training" else getattr(getattr(cfg, section), name)
    assert got == value


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["data.sort_by_length=false", "packing.strategy=sorted"],
            r"packing.sort_by_length = false \(command line \(as data.sort_by_length\)\) contradicts "
            r'packing.strategy = "sorted" \(command line\), which sorts by length',
        ),
        (
            ["data.packing=true", "packing.strategy=sorted"],
            'data.packing = true contradicts packing.strategy = "sorted"',
        ),
        (
            ["data.sort_by_length=true", "packing.sort_by_length=false"],
            "data.sort_by_length = true means packing.sort_by_length = true, but packing.sort_by_length = false",
        ),
        (
            ["packing.packing=true", "packing.strategy=none"],
            'packing.packing = true contradicts packing.strategy = "none"',
        ),
        (
            ["model.use_flash_attention=false", "model.attn_backend=flash_attn"],
            'model.use_flash_attention = false means model.attn_backend = "sdpa_segments", but '
            'model.attn_backend = "flash_attn"',
        ),
        (
            ["training.per_device_batch_size=2", "training.per_device_train_batch_size=4"],
            "training.per_device_batch_size = 2 means training.per_device_train_batch_size = 2, but "
            "training.per_device_train_batch_size = 4",
        ),
        (["data.sort_by_length='yes'"], "data.sort_by_length: expected bool, got str"),
        (["training.per_device_batch_size='two'"], "training.per_device_batch_size: expected int"),
    ],
)
def test_contradicting_aliases_name_both_keys(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [M, *overrides])


def test_command_line_wins_over_an_alias_in_the_file(tmp_path):
    path = write(tmp_path, "[data]\nsort_by_length = true\n[model]\nmodel_name_or_path = 'm'\n")
    cfg = load_config(path)
    assert cfg.packing.strategy == "sorted" and cfg.source("packing.strategy").endswith(
        "(as data.sort_by_length)"
    )
    cfg = load_config(path, ["packing.strategy=bfd"])
    assert cfg.packing.strategy == "bfd" and cfg.source("packing.strategy") == "command line"
    cfg = load_config(path, ["data.packing=false"])
    assert cfg.packing.strategy == "sorted"
    assert (
        cfg.source("packing.strategy") == f"command line (as data.packing) + {path} (as data.sort_by_length)"
    )


def test_the_longalign_skeleton_is_sort_and_group():
    """packing = true, sort_by_length = true and strategy = "greedy" together: sort, then pack greedily."""
    path = Path(__file__).parent / "data" / "longalign_skeleton.toml"
    cfg = load_config(path)
    assert (cfg.packing.strategy, cfg.packing.sort_by_length) == ("greedy", True)
    assert cfg.source("packing.sort_by_length") == f"{path} (as data.sort_by_length)"
    assert cfg.source("packing.strategy") == str(path)
    assert cfg.loss.weighting == "sequence_level"


def test_training_keys_the_run_sets_itself():
    load_config(None, [M, "training.remove_unused_columns=false"])  # the value the run needs
    with pytest.raises(ConfigError, match="training.remove_unused_columns: longalign sets it to false"):
        load_config(None, [M, "training.remove_unused_columns=true"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.max_seq_lenn=3", r"data.max_seq_lenn: unknown key; did you mean 'max_seq_len'\?"),
        ("optimizer.lr=3", r"unknown section \[optimizer\]"),
        ("data.max_seq_len='long'", "data.max_seq_len: expected int, got str"),
        ("packing.packing=1", "packing.packing: expected bool, got int"),
        ("loss.weighting=per_token", "loss.weighting: 'per_token' is not one of sequence_level, token_level"),
        ("packing.strategy=knapsack", "packing.strategy: 'knapsack' is not one of"),
        (
            "training.learning_rat=1e-4",
            r"training.learning_rat: unknown key .*did you mean 'learning_rate'\?",
        ),
        ("training.num_train_epochs='two'", "training.num_train_epochs: expected float, got str"),
        ("training.bf16=2", "training.bf16: expected bool, got int"),
        ("training.sequence_parallel_size=0", "training.sequence_parallel_size: must be >= 1, got 0"),
        ("training.sequence_parallel_size='2'", "training.sequence_parallel_size: expected int, got str"),
        ("model.torch_dtype=int8", "model.torch_dtype"),
        ("novalue", "expected section.key=value"),
    ],
)
def test_bad_keys_and_values_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["model.model_name_or_path=m", override])


def test_model_needs_a_source():
    with pytest.raises(ConfigError, match="model_name_or_path"):
        load_config(None, [])
    with pytest.raises(ConfigError, match="model_type"):
        load_config(None, ["model.init_from_config={hidden_size = 8}"])


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[data\n"))


def test_to_dict_is_flat_tables(tmp_path):
    out = load_config(write(tmp_path, RUN)).to_dict()
    assert list(out) == ["data", "packing", "loss", "training", "model"]
    assert out["training"]["per_device_train_batch_size"] == 2 and "args" not in out["training"]
    assert out["model"]["attn_backend"] == "sdpa_segments" and "use_flash_attention" not in out["model"]


CONFIGS = Path(__file__).resolve().parents[1] / "configs"


# run file: (tokens per pack, ranks each pack is split over)
SHIPPED = {
    "demo.toml": (4096, 1),
    "llama3_8b_64k.toml": (65536, 1),
    "glm4_9b_64k.toml": (65536, 1),
    "llama3_8b_256k_sp8.toml": (262144, 8),
    "glm4_9b_128k_sp4.toml": (131072, 4),
    "longalign_recipe.toml": (65536, 1),
    "llama3_8b_64k_lora.toml": (65536, 1),
    "llama3_8b_1m_sp8.toml": (1048576, 8),
    "llama3_8b_512k_1gpu.toml": (524288, 1),
    "llama3_8b_1m_1gpu.toml": (1048576, 1),
    "llama3_8b_2m_h200.toml": (2097152, 1),
    "gpt_oss_20b_1m_1gpu.toml": (1048576, 1),
}


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_run_configs_load(name):
    cfg = load_config(CONFIGS / name)
    assert cfg.data.train_file
    assert (cfg.data.max_seq_len, cfg.training.sequence_parallel_size) == SHIPPED[name]
    assert (cfg.lora is not None) == name.endswith("_lora.toml")
    if name != "demo.toml":  # the GPU configs train in bf16 with activation checkpointing
        assert cfg.training.args["bf16"] and cfg.training.args["activation_checkpointing"]
        assert cfg.model.torch_dtype == "bfloat16"


@pytest.mark.parametrize("name", ["zero3.json", "zero3_offload.json", "zero3_offload_optimizer.json"])
def test_deepspeed_sizes_are_integers(name):
    """DeepSpeed >= 0.15 rejects float bucket sizes and thresholds (e.g. 5e7 written as a float)."""
    import json

    zero = json.loads((CONFIGS / "deepspeed" / name).read_text())["zero_optimization"]
    sizes = {k: v for k, v in zero.items() if k.endswith(("_size", "_threshold", "_parameters", "_distance"))}
    assert sizes and all(type(v) is int for v in sizes.values()), sizes


LONGALIGN_KEYS = {
    "data": ["train_file", "max_seq_len", "packing", "sort_by_length", "min_seq_len", "max_seq_len_filter"],
    "packing": ["strategy", "pad_to_max", "attention_mask_type"],
    "loss": ["weighting", "ignore_index", "normalize_by_tokens"],
    "training": ["per_device_batch_size", "gradient_accumulation_steps", "learning_rate", "num_train_epochs",
                 "warmup_ratio", "lr_scheduler_type"],
    "model": ["model_name_or_path", "trust_remote_code", "use_flash_attention"],
}  # fmt: skip


def test_the_longalign_recipe_uses_every_key_users_write_and_loads_as_written():
    import tomllib

    path = CONFIGS / "longalign_recipe.toml"
    written = tomllib.loads(path.read_text())
    for section, keys in LONGALIGN_KEYS.items():
        assert set(keys) <= set(written[section]), section
    cfg = load_config(path)
    assert (cfg.data.max_seq_len, cfg.packing.strategy, cfg.loss.weighting) == (
        65536,
        "bfd",
        "sequence_level",
    )
    assert cfg.training.args["learning_rate"] == 2e-5 and cfg.training.args["num_train_epochs"] == 2
    assert cfg.training.args["warmup_steps"] == 0.03 and cfg.model.attn_backend == "auto"
    assert cfg.source("loss.weighting").endswith("longalign_recipe.toml")


@pytest.mark.parametrize(
    "override, message",
    [
        ("packing.attention_mask_type='2d'", 'only "1d_varlen": samples are kept apart by cu_seqlens'),
        ("data.max_seq_len_filter=70000", "data.max_seq_len_filter: must be between 1 and data.max_seq_len"),
        ("data.packing=false", 'data.packing = false means packing.strategy = "none", but packing.strategy'),
        ("loss.normalize_by_tokens=true", 'means loss.weighting = "token_level", but loss.weighting'),
    ],
)
def test_recipe_contradictions_are_one_line_errors(tmp_path, override, message):
    section, _, key = override.partition("=")[0].partition(".")
    text = (CONFIGS / "longalign_recipe.toml").read_text()
    lines = [line for line in text.splitlines() if not line.startswith(f"{key} ")]
    head = f"[{section}]"
    patched = "\n".join(lines).replace(head, f"{head}\n{key} = {override.partition('=')[2]}", 1)
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, patched))


def test_sources_on_the_command_line_replace_the_file_s_train_file(tmp_path):
    path = write(tmp_path, RUN)  # its [data] has train_file
    cfg = load_config(path, ['data.sources=[{path = "a.jsonl"}, {path = "b.jsonl", fraction = 0.5}]'])
    assert cfg.data.train_file == "" and [s.path for s in cfg.data.train_sources()] == ["a.jsonl", "b.jsonl"]
    with pytest.raises(ConfigError, match="data.sources and data.train_file: set one"):
        load_config(path, ["data.sources=[{path = 'a.jsonl'}]", "data.train_file='c.jsonl'"])
    with pytest.raises(ConfigError, match=r"data.sources\[0\].weigth: unknown key; did you mean 'weight'\?"):
        load_config(path, ["data.sources=[{path = 'a.jsonl', weigth = 2}]"])


def test_lora_section_is_optional_and_checked(tmp_path):
    assert load_config(None, [M]).lora is None  # no [lora]: full fine-tuning
    empty = load_config(write(tmp_path, "[model]\nmodel_name_or_path = 'm'\n[lora]\n"))
    assert empty.lora is not None and empty.lora.r == 16 and empty.lora.target_modules is None
    assert list(empty.to_dict())[-1] == "lora"
    cfg = load_config(
        None,
        [
            M,
            "lora.r=8",
            "lora.lora_alpha=16",
            "lora.trainable=['embeddings', 'norms']",
            "lora.load_in_4bit=true",
        ],
    )
    assert (cfg.lora.r, cfg.lora.alpha, cfg.lora.trainable) == (8, 16, ["embeddings", "norms"])
    assert cfg.lora.load_in_4bit and cfg.source("lora.alpha") == "command line (as lora.lora_alpha)"


@pytest.mark.parametrize(
    "override, message",
    [
        ("lora.rank=8", "lora.rank: unknown key"),
        ("lora.r=0", "lora.r: must be >= 1, got 0"),
        ("lora.alpha=-1", "lora.alpha: must be > 0"),
        ("lora.dropout=1.0", "lora.dropout: must be >= 0 and < 1, got 1.0"),
        ("lora.target_modules='q_proj'", "lora.target_modules: expected list or nothing, got str"),
        ("lora.target_modules=[]", "lora.target_modules: an empty list adapts nothing"),
        ("lora.trainable=['norms', 'norms']", "lora.trainable: 'norms' is listed twice"),
        ("lora.trainable=[3]", "lora.trainable: expected module names, got 3"),
        ("lora.load_in_4bit='yes'", "lora.load_in_4bit: expected bool, got str"),
    ],
)
def test_bad_lora_keys_and_values_are_named(override, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, [M, override])
    assert "\n" not in str(err.value)


def test_both_quantizations_at_once_are_refused():
    with pytest.raises(ConfigError, match="lora.load_in_4bit and lora.load_in_8bit: set one"):
        load_config(None, [M, "lora.load_in_4bit=true", "lora.load_in_8bit=true"])


@pytest.mark.parametrize(
    "override, message",
    [
        (
            'model.init_from_config={model_type = "llama", hiden_size = 8}',
            r"model.init_from_config.hiden_size: not a field of LlamaConfig; did you mean 'hidden_size'\?",
        ),
        (
            'model.init_from_config={model_type = "lama"}',
            r"unknown model type 'lama'; did you mean 'llama'\?",
        ),
        ("training.per_device_batch_size=0", "training.per_device_batch_size: must be >= 1, got 0"),
        (
            "training.gradient_accumulation_steps=0",
            "training.gradient_accumulation_steps: must be >= 1, got 0",
        ),
        ("training.learning_rate=-1e-4", "training.learning_rate: must be >= 0, got -0.0001"),
        ("packing.seed=-1", "packing.seed: must be >= 0, got -1"),
        ("data.max_seq_len=0", "data.max_seq_len: must be >= 1, got 0"),
        ("data.max_seq_len=-1", "data.max_seq_len: must be >= 1, got -1"),
    ],
)
def test_values_no_run_could_use_are_named(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [M, override])


def test_model_settings_the_config_consumes_are_no_typo():
    cfg = load_config(None, [M, 'model.init_from_config={model_type = "llama", rope_theta = 500000.0}'])
    assert cfg.model.init_from_config["rope_theta"] == 500000.0  # folded into rope_parameters, not stray


def test_eval_tasks_is_optional_and_reads_lengths_as_the_command_does(tmp_path):
    assert load_config(None, [M]).eval_tasks is None  # no [eval_tasks]: no scores while training
    path = write(
        tmp_path,
        "[model]\nmodel_name_or_path = 'm'\n[eval_tasks]\n"
        'needle = { lengths = ["4k", 1000, 1000], depths = [100, 0, 50], every_steps = 200 }\n',
    )
    cfg = load_config(path)
    needle = cfg.eval_tasks.tasks()["needle"]
    assert (needle.lengths, needle.depths, needle.every_steps) == ([1000, 4096], [0, 50, 100], 200)
    assert (needle.samples_per_cell, needle.seed, needle.haystack, needle.pack_tokens) == (1, 0, None, None)
    assert cfg.eval_tasks.on_start  # the curve starts at the model as it was
    ruler = load_config(None, [M, "eval_tasks.ruler.every_steps=500"]).eval_tasks.tasks()["ruler"]
    assert (ruler.lengths, ruler.samples_per_task, ruler.tasks, ruler.threshold) == (
        [4096, 8192, 16384, 32768, 65536, 131072], 100, None, None)  # fmt: skip  # the command's defaults
    assert load_config(None, [M, "eval_tasks.needle.every_steps=5"]).eval_tasks.tasks()["needle"].lengths == [
        1000, 2000, 4000, 8000]  # fmt: skip  # the command's default grid


def test_a_field_of_a_table_is_overridden_on_its_own(tmp_path):
    path = write(
        tmp_path,
        "[model]\nmodel_name_or_path = 'm'\n[eval_tasks]\nneedle = { lengths = [512], every_steps = 200 }\n",
    )
    cfg = load_config(path, ["eval_tasks.needle.every_steps=50", "eval_tasks.needle.seed=3"])
    assert cfg.eval_tasks.needle == {"lengths": [512], "every_steps": 50, "seed": 3}
    assert cfg.source("eval_tasks.needle") == f"{path} + command line"
    whole = load_config(path, ["eval_tasks.needle={every_steps = 7}"])  # a whole table replaces the file's
    assert whole.eval_tasks.needle == {"every_steps": 7}
    for overrides, message in [
        (["eval_tasks.needle={every_steps = 7}", "eval_tasks.needle.seed=1"], "set one or the other"),
        (["eval_tasks.needle.seed=1", "eval_tasks.needle={every_steps = 7}"], "set one or the other"),
        (["eval_tasks.needle.a.b=1"], "expected section.key=value or section.key.field=value"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(path, overrides)


EVERY = "eval_tasks.needle.every_steps=2"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            [EVERY, "eval_tasks.needle.lenghts=[512]"],
            r"eval_tasks.needle.lenghts: unknown key; did you mean 'lengths'\?",
        ),
        (
            [EVERY, "eval_tasks.needle.lengths=['4x']"],
            "eval_tasks.needle.lengths: length '4x': expected a positive",
        ),
        (
            [EVERY, "eval_tasks.needle.lengths=[0]"],
            "eval_tasks.needle.lengths: expected positive token counts, got 0",
        ),
        ([EVERY, "eval_tasks.needle.lengths=[]"], "eval_tasks.needle.lengths: an empty list scores nothing"),
        ([EVERY, "eval_tasks.needle.lengths=512"], "eval_tasks.needle.lengths: expected list, got int 512"),
        (
            [EVERY, "eval_tasks.needle.depths=[50, 101]"],
            r"eval_tasks.needle.depths: expected percentages from 0 to 100",
        ),
        (
            [EVERY, "eval_tasks.needle.samples_per_cell=0"],
            "eval_tasks.needle.samples_per_cell: must be >= 1, got 0",
        ),
        ([EVERY, "eval_tasks.needle.pack_tokens=0"], "eval_tasks.needle.pack_tokens: must be >= 1, got 0"),
        ([EVERY, "eval_tasks.needle.seed='a'"], "eval_tasks.needle.seed: expected int, got str 'a'"),
        (["eval_tasks.needle.every_steps=0"], "eval_tasks.needle.every_steps: must be >= 1, got 0"),
        (["eval_tasks.needle.seed=1"], "eval_tasks.needle.every_steps: missing; it is required"),
        (["eval_tasks.needle=3"], "eval_tasks.needle: expected dict or nothing, got int 3"),
        (["eval_tasks.nedle={every_steps = 2}"], r"eval_tasks.nedle: unknown key; did you mean 'needle'\?"),
        (["eval_tasks.on_start=false"], r"\[eval_tasks\]: names no task; add one of needle, ruler"),
        (
            ["eval_tasks.ruler={every_steps = 1, tasks = []}"],
            r"eval_tasks.ruler.tasks: expected task names, got \[\]",
        ),
        (
            ["eval_tasks.ruler={every_steps = 1, tasks = 'vt'}"],
            "eval_tasks.ruler.tasks: expected list or nothing",
        ),
        (
            ["eval_tasks.ruler={every_steps = 1, threshold = 120}"],
            "eval_tasks.ruler.threshold: expected a score from 0",
        ),
        (
            ["eval_tasks.ruler={every_steps = 1, samples_per_task = 0}"],
            "eval_tasks.ruler.samples_per_task: must be >= 1",
        ),
        (["eval_tasks.ruler={every_steps = 1, lengths = ['8q']}"], "eval_tasks.ruler.lengths: length '8q'"),
        (["eval_tasks.ruler={every_steps = 1, samples = 3}"], "eval_tasks.ruler.samples: unknown key"),
    ],
)
def test_bad_eval_tasks_keys_and_values_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, [M, *overrides])
    assert "\n" not in str(err.value)


def test_config_overrides_are_for_a_checkpoint_and_checked_against_its_model_type():
    from longalign.config import check_config_overrides

    random = 'model.init_from_config={model_type = "llama"}'
    with pytest.raises(ConfigError, match="model.config_overrides: changes a pretrained checkpoint's config"):
        load_config(None, [random, "model.config_overrides={max_position_embeddings = 4096}"])
    with pytest.raises(
        ConfigError, match="model.config_overrides.model_type: the checkpoint's model type cannot"
    ):
        load_config(None, ['model.model_name_or_path="x"', 'model.config_overrides={model_type = "glm"}'])
    with pytest.raises(ConfigError, match="model.config_overrides.max_positions: not a field of GlmConfig"):
        check_config_overrides({"max_positions": 8192}, "glm")
    # rope_theta is not a field: it is folded into rope_parameters
    check_config_overrides({"rope_theta": 1e6, "max_position_embeddings": 8192}, "glm")
    overrides = {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}
    check_config_overrides(overrides, "llama")
    assert overrides == {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}  # left as the user wrote it


def test_long_context_memory_keys_load_with_checkpointing():
    cfg = load_config(None, [M, "training.activation_checkpointing=true", "training.tiled_mlp=true",
                             "training.mlp_tile_tokens=2048", "training.offload_activations=true",
                             "training.activation_checkpointing_layers=2"])  # fmt: skip
    training = cfg.training
    assert (training.sequence_tiling, training.mlp_tile_tokens) == ("mlp", 2048)  # tiled_mlp = true: "mlp"
    assert (training.offload_activations, training.activation_checkpointing_layers) == (True, 2)
    assert "tiled_mlp" not in training.args  # longalign's own keys, not TrainingArguments fields
    defaults = load_config(None, [M]).training
    assert (defaults.sequence_tiling, defaults.mlp_tile_tokens) == ("", 0)
    assert load_config(None, [M, "training.sequence_tiling=layer"]).training.sequence_tiling == "layer"
    agreeing = load_config(None, [M, "training.sequence_tiling=mlp", "training.tiled_mlp=true"])
    assert agreeing.training.sequence_tiling == "mlp"
    assert load_config(None, [M, "training.tiled_mlp=false"]).training.sequence_tiling == ""
    assert (defaults.offload_activations, defaults.activation_checkpointing_layers) == (False, 1)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["training.offload_activations=true"],
            "training.offload_activations = true moves the inputs that activation checkpointing keeps; "
            "turn checkpointing on: training.activation_checkpointing = true",
        ),
        (
            ["training.activation_checkpointing_layers=2"],
            "training.activation_checkpointing_layers = 2 picks the layers .* turn checkpointing on",
        ),
        (["training.mlp_tile_tokens=512"], "sizes the tiles of training.sequence_tiling, which is off"),
        (
            ["training.tiled_mlp=true", "training.sequence_tiling=layer"],
            'training.tiled_mlp = true means training.sequence_tiling = "mlp", but training.sequence_tiling = "layer"',
        ),
        (
            ["training.tiled_mlp=false", "training.sequence_tiling=mlp"],
            'training.tiled_mlp = false contradicts training.sequence_tiling = "mlp"',
        ),
        (
            ["training.sequence_tiling=attention"],
            "training.sequence_tiling: expected one of '', 'mlp', 'layer'",
        ),
        (
            ["training.tiled_mlp=true", "training.mlp_tile_tokens=-1"],
            "training.mlp_tile_tokens: must be >= 0",
        ),
        (
            ["training.activation_checkpointing=true", "training.activation_checkpointing_layers=0"],
            "training.activation_checkpointing_layers: must be >= 1",
        ),
        (
            [
                "training.activation_checkpointing=true",
                "training.activation_checkpointing_kwargs={offload = true}",
            ],
            "training.activation_checkpointing_kwargs.offload: set training.offload_activations instead",
        ),
        (
            [
                "training.activation_checkpointing=true",
                "training.activation_checkpointing_kwargs={every_n_layers = 2}",
            ],
            "training.activation_checkpointing_kwargs.every_n_layers: set training.activation_checkpointing_layers",
        ),  # fmt: skip
        (["training.tiled_mlp=1"], "training.tiled_mlp: expected bool, got int"),
    ],
)
def test_long_context_memory_keys_that_cannot_take_effect_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [M, *overrides])

"""ChatGLM-layout checkpoints (GLM-4-9B's remote-code layout) read as GlmForCausalLM, never run as code.

The fixture is a tiny checkpoint in that layout: random weights under ChatGLM names, a rank file trained
here, the real keys of glm-4-9b-chat's config.json, its chat template, and .py files that would leave a
marker if anything imported them. The model is checked against a forward pass written here from the
architecture, in float64; the tokenizer against tiktoken on the same rank file.
"""

from __future__ import annotations

import base64
import json
import math
import shutil
import sys
from pathlib import Path

import datasets
import pytest
import torch
from conftest import (
    FLOAT64_BOUND,
    ROOT,
    SAMPLE,
    packed_logits_error,
    relative_error,
    tiny_model,
    window_packs,
)
from safetensors.torch import load_file, save_file
from transformers import GlmConfig, GlmForCausalLM

from longalign import chatglm_layout, checkpoints
from longalign.checkpoints import GLM4_SPECIAL_TOKENS, GLM4_SPLIT_PATTERN, convert, load_model, read_weights
from longalign.cli import main
from longalign.errors import ConfigError, ModelError

tiktoken = pytest.importorskip("tiktoken")

# Written from glm-4-9b-chat's template: [gMASK]<sop>, then each turn as <|role|>, a newline and the text.
CHAT_TEMPLATE = (
    "[gMASK]<sop>{% for message in messages %}"
    "{% if message['role'] == 'system' %}<|system|>\n{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}<|user|>\n{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<|assistant|>\n{{ message['content'] }}"
    "{% elif message['role'] == 'observation' %}<|observation|>\n{{ message['content'] }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SHAPE = dict(
    hidden_size=32, num_attention_heads=4, kv_channels=12, multi_query_group_num=2, ffn_hidden_size=48
)
NUM_LAYERS = 2
ROPE_RATIO = 3.0
VOCAB_RANKS = 600  # the rank file's size; the special tokens follow
PADDED_VOCAB = 640  # the embedding's rows, as padded_vocab_size pads glm-4's 151,343 tokens to 151,552
TEXTS = [
    "Hello, world! It's a test: don't panic.",
    "长文本对齐：训练数据与模型。混合 English 和中文 text。",
    "naïve café Grüße — “quotes” and emoji 😀🎉👍🏽 and ZWJ 👨‍👩‍👧",
    "digits 1234567890 3.14159 2024-12-01 +44 (0)20 7946 0958",
    "   leading spaces\n\n\n\ttabs\t\tand  double  spaces   \r\n trailing   ",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # comment\n",
    '<html><body class="x">&amp; &lt;tag&gt;</body></html>',
    "I'M SHOUTING, you've heard; we'll see. THEY'D LIKE IT'S",
    "",
    " ",
    "\n",
]


def remote_code(marker: Path) -> str:
    """A module that leaves ``marker`` and fails if anything imports it."""
    return f"import pathlib\npathlib.Path({str(marker)!r}).write_text(__name__)\nraise RuntimeError('remote code ran')\n"


def train_ranks() -> dict[bytes, int]:
    """A small byte-level BPE rank file trained with tiktoken's own trainer on the sample chats."""
    from tiktoken._educational import bpe_train

    lines = SAMPLE.read_text(encoding="utf-8").splitlines()[:8]
    text = "\n".join(m["content"] for line in lines for m in json.loads(line)["messages"])[:30000]
    text += " 长文本对齐 训练数据 模型 混合 😀🎉 naïve café Grüße 12345 2024 ".join(TEXTS) * 10
    return bpe_train(text, VOCAB_RANKS, GLM4_SPLIT_PATTERN, visualise=None)


def chatglm_state(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 weights under ChatGLM names, shaped by ``config``."""
    gen = torch.Generator().manual_seed(seed)
    hidden, heads, kv = config["hidden_size"], config["num_attention_heads"], config["kv_channels"]
    qkv_rows = (heads + 2 * config["multi_query_group_num"]) * kv

    def rand(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    state = {
        "transformer.embedding.word_embeddings.weight": rand(config["padded_vocab_size"], hidden, scale=1.0),
        "transformer.encoder.final_layernorm.weight": 1 + rand(hidden, scale=0.1),
        "transformer.output_layer.weight": rand(config["padded_vocab_size"], hidden),
        "transformer.rotary_pos_emb.inv_freq": torch.ones(kv // 4),
    }
    for n in range(config["num_layers"]):
        prefix = f"transformer.encoder.layers.{n}."
        state |= {
            prefix + "input_layernorm.weight": 1 + rand(hidden, scale=0.1),
            prefix + "self_attention.query_key_value.weight": rand(qkv_rows, hidden),
            prefix + "self_attention.query_key_value.bias": rand(qkv_rows),
            prefix + "self_attention.dense.weight": rand(hidden, heads * kv),
            prefix + "post_attention_layernorm.weight": 1 + rand(hidden, scale=0.1),
            prefix + "mlp.dense_h_to_4h.weight": rand(2 * config["ffn_hidden_size"], hidden),
            prefix + "mlp.dense_4h_to_h.weight": rand(hidden, config["ffn_hidden_size"]),
        }
    return state


def glm4_config(num_ranks: int) -> dict:
    """glm-4-9b-chat's config.json keys, shrunk."""
    return {
        "_name_or_path": "THUDM/glm-4-9b-chat",
        "model_type": "chatglm",
        "architectures": ["ChatGLMModel"],
        "auto_map": {
            "AutoConfig": "configuration_chatglm.ChatGLMConfig",
            "AutoModel": "modeling_chatglm.ChatGLMForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_chatglm.ChatGLMForConditionalGeneration",
            "AutoModelForSeq2SeqLM": "modeling_chatglm.ChatGLMForConditionalGeneration",
            "AutoModelForSequenceClassification": "modeling_chatglm.ChatGLMForSequenceClassification",
        },
        "add_bias_linear": False,
        "add_qkv_bias": True,
        "apply_query_key_layer_scaling": True,
        "apply_residual_connection_post_layernorm": False,
        "attention_dropout": 0.0,
        "attention_softmax_in_fp32": True,
        "attn_implementation": "sdpa",
        "bias_dropout_fusion": True,
        **SHAPE,
        "fp32_residual_connection": False,
        "hidden_dropout": 0.0,
        "layernorm_epsilon": 1.5625e-07,
        "multi_query_attention": True,
        "num_layers": NUM_LAYERS,
        "num_hidden_layers": NUM_LAYERS,
        "original_rope": True,
        "padded_vocab_size": PADDED_VOCAB,
        "post_layer_norm": True,
        "rmsnorm": True,
        "rope_ratio": ROPE_RATIO,
        "seq_length": 2048,
        "use_cache": True,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "transformers_version": "4.44.0",
        "eos_token_id": [num_ranks, num_ranks + 7, num_ranks + 9],
        "pad_token_id": num_ranks,
    }


def write_checkpoint(
    path: Path,
    *,
    marker: Path,
    ranks: dict[bytes, int],
    weights: str = "safetensors",
    config: dict | None = None,
) -> Path:
    """A tiny GLM-4-9B-layout checkpoint in ``path``: sharded weights, rank file, template, remote code."""
    path.mkdir(parents=True)
    config = config or glm4_config(len(ranks))
    (path / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    state = chatglm_state(config)
    keys = sorted(state)
    shards = {f"model-0000{i + 1}-of-00002.{'safetensors' if weights == 'safetensors' else 'bin'}": part
              for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2 :]))}  # fmt: skip
    for file, part in shards.items():
        if weights == "safetensors":
            save_file({key: state[key] for key in part}, path / file)
        else:
            torch.save({key: state[key] for key in part}, path / file)
    index = "model.safetensors.index.json" if weights == "safetensors" else "pytorch_model.bin.index.json"
    weight_map = {key: file for file, part in shards.items() for key in part}
    (path / index).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}), encoding="utf-8")
    rank_lines = [
        f"{base64.b64encode(token).decode()} {rank}"
        for token, rank in sorted(ranks.items(), key=lambda i: i[1])
    ]
    (path / "tokenizer.model").write_text("\n".join(rank_lines) + "\n", encoding="utf-8")
    tokenizer_config = {
        "auto_map": {"AutoTokenizer": ["tokenization_chatglm.ChatGLM4Tokenizer", None]},
        "tokenizer_class": "ChatGLM4Tokenizer",
        "chat_template": CHAT_TEMPLATE,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "padding_side": "left",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 128000,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2), encoding="utf-8")
    for name in ("configuration_chatglm.py", "modeling_chatglm.py", "tokenization_chatglm.py"):
        (path / name).write_text(remote_code(marker), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def ranks() -> dict[bytes, int]:
    return train_ranks()


@pytest.fixture(scope="module")
def marker(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("marker") / "REMOTE_CODE_RAN"


@pytest.fixture(scope="module")
def glm4_dir(tmp_path_factory, ranks, marker) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("ckpt") / "glm-4-tiny", marker=marker, ranks=ranks)


@pytest.fixture(autouse=True)
def no_remote_code(marker):
    """Every test ends with the checkpoint's code never imported."""
    yield
    assert not marker.exists(), f"remote code ran: {marker.read_text()}"


def encoding(ranks: dict[bytes, int]):
    specials = {token: len(ranks) + i for i, token in enumerate(GLM4_SPECIAL_TOKENS)}
    return tiktoken.Encoding(
        name="glm4-tiny", pat_str=GLM4_SPLIT_PATTERN, mergeable_ranks=ranks, special_tokens=specials
    )


# --- the reference forward, from the architecture ------------------------------------------------------


def reference_logits(state: dict[str, torch.Tensor], config: dict, ids: list[int]) -> torch.Tensor:
    """GLM-4-9B's forward in float64, read off ChatGLM-named weights: ``[T, padded_vocab]`` logits."""
    w = {key: value.double() for key, value in state.items()}
    heads, groups, kv = config["num_attention_heads"], config["multi_query_group_num"], config["kv_channels"]
    eps, length = config["layernorm_epsilon"], len(ids)

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    rotary = kv // 2  # RoPE on the first half of each head, in (even, odd) pairs
    inv_freq = 1.0 / (10000.0 * config["rope_ratio"]) ** (
        torch.arange(0, rotary, 2, dtype=torch.float64) / rotary
    )
    angle = torch.arange(length, dtype=torch.float64)[:, None] * inv_freq[None]  # [T, rotary/2]
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]

    def rope(x: torch.Tensor) -> torch.Tensor:  # [T, n, kv]
        pairs = x[..., :rotary].reshape(length, x.shape[1], rotary // 2, 2)
        even, odd = pairs[..., 0], pairs[..., 1]
        turned = torch.stack([even * cos - odd * sin, odd * cos + even * sin], -1).reshape(length, -1, rotary)
        return torch.cat([turned, x[..., rotary:]], -1)

    x = w["transformer.embedding.word_embeddings.weight"][torch.tensor(ids)]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    for n in range(config["num_layers"]):
        p = f"transformer.encoder.layers.{n}."
        h = rms(x, w[p + "input_layernorm.weight"])
        qkv = (
            h @ w[p + "self_attention.query_key_value.weight"].T
            + w[p + "self_attention.query_key_value.bias"]
        )
        q, k, v = qkv.split([heads * kv, groups * kv, groups * kv], -1)
        q, k, v = q.view(length, heads, kv), k.view(length, groups, kv), v.view(length, groups, kv)
        q, k = rope(q), rope(k)
        k, v = k.repeat_interleave(heads // groups, 1), v.repeat_interleave(heads // groups, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(kv)
        attention = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out = torch.einsum("hqk,khd->qhd", attention, v).reshape(length, heads * kv)
        x = x + out @ w[p + "self_attention.dense.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = (h @ w[p + "mlp.dense_h_to_4h.weight"].T).chunk(2, -1)
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.dense_4h_to_h.weight"].T
    return rms(x, w["transformer.encoder.final_layernorm.weight"]) @ w["transformer.output_layer.weight"].T


@pytest.mark.parametrize("weights", ["safetensors", "bin"])
def test_native_model_matches_the_reference_forward(tmp_path, ranks, marker, weights):
    path = write_checkpoint(tmp_path / "ckpt", marker=marker, ranks=ranks, weights=weights)
    config = json.loads((path / "config.json").read_text())
    model = load_model(str(path), dtype=torch.float32, trust_remote_code=True)
    assert type(model) is GlmForCausalLM
    assert model.config.head_dim == 12 != model.config.hidden_size // model.config.num_attention_heads
    assert model.config.rope_parameters["rope_theta"] == 10000 * ROPE_RATIO
    assert model.config.eos_token_id == config["eos_token_id"]
    ids = torch.randint(0, PADDED_VOCAB, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].double()
    reference = reference_logits(read_weights(path), config, ids)
    relative = ((logits - reference).norm() / reference.norm()).item()
    assert relative < 1e-5, relative


def test_tokenizer_ids_equal_tiktoken(glm4_dir, ranks):
    tokenizer = checkpoints.rank_file_tokenizer(glm4_dir)
    reference = encoding(ranks)
    for text in [*TEXTS, SAMPLE.read_text(encoding="utf-8")[:20000]]:
        assert tokenizer.encode(text, add_special_tokens=False) == reference.encode_ordinary(text), text[:40]
        assert tokenizer.decode(reference.encode_ordinary(text)) == text
    chat = "[gMASK]<sop><|user|>\nHi 你好<|assistant|>\nHello.<|endoftext|>"
    assert tokenizer.encode(chat, add_special_tokens=False) == reference.encode(chat, allowed_special="all")
    assert tokenizer.convert_tokens_to_ids(list(GLM4_SPECIAL_TOKENS)) == list(
        range(len(ranks), len(ranks) + 14)
    )
    assert (tokenizer.eos_token, tokenizer.pad_token_id) == ("<|endoftext|>", len(ranks))
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert rendered == "[gMASK]<sop><|system|>\nS<|user|>\nU<|assistant|>"


def test_open_tokenizer_reads_the_rank_file(glm4_dir, ranks):
    from longalign.chat_template import open_tokenizer

    tokenizer = open_tokenizer(str(glm4_dir), trust_remote_code=True)
    assert tokenizer.is_fast
    assert tokenizer.encode("naïve café 1234", add_special_tokens=False) == encoding(ranks).encode_ordinary(
        "naïve café 1234"
    )


def test_round_trip_chatglm_native_chatglm_is_bit_exact(tmp_path, glm4_dir):
    assert convert(str(glm4_dir), tmp_path / "native") == "native"
    native = GlmForCausalLM.from_pretrained(tmp_path / "native")  # transformers alone reads it
    assert native.config.model_type == "glm"
    assert (tmp_path / "native" / "tokenizer.json").is_file()
    assert convert(str(tmp_path / "native"), tmp_path / "back") == "chatglm"
    original, back = read_weights(glm4_dir), read_weights(tmp_path / "back")
    original.pop("transformer.rotary_pos_emb.inv_freq")
    assert original.keys() == back.keys()
    assert all(torch.equal(original[key], back[key]) for key in original)
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads(
        (glm4_dir / "config.json").read_text()
    )


def test_round_trip_native_chatglm_native_is_bit_exact(tmp_path):
    torch.manual_seed(0)
    config = GlmConfig(
        vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, pad_token_id=0, eos_token_id=[1, 2],
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0, "partial_rotary_factor": 0.5},
    )  # fmt: skip
    GlmForCausalLM(config).save_pretrained(tmp_path / "native")
    assert convert(str(tmp_path / "native"), tmp_path / "chatglm") == "chatglm"
    written = json.loads((tmp_path / "chatglm" / "config.json").read_text())
    assert (written["model_type"], written["rope_ratio"], written["kv_channels"]) == ("chatglm", 5.0, 12)
    assert convert(str(tmp_path / "chatglm"), tmp_path / "back", to="native") == "native"
    before, after = load_file(tmp_path / "native" / "model.safetensors"), read_weights(tmp_path / "back")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[key], after[key]) for key in before)


def test_convert_casts_and_follows_the_output_rules(tmp_path, glm4_dir):
    convert(str(glm4_dir), tmp_path / "bf16", dtype="bfloat16")
    assert {t.dtype for t in read_weights(tmp_path / "bf16").values()} == {torch.bfloat16}
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="no longalign stage wrote"):
        convert(str(glm4_dir), tmp_path / "mine")
    with pytest.raises(ConfigError, match="in the chatglm layout already"):
        convert(str(glm4_dir), tmp_path / "again", to="chatglm")


def test_run_saves_in_the_layout_it_loaded(tmp_path, glm4_dir):
    model = load_model(str(glm4_dir), dtype=torch.float32)
    save = checkpoints.layout_saver(str(glm4_dir), "auto", trust_remote_code=True)
    save(model, tmp_path / "out", None)
    for name in ("config.json", "tokenizer.model", "tokenizer_config.json", "modeling_chatglm.py"):
        assert (tmp_path / "out" / name).read_bytes() == (glm4_dir / name).read_bytes()
    saved, original = read_weights(tmp_path / "out"), read_weights(glm4_dir)
    assert saved.keys() == original.keys() - {"transformer.rotary_pos_emb.inv_freq"}
    assert all(torch.equal(saved[key], original[key]) for key in saved)
    assert checkpoints.layout_saver(str(glm4_dir), "native") is None


# --- refusals ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("multi_query_attention", False),
        ("add_bias_linear", True),
        ("apply_residual_connection_post_layernorm", True),
        ("rmsnorm", False),
        ("post_layer_norm", False),
        ("fp32_residual_connection", True),
        ("pre_seq_len", 16),
        ("rope_scaling", {"type": "linear", "factor": 2.0}),
        ("sliding_window", 4096),
    ],
)
def test_settings_the_mapping_does_not_cover_are_refused(tmp_path, ranks, marker, key, value):
    config = {**glm4_config(len(ranks)), key: value}
    path = write_checkpoint(tmp_path / "ckpt", marker=marker, ranks=ranks, config=config)
    with pytest.raises(ModelError, match=rf"config.json: {key}\b") as caught:
        load_model(str(path), trust_remote_code=True)
    assert "\n" not in str(caught.value)


def test_a_config_without_rope_ratio_is_refused_with_the_reason(tmp_path, ranks, marker):
    config = glm4_config(len(ranks))
    del config["rope_ratio"]
    path = write_checkpoint(tmp_path / "ckpt", marker=marker, ranks=ranks, config=config)
    with pytest.raises(ModelError, match="no rope_ratio.*fixed in its modeling code"):
        load_model(str(path))


def test_weights_without_a_place_are_refused_by_name(tmp_path, ranks, marker):
    path = write_checkpoint(tmp_path / "ckpt", marker=marker, ranks=ranks)
    extra = {"transformer.prefix_encoder.embedding.weight": torch.zeros(4, 4)}
    save_file(extra, path / "model-00003-of-00002.safetensors")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"]["transformer.prefix_encoder.embedding.weight"] = "model-00003-of-00002.safetensors"
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelError, match="transformer.prefix_encoder.embedding.weight: a ChatGLM weight"):
        load_model(str(path))


def test_a_missing_weight_is_refused_by_name(tmp_path, ranks, marker):
    path = write_checkpoint(tmp_path / "ckpt", marker=marker, ranks=ranks)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["transformer.output_layer.weight"]
    state = load_file(path / shard)
    del state["transformer.output_layer.weight"]
    save_file(state, path / shard)
    with pytest.raises(ModelError, match="no weight for lm_head.weight"):
        load_model(str(path))


def other_remote_checkpoint(path: Path, marker: Path, model_type: str) -> Path:
    path.mkdir()
    config = {
        "model_type": model_type,
        "auto_map": {
            "AutoConfig": "configuration_mine.MyConfig",
            "AutoModelForCausalLM": "modeling_mine.MyLM",
        },
        "hidden_size": 8,
    }
    (path / "config.json").write_text(json.dumps(config))
    for name in ("configuration_mine.py", "modeling_mine.py"):
        (path / name).write_text(remote_code(marker))
    return path


@pytest.mark.parametrize(
    ("model_type", "fix"), [("mymodel", "supported: "), ("llama", "without trust_remote_code")]
)
def test_other_remote_code_is_refused_before_any_import(tmp_path, marker, model_type, fix):
    from longalign.config import load_config
    from longalign.run import load_model as run_load_model
    from longalign.run import load_tokenizer, model_config

    path = other_remote_checkpoint(tmp_path / "remote", marker, model_type)
    run_file = tmp_path / "run.toml"
    run_file.write_text(f'[model]\nmodel_name_or_path = "{path}"\ntrust_remote_code = true\n')
    cfg = load_config(run_file, [f"training.output_dir={json.dumps(str(tmp_path / 'out'))}"])
    for step in (load_tokenizer, model_config, run_load_model):
        with pytest.raises(
            ModelError,
            match=rf"auto_map points to remote code \(configuration_mine, modeling_mine\) for model type '{model_type}'.*{fix}",
        ):
            step(cfg)


def test_a_sentencepiece_tokenizer_model_is_refused_with_the_reason(tmp_path, glm4_dir):
    copy = tmp_path / "chatglm3"
    shutil.copytree(glm4_dir, copy)
    (copy / "tokenizer.model").write_bytes(b"\x0a\x0b\x80\xff sentencepiece")
    with pytest.raises(ModelError, match="not a tiktoken rank file.*SentencePiece"):
        checkpoints.rank_file_tokenizer(copy)


def test_layout_note_says_remote_code_is_not_needed(glm4_dir):
    note = checkpoints.layout_note(str(glm4_dir), trust_remote_code=True)
    assert "GlmForCausalLM" in note and "trust_remote_code is not needed" in note
    assert checkpoints.layout_note(str(ROOT / "data" / "tokenizer")) is None


# --- the whole run -------------------------------------------------------------------------------------


def train_chatglm(tmp_path: Path, glm4_dir: Path, capsys, extra: str = "") -> Path:
    """Two training steps of a run file naming the ChatGLM-layout directory, with trust_remote_code, in this
    process as the console command runs them; the output. The checkpoint's own code is never imported."""
    run_file = tmp_path / "run.toml"
    run_file.write_text(
        "[data]\n"
        f'train_file = "{SAMPLE}"\n'
        "max_seq_len = 1024\n"
        "[training]\n"
        f'output_dir = "{tmp_path / "run"}"\n'
        'max_steps = 2\nlearning_rate = 1e-3\nuse_cpu = true\nreport_to = "none"\n'
        "save_steps = 1\nlogging_steps = 1\ndisable_tqdm = true\n"
        "[model]\n"
        f'model_name_or_path = "{glm4_dir}"\n'
        "trust_remote_code = true\n"
        'torch_dtype = "float32"\n' + extra
    )
    assert main(["train", "--config", str(run_file)]) == 0
    printed = capsys.readouterr().out
    assert "ChatGLM layout, read as GlmForCausalLM" in printed
    assert "trust_remote_code is not needed" in printed
    from_checkpoint = [
        name
        for name, module in list(sys.modules.items())
        if name.startswith("transformers_modules")
        or str(getattr(module, "__file__", "")).startswith(str(glm4_dir))
    ]
    assert not from_checkpoint  # the checkpoint's own code (modeling_chatglm.py) never ran
    return tmp_path / "run"


@pytest.mark.integration
def test_run_file_pre_tokenizes_trains_and_saves_in_the_chatglm_layout(tmp_path, glm4_dir, ranks, capsys):
    from datasets import load_from_disk

    out = train_chatglm(tmp_path, glm4_dir, capsys)
    for name in ("config.json", "tokenizer.model", "tokenizer_config.json", "modeling_chatglm.py"):
        assert (out / name).read_bytes() == (glm4_dir / name).read_bytes()
    saved, original = read_weights(out), read_weights(glm4_dir)
    assert saved.keys() == original.keys() - {"transformer.rotary_pos_emb.inv_freq"}
    key = "transformer.output_layer.weight"
    assert not torch.equal(saved[key], original[key])  # trained
    assert (out / "checkpoint-2" / "model.safetensors").is_file()  # checkpoints stay resumable
    dataset = load_from_disk(str(next((out / "data").glob("tokenized-*"))))
    chats = [json.loads(line)["messages"] for line in SAMPLE.read_text().splitlines()]
    tokenizer, reference = checkpoints.rank_file_tokenizer(glm4_dir), encoding(ranks)
    for row in dataset.select(range(5)):
        rendered = tokenizer.apply_chat_template(chats[row["line"] - 1], tokenize=False)
        # The last answer is closed with <|endoftext|> (the template has no end-of-turn token); long rows are cut.
        expected = reference.encode(rendered, allowed_special="all") + [len(ranks)]
        assert row["input_ids"] == expected[: len(row["input_ids"])]


@pytest.mark.integration
def test_lora_run_saves_an_adapter_for_the_chatglm_layout(tmp_path, glm4_dir, capsys):
    from longalign.lora import merge_adapter

    out = train_chatglm(tmp_path, glm4_dir, capsys, '[lora]\nr = 4\nalpha = 8.0\ntrainable = ["norms"]\n')
    settings = json.loads((out / "adapter_config.json").read_text())
    assert settings["target_modules"] == ["dense", "dense_4h_to_h", "dense_h_to_4h", "query_key_value"]
    assert settings["base_model_name_or_path"] == str(glm4_dir)
    assert (out / "tokenizer.model").read_bytes() == (glm4_dir / "tokenizer.model").read_bytes()
    merge_adapter(out, tmp_path / "merged")
    assert read_weights(tmp_path / "merged").keys() == read_weights(glm4_dir).keys() - {
        "transformer.rotary_pos_emb.inv_freq"
    }


def test_convert_command(tmp_path, glm4_dir, capsys):
    assert main(["convert", str(glm4_dir), str(tmp_path / "native")]) == 0
    assert "in the native layout" in capsys.readouterr().out
    assert main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"longalign convert: error: {tmp_path / 'nowhere'}: no config.json there "
        "(a checkpoint directory, or a Hub id in the local cache)"
    )


def test_preflight_names_the_layout(tmp_path, glm4_dir):
    from longalign.config import load_config
    from longalign.preflight import layout_check

    run_file = tmp_path / "run.toml"
    run_file.write_text(f'[model]\nmodel_name_or_path = "{glm4_dir}"\nsave_format = "native"\n')
    check = layout_check(load_config(run_file, [f"training.output_dir={json.dumps(str(tmp_path))}"]))
    assert check.value == (
        "ChatGLM layout, read as GlmForCausalLM (weights renamed in memory, its code not run); "
        "saved as GlmForCausalLM (model.save_format = native)"
    )


# --- adapters ------------------------------------------------------------------------------------------


def adapted_model(glm4_dir: Path, target_modules: list[str] | None = None):
    """The fixture in float64 with LoRA adapters (random B, so every adapter changes its layer) and trained norms."""
    from longalign.config import LoraConfig
    from longalign.lora import add_adapters

    settings = LoraConfig(r=2, alpha=6.0, target_modules=target_modules, trainable=["embeddings", "norms"])
    model = add_adapters(load_model(str(glm4_dir), dtype=torch.float64), settings, base_model=str(glm4_dir))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                param.add_(torch.randn(param.shape, generator=gen, dtype=param.dtype) * 0.1)
    return model


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("targets", [None, ["q_proj", "v_proj", "down_proj"]])
def test_adapter_saved_for_the_chatglm_layout_makes_the_same_update(tmp_path, glm4_dir, targets):
    from longalign.lora import adapter_saver

    model = adapted_model(glm4_dir, targets)
    adapter_saver(str(glm4_dir), "auto")(model, tmp_path / "adapter", None)
    assert adapter_saver(str(glm4_dir), "native") is None
    settings = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    state = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    fused = 3 if targets is None else 2
    assert settings["rank_pattern"] == {"query_key_value": 2 * fused}
    assert settings["alpha_pattern"] == {"query_key_value": 6.0 * fused}
    assert "transformer.encoder.final_layernorm" in settings["modules_to_save"]
    assert (tmp_path / "adapter" / "tokenizer.model").read_bytes() == (
        glm4_dir / "tokenizer.model"
    ).read_bytes()
    base = {key: value.double() for key, value in read_weights(glm4_dir).items()}
    merged = chatglm_layout.to_chatglm(model.merge_and_unload().state_dict())
    adapted = {key.removesuffix(".lora_A.weight") for key in state if key.endswith(".lora_A.weight")}
    assert len(adapted) == NUM_LAYERS * (4 if targets is None else 2)
    for module in adapted:  # what the remote-code model with this adapter computes: W + B A alpha / r
        leaf = module.rsplit(".", 1)[1]
        scale = settings["alpha_pattern"].get(leaf, 6.0) / settings["rank_pattern"].get(leaf, 2)
        update = scale * state[f"{module}.lora_B.weight"] @ state[f"{module}.lora_A.weight"]
        name = module.removeprefix(chatglm_layout.PEFT_PREFIX) + ".weight"
        assert relative(base[name] + update, merged[name]) < 1e-12, name
    trained = chatglm_layout.PEFT_PREFIX + "transformer.embedding.word_embeddings.weight"
    assert torch.equal(state[trained], merged["transformer.embedding.word_embeddings.weight"])


def test_merge_writes_the_chatglm_layout_of_its_base(tmp_path, glm4_dir):
    from longalign.lora import adapter_saver, merge_adapter

    model = adapted_model(glm4_dir)
    adapter_saver(str(glm4_dir), "auto")(model, tmp_path / "adapter", None)
    expected = chatglm_layout.to_chatglm(model.merge_and_unload().state_dict())
    merge_adapter(tmp_path / "adapter", tmp_path / "merged", dtype="float64")
    merged = read_weights(tmp_path / "merged")
    assert merged.keys() == expected.keys()
    assert max(relative(merged[key], expected[key]) for key in merged) < 1e-12
    for name in ("config.json", "tokenizer.model", "modeling_chatglm.py"):
        assert (tmp_path / "merged" / name).read_bytes() == (glm4_dir / name).read_bytes()


def test_a_hub_id_is_read_from_the_local_cache_only(tmp_path, glm4_dir, ranks, monkeypatch):
    import huggingface_hub.constants

    snapshot = tmp_path / "hub" / "models--THUDM--glm-4-tiny" / "snapshots" / ("0" * 40)
    shutil.copytree(glm4_dir, snapshot)
    (tmp_path / "hub" / "models--THUDM--glm-4-tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--THUDM--glm-4-tiny" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert checkpoints.local_dir("THUDM/glm-4-tiny") == snapshot
    assert checkpoints.local_dir("THUDM/not-cached") is None
    assert type(load_model("THUDM/glm-4-tiny", trust_remote_code=True)) is GlmForCausalLM
    from longalign.chat_template import open_tokenizer

    tokenizer = open_tokenizer("THUDM/glm-4-tiny", trust_remote_code=True)
    assert tokenizer.encode("Grüße 42", add_special_tokens=False) == encoding(ranks).encode_ordinary(
        "Grüße 42"
    )


def test_save_format_names_its_values(tmp_path):
    from longalign.config import load_config

    run_file = tmp_path / "run.toml"
    run_file.write_text('[model]\nmodel_name_or_path = "x"\nsave_format = "chatglm3"\n')
    with pytest.raises(ConfigError, match="model.save_format: 'chatglm3' is not one of auto, native"):
        load_config(run_file, [])


# --- config overrides ----------------------------------------------------------------------------------


def llama_checkpoint(path: Path) -> Path:
    """A tiny random Llama saved as a pretrained checkpoint, with a 1024-token window and RoPE base 500k."""
    tiny_model(max_position_embeddings=1024, rope_theta=500000.0).save_pretrained(path)
    return path


def test_yarn_replaces_the_scaling_and_keeps_the_base_and_the_window_it_starts_from(tmp_path):
    config = checkpoints.model_config(str(llama_checkpoint(tmp_path / "llama")))
    overrides = {"max_position_embeddings": 4096, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}
    yarn = checkpoints.override_config(config, overrides)
    assert yarn.max_position_embeddings == 4096
    # transformers alone would give a table without rope_theta the default 10000
    assert yarn.rope_parameters == {
        "rope_type": "yarn",
        "factor": 4.0,
        "rope_theta": 500000.0,
        "original_max_position_embeddings": 1024,
    }
    assert overrides == {
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0},
    }
    assert config.rope_parameters == {"rope_theta": 500000.0, "rope_type": "default"}  # not changed in place
    more = checkpoints.override_config(
        yarn, {"rope_parameters": {"factor": 8.0}, "max_position_embeddings": 8192}
    )
    assert (
        more.rope_parameters["factor"] == 8.0
        and more.rope_parameters["original_max_position_embeddings"] == 1024
    )
    # a top-level rope_theta, which transformers ignores next to a table that has one
    assert checkpoints.override_config(config, {"rope_theta": 1e6}).rope_parameters == {
        "rope_theta": 1e6,
        "rope_type": "default",
    }


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rope_parameters": {"rope_type": "yarn", "factr": 4.0}},
         "model.config_overrides.rope_parameters.factr: not a RoPE setting; did you mean 'factor'?"),
        ({"rope_parameters": {"rope_type": "yarn"}},
         "model.config_overrides: Missing required keys in `rope_parameters` for 'rope_type'='yarn': {'factor'}"),
        ({"rope_parameters": {"factor": 2.0}},  # the checkpoint's plain RoPE has no factor
         "model.config_overrides.rope_parameters: Unrecognized keys in `rope_parameters` for 'rope_type'='default': "
         "{'factor'}"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}, "max_position_embeddings": 8192},  # not 4096
         "model.config_overrides.rope_parameters: The explicitly set RoPE scaling factor"),
    ],
)  # fmt: skip
def test_rope_settings_transformers_would_only_warn_about_are_refused(tmp_path, overrides, message, capsys):
    config = checkpoints.model_config(str(llama_checkpoint(tmp_path / "llama")))
    with pytest.raises(ConfigError) as err:
        checkpoints.override_config(config, overrides)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)
    assert "rope_parameters" not in capsys.readouterr().err  # said once, in the error


def test_chatglm_overrides_map_back_onto_its_config_json(glm4_dir):
    config = checkpoints.model_config(str(glm4_dir))
    overrides = {"rope_theta": 10000.0 * 8, "max_position_embeddings": 8192}
    longer = checkpoints.override_config(config, overrides)
    assert longer.rope_parameters == {
        "rope_theta": 80000.0,
        "partial_rotary_factor": 0.5,
        "rope_type": "default",
    }
    saved = chatglm_layout.chatglm_config(longer)
    original = json.loads((glm4_dir / "config.json").read_text())
    assert saved == {**original, "rope_ratio": 8.0, "seq_length": 8192}


def test_what_the_chatglm_layout_cannot_hold_is_refused_unless_saved_natively(tmp_path, glm4_dir):
    config = checkpoints.model_config(str(glm4_dir))
    yarn = {"max_position_embeddings": 8192, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}
    with pytest.raises(ConfigError) as err:
        checkpoints.override_config(config, yarn)
    assert str(err.value) == (
        "model.config_overrides.rope_parameters: the ChatGLM layout holds plain RoPE on half of each head, base "
        '10000 x rope_ratio, not rope_parameters = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 30000.0, '
        '"partial_rotary_factor": 0.5, "original_max_position_embeddings": 2048}; set model.save_format = '
        '"native" to train and save it as GlmForCausalLM'
    )
    with pytest.raises(
        ConfigError, match="model.config_overrides.hidden_act: the ChatGLM layout has no place"
    ):
        checkpoints.override_config(config, {"hidden_act": "gelu"})
    native = checkpoints.override_config(config, yarn, save_format="native")
    assert native.rope_parameters["rope_type"] == "yarn" and not hasattr(native, chatglm_layout.RECORD_KEY)
    GlmForCausalLM(native).save_pretrained(tmp_path / "native")
    with pytest.raises(ModelError, match="the ChatGLM layout rotates half of each head with plain RoPE"):
        convert(str(tmp_path / "native"), tmp_path / "chatglm")


@pytest.mark.integration
def test_a_chatglm_checkpoint_trains_past_its_window_with_a_new_base_and_is_saved_back_with_it(
    tmp_path, glm4_dir
):
    from longalign.config import load_config
    from longalign.run import build_trainer, close, release

    def run(overrides: str):
        run_file = tmp_path / "run.toml"
        run_file.write_text(
            f"[data]\ntrain_file = '{window_packs(tmp_path / 'packs', vocab_size=VOCAB_RANKS)}'\nmax_seq_len = 4096\n"
            f"[training]\noutput_dir = '{tmp_path / 'run'}'\nmax_steps = 2\nlearning_rate = 1e-2\nuse_cpu = true\n"
            "save_steps = 1\nreport_to = 'none'\ndisable_tqdm = true\n"
            f"[model]\nmodel_name_or_path = '{glm4_dir}'\ntorch_dtype = 'float32'\nattn_backend = 'sdpa_segments'\n"
            f"config_overrides = {overrides}\n"
        )
        return build_trainer(load_config(run_file))

    yarn = '{ max_position_embeddings = 8192, rope_parameters = { rope_type = "yarn", factor = 4.0 } }'
    with pytest.raises(
        ConfigError, match='set model.save_format = "native" to train and save it as GlmForCausalLM'
    ):
        run(yarn)  # refused before anything is trained
    trainer = run("{ rope_theta = 80000.0, max_position_embeddings = 4096 }")  # the samples run to 4096
    trainer.train()
    trainer.save_model()
    out = tmp_path / "run"
    original = json.loads((glm4_dir / "config.json").read_text())
    assert json.loads((out / "config.json").read_text()) == {
        **original,
        "rope_ratio": 8.0,
        "seq_length": 4096,
    }
    assert (out / "tokenizer.model").read_bytes() == (glm4_dir / "tokenizer.model").read_bytes()
    back = checkpoints.convert(str(out / "checkpoint-2"), tmp_path / "from-checkpoint")  # native -> ChatGLM
    assert (
        back == "chatglm"
        and json.loads((tmp_path / "from-checkpoint" / "config.json").read_text())["rope_ratio"] == 8.0
    )
    row = datasets.load_from_disk(str(tmp_path / "packs"))[1]  # samples of 3000 and 1096 tokens
    training_model = trainer.model.double().eval()
    loaded = load_model(str(out), dtype=torch.float64).eval()  # as longalign eval loads it
    assert packed_logits_error(training_model, loaded, row) < FLOAT64_BOUND
    # What the layout's own code computes from the saved config.json: the forward written from the architecture.
    ids = row["input_ids"][:3000]  # positions past the checkpoint's 2048
    with torch.no_grad():
        logits = loaded(input_ids=torch.tensor([ids])).logits[0]
    saved = json.loads((out / "config.json").read_text())
    assert relative_error(logits, reference_logits(read_weights(out), saved, ids)) < 1e-5
    release(trainer)
    close()


def test_a_chatglm_window_too_short_for_the_samples_names_what_the_layout_can_hold(tmp_path, glm4_dir):
    from longalign.config import load_config
    from longalign.run import check_positions

    packs = datasets.load_from_disk(str(window_packs(tmp_path / "packs", vocab_size=VOCAB_RANKS)))
    cfg = load_config(None, [f"model.model_name_or_path='{glm4_dir}'"])
    with pytest.raises(ConfigError) as err:
        check_positions(checkpoints.model_config(str(glm4_dir)), packs, "the training data", cfg)
    assert str(err.value) == (
        "the training data: samples of up to 4096 tokens are longer than the model's max_position_embeddings = "
        "2048 (positions restart with each sample: each sample must fit); extend it with model.config_overrides "
        "= { max_position_embeddings = 4096, rope_theta = ... } (a larger base), or rope_parameters = { rope_type = "
        '"yarn", factor = 2.0 } with model.save_format = "native", or leave the longer samples out '
        "(data.max_seq_len_filter = 2048)"
    )


def test_mxfp4_experts_load_dequantized_for_training(tmp_path, monkeypatch):
    """gpt-oss as published: MXFP4 experts (blocks of 4-bit values, a power-of-two scale per 32). Even where
    MXFP4's kernels would run (Triton and the ``kernels`` package present, as on a GPU), the experts load as
    trainable bf16 weights, each the dequantized value of its blocks, and no kernel is fetched from the hub."""
    from transformers import GptOssConfig, GptOssForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    from transformers.quantizers import quantizer_mxfp4

    torch.manual_seed(0)
    config = GptOssConfig(
        vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )  # fmt: skip
    GptOssForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    state = load_file(tmp_path / "bf16" / "model.safetensors")
    packed = {}
    for key in [key for key in state if key.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = state.pop(key).shape
        blocks = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), dtype=torch.uint8)
        scales = torch.randint(124, 130, (experts, outputs, inputs // 32), dtype=torch.uint8)
        state[f"{key}_blocks"], state[f"{key}_scales"], packed[key] = blocks, scales, (blocks, scales)
    (tmp_path / "mxfp4").mkdir()
    save_file(state, tmp_path / "mxfp4" / "model.safetensors", metadata={"format": "pt"})
    published = json.loads((tmp_path / "bf16" / "config.json").read_text())
    published["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(published))
    monkeypatch.setattr(quantizer_mxfp4, "is_triton_available", lambda *args, **kwargs: True)
    monkeypatch.setattr(quantizer_mxfp4, "is_kernels_available", lambda *args, **kwargs: True)

    model = load_model(str(tmp_path / "mxfp4"), dtype=torch.bfloat16)
    weights = dict(model.named_parameters())
    assert not getattr(model, "is_quantized", False)
    for key, (blocks, scales) in packed.items():
        assert weights[key].dtype == torch.bfloat16 and weights[key].requires_grad, key
        assert torch.equal(weights[key], convert_moe_packed_tensors(blocks, scales)), key

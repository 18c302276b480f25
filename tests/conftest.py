"""What many tests share: paths, tiny models from config, hand-written pack rows, the two-rank launcher.

Plain helpers are imported by name (``from conftest import tiny_model``); fixtures are used as arguments.
Tests that start processes (scripts, ``accelerate launch``, end-to-end runs) are marked ``integration``.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoTokenizer,
    Glm4Config,
    Glm4ForCausalLM,
    GlmConfig,
    GlmForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

ROOT = Path(__file__).resolve().parents[1]
# tests/test_docs.py's account of the commands README.md and docs/ show, printed at the end of the run.
DOCS_REPORT = pytest.StashKey[str]()
TOKENIZER = ROOT / "data" / "tokenizer"
SAMPLE = ROOT / "data" / "sample.jsonl"
DEMO = ROOT / "configs" / "demo.toml"
LAUNCHER = Path(sys.executable).parent / "accelerate"

needs_launcher = pytest.mark.skipif(not LAUNCHER.exists(), reason="accelerate launcher not installed")
needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="DeepSpeed not installed (the sp extra)"
)

# A 2-layer decoder with grouped-query attention; every family below takes these fields.
TINY = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
FAMILIES = {
    "llama": (LlamaForCausalLM, LlamaConfig),
    "glm": (GlmForCausalLM, GlmConfig),  # partial rotary: half of each head rotates
    "glm4": (Glm4ForCausalLM, Glm4Config),
    "mistral": (MistralForCausalLM, MistralConfig),  # the generic path
    "qwen2": (Qwen2ForCausalLM, Qwen2Config),  # the generic path
    "qwen3": (Qwen3ForCausalLM, Qwen3Config),  # the generic path; norms on queries and keys
    "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig),  # mixture of experts: give it MOE's fields too
}


def tiny_model(
    kind: str = "llama",
    *,
    seed: int = 0,
    backend: str | None = None,
    sequence_parallel_size: int = 1,
    **overrides,
) -> torch.nn.Module:
    """A random tiny model of ``kind`` (``TINY`` with ``overrides``), patched for ``backend`` if given."""
    import longalign.patch

    cls, config_cls = FAMILIES[kind]
    torch.manual_seed(seed)
    model = cls(config_cls(**{**TINY, **overrides}))
    if backend is None:
        return model
    return longalign.patch.apply(model, backend=backend, sequence_parallel_size=sequence_parallel_size)


# A tiny mixture of experts (with "qwen3_moe"): 4 experts, top-2, router loss on with coefficient 0.5.
MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    router_aux_loss_coef=0.5,
    output_router_logits=True,
)


def tiny_moe(
    *, backend: str | None = "sdpa_segments", dtype: torch.dtype = torch.float64, **overrides
) -> torch.nn.Module:
    """The tiny Qwen3-MoE (float64 unless asked), its routers' weights scaled up so that routing is far
    from uniform; ``overrides`` go to :func:`tiny_model`."""
    model = tiny_model("qwen3_moe", backend=backend, **{**MOE, **overrides}).to(dtype)
    model.set_experts_implementation("eager")  # grouped_mm has no float64 kernel on CPU
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.mul_(20)
    return model


# Identities checked in float32 are compared by the norm of the difference over the norm of the reference:
# float32 kernels round differently on different CPUs (vector width, threads), element by element, but
# their relative error over a whole tensor stays near 1e-7. A real fault (a leak between samples, a lost
# boundary label, a wrong normaliser) moves it by 1e-3 or more.
FLOAT32_BOUND = 1e-5
FLOAT64_BOUND = 1e-10  # the same identities computed in float64: rounding near 1e-16, far below it


def _float64(value) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().double()
    return torch.tensor(value, dtype=torch.float64)  # a Python float keeps its 53 bits


def relative_error(actual, expected) -> float:
    """``||actual - expected|| / ||expected||`` in float64; dicts and sequences of tensors count as one.

    ``relative_error(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0 + 1e-6]))`` is about 4.5e-7.
    """
    if isinstance(expected, dict):
        assert actual.keys() == expected.keys(), (sorted(actual), sorted(expected))
        actual, expected = [actual[k] for k in expected], list(expected.values())
    if isinstance(expected, list | tuple):
        actual = torch.cat([_float64(a).reshape(-1) for a in actual])
        expected = torch.cat([_float64(e).reshape(-1) for e in expected])
    actual, expected = _float64(actual), _float64(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    scale = expected.norm()
    return float((actual - expected).norm() / scale) if scale > 0 else float(actual.norm())


def assert_relatively_close(actual, expected, bound: float = FLOAT32_BOUND) -> None:
    """``relative_error(actual, expected) <= bound``, saying the error when it is not."""
    error = relative_error(actual, expected)
    assert error <= bound, f"relative error {error:.3g} > {bound:g}"


def save_tiny_model(path: Path, *, max_position_embeddings: int) -> Path:
    """A tiny random Llama with the shipped tokenizer, saved at ``path`` as a run saves its output."""
    tiny_model("llama", vocab_size=4096, max_position_embeddings=max_position_embeddings).save_pretrained(
        path
    )
    AutoTokenizer.from_pretrained(TOKENIZER).save_pretrained(path)
    return path


def assert_packed_scoring_is_exact(sequences: list[tuple[list[int], list[int]]], *, pack_tokens: int) -> None:
    """``score_answers`` in packed rows == one prompt at a time == the plain model's full logits (float64)."""
    from longalign.eval.needle import score_answers

    plain = tiny_model("llama", vocab_size=4096, max_position_embeddings=1024).double().eval()
    reference = []
    with torch.inference_mode():
        for prompt, answer in sequences:
            logits = plain(input_ids=torch.tensor([prompt + answer])).logits[0]
            logprobs = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
            reference.append(float(logprobs.gather(1, torch.tensor(answer)[:, None]).mean()))
    model = tiny_model(
        "llama", vocab_size=4096, max_position_embeddings=1024, backend="sdpa_segments"
    ).double()
    alone = score_answers(model.eval(), sequences, pack_tokens=1)
    packed = score_answers(model, sequences, pack_tokens=pack_tokens)
    for one, many, ref in zip(alone, packed, reference, strict=True):
        assert one.logprob == pytest.approx(ref, rel=1e-10)
        assert many.logprob == pytest.approx(ref, rel=1e-10)
        assert (one.greedy, one.predicted) == (many.greedy, many.predicted)


def pack_row(samples: list[tuple[list[int], list[int]]]) -> dict[str, list[int]]:
    """One pack row from ``(input_ids, labels)`` samples, as the pack stage writes it."""
    seq_lens = [len(ids) for ids, _ in samples]
    return {
        "input_ids": [t for ids, _ in samples for t in ids],
        "labels": [t for _, labels in samples for t in labels],
        "cu_seqlens": [sum(seq_lens[:i]) for i in range(len(seq_lens) + 1)],
        "seq_lens": seq_lens,
    }


def count_packs(per_pack: list[list[int]]) -> list[dict[str, list[int]]]:
    """Pack rows of the given sample lengths whose tokens (and labels) are 1, 2, 3, ..."""
    rows = []
    for seq_lens in per_pack:
        ids = list(range(1, sum(seq_lens) + 1))
        offsets = [sum(seq_lens[:i]) for i in range(len(seq_lens) + 1)]
        rows.append(pack_row([(ids[a:b], ids[a:b]) for a, b in zip(offsets, offsets[1:], strict=False)]))
    return rows


def save_packs(path: Path, rows: list[dict]) -> Path:
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def window_packs(path: Path, *, vocab_size: int) -> Path:
    """4096-token packs of random tokens whose samples run past a 1024-token window (up to 4096 tokens)."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for seq_lens in ([4096], [3000, 1096], [1000, 2000, 1096]):
        samples = [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in seq_lens]
        rows.append(pack_row([(ids, ids) for ids in samples]))
    return save_packs(path, rows)


def packed_logits_error(packed_model, alone_model, row: dict) -> float:
    """The largest relative error between ``packed_model``'s logits on the packed ``row`` (varlen, as the run
    trains) and ``alone_model``'s on each of its samples alone (as inference runs them)."""
    from longalign.batching import PackCollator

    batch = PackCollator()([row])
    keys = ("input_ids", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    starts = row["cu_seqlens"]
    with torch.no_grad():
        packed = packed_model(**{key: batch[key] for key in keys}).logits[0]
        return max(
            relative_error(
                alone_model(torch.tensor([row["input_ids"][start:end]])).logits[0], packed[start:end]
            )
            for start, end in zip(starts, starts[1:], strict=False)
        )


def packed_and_alone(
    packed_model, alone_model, lengths: list[int], *, vocab_size: int = 64
) -> tuple[dict, dict]:
    """One packed row of random samples of ``lengths`` through ``packed_model`` (the collator's keys), and each
    sample alone through ``alone_model``; both backward from the summed next-token loss of every sample.

    Returns ``({"logits", "grads"}, {"logits", "grads"})``: the logits of the whole row (the samples' alone,
    concatenated) and the gradients by parameter name.
    """
    ids = torch.randint(3, vocab_size, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    cu_seqlens = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32)
    batch = {
        "input_ids": ids,
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        "cu_seq_lens_q": cu_seqlens,
        "cu_seq_lens_k": cu_seqlens,
        "max_length_q": max(lengths),
        "max_length_k": max(lengths),
    }
    parts = [
        slice(start, end)
        for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True)
    ]

    def loss(logits: torch.Tensor, part: slice) -> torch.Tensor:
        return F.cross_entropy(logits[0, :-1], ids[0, part][1:], reduction="sum")

    packed = packed_model(**batch).logits
    sum(loss(packed[:, part], part) for part in parts).backward()
    alone = [alone_model(input_ids=ids[:, part]).logits for part in parts]
    sum(loss(logits, part) for logits, part in zip(alone, parts, strict=True)).backward()
    return (
        {"logits": packed, "grads": {name: p.grad for name, p in packed_model.named_parameters()}},
        {
            "logits": torch.cat(alone, dim=1),
            "grads": {name: p.grad for name, p in alone_model.named_parameters()},
        },
    )


def make_samples(lengths: list[int], seed: int = 0, sources: list[int] | None = None) -> dict[str, list]:
    """Pre-tokenize-shaped columns with random tokens, some labels masked, lines 1-based with gaps."""
    rng = np.random.default_rng(seed)
    input_ids = [rng.integers(0, 1000, n).tolist() for n in lengths]
    labels = [[-100 if rng.random() < 0.4 else t for t in ids] for ids in input_ids]
    return {
        "input_ids": input_ids,
        "labels": labels,
        "length": lengths,
        "num_targets": [sum(t != -100 for t in lab) for lab in labels],
        "line": [3 * i + 1 for i in range(len(lengths))],
        "source": sources if sources is not None else [0] * len(lengths),
    }


def save_samples(columns: dict[str, list], path: Path) -> Path:
    """``columns`` saved as pre-tokenize saves its output."""
    from longalign.tokenize import SAMPLE_FEATURES

    # The pre-tokenize stage's own schema; several shards, so there are several record batches to gather from.
    dataset = datasets.Dataset.from_dict(columns, features=SAMPLE_FEATURES)
    dataset.save_to_disk(str(path), num_shards=max(1, min(3, len(dataset))))
    return path


def load_script(name: str):
    """``scripts/<name>.py`` as a module, to call its functions."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


OFFLINE = Path(__file__).resolve().parent / "offline"  # its sitecustomize.py blocks all but the loopback


@pytest.fixture
def no_network(monkeypatch):
    """In this process only 127.0.0.1 can be reached (as under ``network_blocked_env``), the hub offline."""
    spec = importlib.util.spec_from_file_location("offline_guard", OFFLINE / "sitecustomize.py")
    guard = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(guard)
    monkeypatch.setattr(socket.socket, "connect", guard.guarded(socket.socket.connect))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def network_blocked_env() -> dict[str, str]:
    """Environment variables under which started processes (every rank of a launch) reach only the loopback."""
    return {"PYTHONPATH": str(OFFLINE), "HF_HUB_OFFLINE": "1"}


def run_process(cmd: list[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` that ends the whole process tree on a timeout.

    Ranks started by a launcher (and datasets' pool workers) hold its output pipes: killing only the
    process we started would leave the test waiting for them. The command gets a session of its own,
    and the whole session is killed when the time is up or the test is stopped.
    """
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs
    ) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except BaseException as stopped:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            out, err = process.communicate()
            if isinstance(stopped, subprocess.TimeoutExpired):
                raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
            raise
    return subprocess.CompletedProcess(cmd, process.returncode, out, err)


def killed_once(
    cmd: list[str], *, ready: Callable[[], bool], what: str, timeout: float = 300, **kwargs
) -> int:
    """Run ``cmd`` in a session of its own until ``ready()`` holds, then ``kill -9`` the session; its return code.

    ``ready`` reads a sign the command leaves (a line in a file it writes) while the test holds it mid-work;
    the command failing first, or no sign within ``timeout`` seconds (``what`` says which), fails the test.
    """
    process = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, **kwargs
    )
    try:
        deadline = time.monotonic() + timeout
        while not ready():
            assert process.poll() is None, process.communicate()[1].decode()[-2000:]
            assert time.monotonic() < deadline, f"the command never {what}"
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
    return process.returncode


@contextlib.contextmanager
def kept_kernel_calls(backend: str):
    """Within the block, every call of ``backend``'s per-key/value-head forward and backward
    (``longalign.attention._KEPT_FUNCTIONS``), in order: the yielded list fills with "forward" and "backward"."""
    from longalign import attention

    kept, calls = attention._KEPT_FUNCTIONS[backend], []

    def counted(step, function):
        def run(*args):
            calls.append(step)
            return function(*args)

        return run

    recorded = kept._replace(
        forward=counted("forward", kept.forward), backward=counted("backward", kept.backward)
    )
    with pytest.MonkeyPatch.context() as patched:
        patched.setitem(attention._KEPT_FUNCTIONS, backend, recorded)
        yield calls


def launch(
    script: Path | str,
    *args: str,
    num_processes: int = 2,
    env: dict[str, str] | None = None,
    cwd: Path | str | None = None,
    timeout: float = 300,
) -> subprocess.CompletedProcess:
    """``accelerate launch`` of ``script`` on ``num_processes`` CPU ranks (gloo); output captured."""
    environment = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", **(env or {})}
    cmd = [str(LAUNCHER), "launch", "--multi_gpu", "--num_processes", str(num_processes),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", "0", str(script), *args]  # fmt: skip
    return run_process(cmd, env=environment, timeout=timeout, cwd=cwd)


def launch_with_config(
    accelerate_config: str, *args: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """``accelerate launch --config_file configs/accelerate/<accelerate_config>`` on 2 ranks, as a user would.

    Each rank runs on CPU by the demo run file's ``use_cpu``, or by the launcher's ``ACCELERATE_USE_CPU``
    when ``env`` sets it (what ``--cpu`` does).
    """
    cmd = [str(LAUNCHER), "launch", "--config_file", str(ROOT / "configs" / "accelerate" / accelerate_config),
           "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", "0", *args]  # fmt: skip
    return run_process(
        cmd, timeout=timeout, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    )


def demo_overrides(output_dir: Path, train_file: Path | str) -> list[str]:
    """Overrides that point the demo config at test data and output, with the shipped tokenizer."""
    return [
        f"data.train_file={json.dumps(str(train_file))}",
        f"training.output_dir={json.dumps(str(output_dir))}",
        f"model.tokenizer={json.dumps(str(TOKENIZER))}",
    ]


def demo_train_arguments(
    tokenized: Path, output_dir: Path, *overrides: str, max_seq_len: int = 1024
) -> list[str]:
    """train.py's arguments: the demo config on ``tokenized`` data, logging and saving every few steps."""
    return [
        "--config", str(DEMO), *demo_overrides(output_dir, tokenized), f"data.max_seq_len={max_seq_len}",
        "training.logging_steps=1", "training.save_steps=2", "training.eval_strategy='no'",
        "training.disable_tqdm=true", *overrides,
    ]  # fmt: skip


def train_demo(tokenized: Path, output_dir: Path, *overrides: str, max_seq_len: int = 1024) -> None:
    """``longalign train`` with :func:`demo_train_arguments`, in this process, as the console command runs it
    (tests/test_cli.py runs ``train.py`` as a process); what it prints goes to the test's ``capsys``."""
    from longalign.cli import main

    arguments = demo_train_arguments(tokenized, output_dir, *overrides, max_seq_len=max_seq_len)
    assert main(["train", *arguments]) == 0


def step_losses(output_dir: Path) -> dict[int, float]:
    """The logged training loss of every step of the run in ``output_dir``."""
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return {entry["step"]: entry["loss"] for entry in state["log_history"] if "loss" in entry}


@pytest.fixture(scope="session")
def sample_tokenizer():
    """The shipped 4096-entry tokenizer with its Llama-3-style template."""
    return AutoTokenizer.from_pretrained(TOKENIZER)


@pytest.fixture(scope="session")
def tokenized_sample(tmp_path_factory, sample_tokenizer) -> Path:
    """``data/sample.jsonl`` pre-tokenized at 1024 tokens (truncated on the right)."""
    from longalign.tokenize import pre_tokenize

    out = tmp_path_factory.mktemp("sample") / "tokenized"
    pre_tokenize(SAMPLE, sample_tokenizer, out, max_seq_len=1024)
    return out


@pytest.fixture(scope="module")
def base_tokenizer(sample_tokenizer):
    """The shipped tokenizer, a module's own copy (tests give copies other templates)."""
    return copy.deepcopy(sample_tokenizer)


@pytest.fixture(scope="module")
def glm_tokenizer(base_tokenizer):
    """The shipped vocabulary with a GLM-4-style template and its role tokens."""
    from templates import GLM4_STYLE, with_template

    tok = with_template(base_tokenizer, GLM4_STYLE)
    tok.add_special_tokens(
        {"additional_special_tokens": ["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>"]}
    )
    return tok


if os.environ.get("PYTEST_XDIST_WORKER"):
    # The test command runs two workers on the machine's cores: one thread each (and in the processes they
    # start), or the workers' thread pools spin against each other.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pytest_sessionfinish(session):
    """A worker of a distributed run hands its docs report to the controller, which prints it."""
    report = session.config.stash.get(DOCS_REPORT, None)
    if report and hasattr(session.config, "workeroutput"):
        session.config.workeroutput["docs_report"] = report


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    report = getattr(node, "workeroutput", {}).get("docs_report")
    if report:
        node.config.stash[DOCS_REPORT] = report


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The documented commands: how many ran, and why each of the others does not (tests/test_docs.py)."""
    report = config.stash.get(DOCS_REPORT, None)
    if report:
        terminalreporter.write_sep("-", "commands in README.md and docs/")
        terminalreporter.write_line(report)


def counted_real_steps(work: Path, lengths: list[int], overrides: list[str], *, key: str = "peak_bytes"):
    """The CPU probe's counted peak (``tensor_peak_bytes``) of real steps of the demo run at each of ``lengths``,
    all in one run, and the run's config: a pack of each length twice, in the sampler's order, and for each
    length the least peak (``key``: of all parts, or of ``activations_peak_bytes``) of its steps after the first. The first step makes the optimizer's states; under
    DDP the second also rebuilds DDP's gradient buckets in the order the gradients came, which the counter
    sees as new memory (the old buckets existed before it counted)."""
    from longalign.config import load_config
    from longalign.probe import synthetic_pack
    from longalign.probe_step import measure_steps, probe_overrides
    from longalign.run import build_trainer, close, release

    packs = [synthetic_pack(length, vocab_size=4096, longest=max(lengths)) for length in lengths] * 2
    datasets.Dataset.from_list(packs).save_to_disk(str(work / "packs"))
    settings = probe_overrides(max(lengths), train_file=work / "packs", output_dir=work / "run")
    settings += [f"training.max_steps={len(packs)}", f"model.tokenizer='{TOKENIZER}'", *overrides]
    cfg = load_config(DEMO, settings)
    trainer = build_trainer(cfg)
    try:
        steps = measure_steps(trainer)["counted_steps"][1:]
    finally:
        release(trainer)
        close()
    split = cfg.training.sequence_parallel_size
    peaks = {length: min(s[key] for s in steps if s["tokens"] * split == length) for length in lengths}
    return peaks, cfg


def frame_ids(tokenizer) -> tuple[list[int], list[int]]:
    """The token ids of the chat template's text before and after a user message (generation prompt included)."""
    from longalign.eval.models import chat_frame

    frame = chat_frame(tokenizer)
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    return encode(frame.before), encode(frame.after)

"""GPU check, one script: every GPU attention backend against ``sdpa_segments``, a packed training step on
each, QLoRA's step, packed training speed, and what long packs cost per token; one JSON and one Markdown
report of it all.

    python benchmarks/gpu_check.py [--tokens 8192 32768 65536] [--steps 3] [--ladder 64k,128k,256k,512k]
                                   [--report out/gpu_check]

Without CUDA it says so in one line and exits 2, before building anything. With CUDA:

1. backends: which ones run here, and why the others do not;
2. agreement: a long-tail pack (single-token and odd-length samples, GQA 16/4 heads, head_dim 128) in
   bfloat16 through each runnable GPU backend, without and with a sliding window. Output and q/k/v
   gradients are compared with ``sdpa_segments`` in float32 on the same inputs; a backend passes when its
   error is at most a small multiple of the error ``sdpa_segments`` itself makes in bfloat16 (plus a floor);
3. a training step: two Llama-3.1-8B-shaped layers (below), bf16, one packed forward and backward of 8k
   tokens with each runnable GPU backend against the same step with ``sdpa_segments``: every parameter's
   gradient within ``STEP_BOUND`` by norm (the bound the CPU tests hold the kernels' Python layers to);
4. QLoRA: one step of the run's trainer with ``[lora] load_in_4bit`` (NF4, double quantization) on a
   small Llama: loss, time, peak memory;
5. throughput: a small Llama (bfloat16, ~150M parameters) patched with each runnable backend, one packed
   forward+backward of 8k/32k/64k tokens; tokens/s and peak GPU memory. transformers' own sdpa, which masks
   packed samples with a dense ``[T, T]`` mask built from ``position_ids``, is the last row;
6. long-context ladder: two Llama-3.1-8B-shaped layers (hidden 4096, MLP 14336, 32 heads and 8 KV heads
   of 128, vocabulary 128,256, its RoPE; random weights, bf16, attention ``auto``: flash-attn, else
   PyTorch's varlen kernel) trained by the run's own trainer with ``[training] offload_activations`` on
   (and checkpointing, the chunked loss, AdamW), on the probe's synthetic pack at each ladder length (64k
   to 512k tokens by default); twice, with ``sequence_tiling = "mlp"`` and with ``"layer"``. Per length: the second step's time, the
   peak GPU memory (``max_memory_allocated``), its growth per token from the length before, the peak
   predicted from the two lengths before (the probe's ``--plan``: linear in the tokens) and its error,
   the peak the simulation counts for the same step (``longalign probe --simulate``: fake tensors, the
   attention kernel's stand-in) and its error, and the pinned host memory the offload held per token and layer. With the inputs offloaded, what grows
   per token on the GPU is the one layer being recomputed and the loss, whatever the number of layers; a
   plan for 32 layers adds 32 x the host figure per token in host memory. The ladder stops at the first
   length that runs out of memory.

Sized for under 8 minutes on one H100; not yet run on a GPU. ``tests/test_gpu_check.py`` runs sections 3,
4 and 6 and the report on CPU at a tiny size (the GPU backends through their kernels' Python layers over
the test suite's stand-ins). Exits 1 when a backend disagrees.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import datasets
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import longalign.patch
from longalign.arguments import parse_lengths
from longalign.attention import available_backends, varlen_attention
from longalign.config import load_config
from longalign.probe import format_bytes, synthetic_pack
from longalign.probe_step import measure_steps, probe_overrides
from longalign.run import build_trainer, release
from longalign.simulate import Setup, SimulationError, simulate_lengths

ROOT = Path(__file__).resolve().parents[1]
# Two layers of Llama-3.1-8B, its RoPE included: what each token costs does not depend on the weights.
LLAMA_31_8B_LAYERS = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 2,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 1048576,
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "pad_token_id": 128001,
}
# The ladder runs once per level of sequence tiling: the MLP alone, then every token-wise part of the layer.
TILINGS = {"tiled MLP": "mlp", "tiled layer": "layer"}


def long_context(tiling: str) -> list[str]:
    """The ladder's run-file settings with ``[training] sequence_tiling = tiling``."""
    return [
        "training.activation_checkpointing=true",
        f"training.sequence_tiling={tiling}",
        "training.offload_activations=true",
        "loss.chunk_size=4096",
    ]


GPU_BACKENDS = ("flash_attn", "flash_attn_cute", "torch_varlen")
OUTPUT_SLACK, GRAD_SLACK, FLOOR = 2.0, 3.0, 1e-3
# A bf16 training step on another attention kernel: the kernels' outputs round apart by up to one unit in
# the last place, which the bf16 layers after them carry on (tests/test_attention_kernels.py: at most
# 1.5e-2 on CPU; samples that see each other move a parameter's gradient by 0.9 or more).
STEP_BOUND = 5e-2
QLORA = ["lora.r=8", "lora.load_in_4bit=true"]


def long_tail_lengths(tokens: int, seed: int) -> list[int]:
    """Lengths summing to ``tokens``: log-normal (median ~250), a few single tokens, capped at 16k."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [1, 1, 3]
    while sum(lengths) < tokens:
        draw = torch.empty(1).log_normal_(mean=5.5, std=1.5, generator=generator).item()
        lengths.append(int(min(max(draw, 1), 16384, tokens - sum(lengths))))
    return lengths


def pack(lengths: list[int], device: torch.device, seed: int = 0):
    generator = torch.Generator(device=device).manual_seed(seed)
    total = sum(lengths)
    q, k, v = (
        torch.randn(total, heads, 128, device=device, dtype=torch.bfloat16, generator=generator)
        for heads in (16, 4, 4)
    )
    cotangent = torch.randn_like(q)
    cu_seqlens = torch.tensor(
        [0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device
    )
    return q, k, v, cotangent, cu_seqlens


def run(q, k, v, cotangent, cu_seqlens, max_seqlen, **options) -> list[torch.Tensor]:
    """Output and q/k/v gradients, in float32."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = varlen_attention(q, k, v, cu_seqlens, max_seqlen, **options)
    grads = torch.autograd.grad(out, (q, k, v), cotangent.to(out.dtype))
    return [t.float() for t in (out, *grads)]


def check_agreement(device: torch.device, runnable: list[str]) -> tuple[bool, list[dict]]:
    lengths = long_tail_lengths(16384, seed=0)
    q, k, v, cotangent, cu_seqlens = pack(lengths, device)
    ok, rows = True, []
    print(f"\nagreement with sdpa_segments in float32: {len(lengths)} samples, {sum(lengths)} tokens, bf16")
    print(f"{'backend':<18}{'window':>8}{'out err':>10}{'limit':>10}{'grad err':>10}{'limit':>10}  verdict")
    for window in (None, 512):
        reference = run(
            *(x.float() for x in (q, k, v, cotangent)),
            cu_seqlens,
            max(lengths),
            window=window,
            backend="sdpa_segments",
        )
        bf16 = run(q, k, v, cotangent, cu_seqlens, max(lengths), window=window, backend="sdpa_segments")
        baseline = [(a - b).abs().max().item() for a, b in zip(bf16, reference, strict=True)]
        out_limit = OUTPUT_SLACK * baseline[0] + FLOOR
        grad_limit = GRAD_SLACK * max(baseline[1:]) + FLOOR
        for name in runnable:
            reason = available_backends(device, torch.bfloat16, window=window)[name]
            if reason is not None:
                print(f"{name:<18}{window or '-':>8}  refused: {reason}")
                rows.append({"backend": name, "window": window, "refused": reason})
                continue
            got = run(q, k, v, cotangent, cu_seqlens, max(lengths), window=window, backend=name)
            errors = [(a - b).abs().max().item() for a, b in zip(got, reference, strict=True)]
            passed = errors[0] <= out_limit and max(errors[1:]) <= grad_limit
            ok &= passed
            rows.append(
                {"backend": name, "window": window, "out_error": errors[0], "out_limit": out_limit,
                 "grad_error": max(errors[1:]), "grad_limit": grad_limit, "ok": passed}
            )  # fmt: skip
            print(
                f"{name:<18}{window or '-':>8}{errors[0]:>10.2e}{out_limit:>10.2e}{max(errors[1:]):>10.2e}"
                f"{grad_limit:>10.2e}  {'ok' if passed else 'MISMATCH'}"
            )
    return ok, rows


def model_step_agreement(
    device: torch.device, runnable: list[str], shape: dict, tokens: int = 8192
) -> tuple[bool, list[dict]]:
    """One packed forward and backward of a bf16 model of ``shape`` per backend, against ``sdpa_segments``.

    Every parameter's gradient is compared by the norm of the difference over its own norm; the worst
    parameter is the row's error (one parameter cannot hide in another).
    """
    config = LlamaConfig(**{key: value for key, value in shape.items() if key != "model_type"})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16).train()
    batch = packed_batch(tokens, device, vocab_size=config.vocab_size)
    targets = batch["input_ids"][0, 1:]

    def gradients(backend: str) -> tuple[float, dict[str, torch.Tensor]]:
        longalign.patch.apply(model, backend=backend)
        model.zero_grad(set_to_none=True)
        logits = model(**batch, use_cache=False).logits[0, :-1]
        loss = torch.nn.functional.cross_entropy(logits.float(), targets)
        loss.backward()
        return loss.item(), {name: p.grad.float() for name, p in model.named_parameters()}

    print(
        f"\na training step, {config.num_hidden_layers} layers of hidden {config.hidden_size}, "
        f"{tokens} packed tokens, bf16: each parameter's gradient against sdpa_segments"
    )
    print(f"{'backend':<18}{'loss':>10}{'worst parameter':>42}{'error':>10}{'limit':>10}  verdict")
    want_loss, want = gradients("sdpa_segments")
    ok, rows = True, []
    for name in runnable:
        loss, got = gradients(name)
        errors = {key: ((got[key] - want[key]).norm() / want[key].norm()).item() for key in want}
        worst = max(errors, key=errors.get)
        passed = errors[worst] <= STEP_BOUND
        ok &= passed
        rows.append(
            {"backend": name, "loss": loss, "reference_loss": want_loss, "worst_parameter": worst,
             "error": errors[worst], "limit": STEP_BOUND, "ok": passed}
        )  # fmt: skip
        print(
            f"{name:<18}{loss:>10.4f}{worst:>42}{errors[worst]:>10.2e}{STEP_BOUND:>10.2e}"
            f"  {'ok' if passed else 'MISMATCH'}"
        )
    return ok, rows


def qlora_step(shape: dict, overrides: list[str], length: int = 4096) -> dict:
    """One step of the run's trainer with the base in 4-bit NF4 (``QLORA``) on one pack of ``length``."""
    with tempfile.TemporaryDirectory() as work:
        row = ladder_step(length, shape, [*QLORA, *overrides], Path(work))
    print(f"\nQLoRA (NF4, double quantization, r=8), {length} tokens: ", end="")
    if "error" in row:
        print(row["error"])
    else:
        print(f"step {row['step_seconds']:.2f} s, peak {format_bytes(row['peak_bytes'])}")
    return {key: value for key, value in row.items() if key != "model_sizes"}


def small_llama_shape() -> dict:
    return dict(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        max_position_embeddings=65536,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
    )


def small_llama(device: torch.device) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return (
        LlamaForCausalLM(LlamaConfig(**small_llama_shape())).to(device=device, dtype=torch.bfloat16).train()
    )


def packed_batch(tokens: int, device: torch.device, vocab_size: int = 32000) -> dict:
    lengths = long_tail_lengths(tokens, seed=1)
    cu_seq_lens = torch.tensor(
        [0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device
    )
    return {
        "input_ids": torch.randint(0, vocab_size, (1, tokens), device=device),
        "position_ids": torch.cat([torch.arange(n, device=device) for n in lengths])[None],
        "cu_seq_lens_q": cu_seq_lens,
        "cu_seq_lens_k": cu_seq_lens,
        "max_length_q": max(lengths),
        "max_length_k": max(lengths),
    }


def tokens_per_second(model, batch: dict, steps: int) -> tuple[float, float]:
    """Best-of-``steps`` forward+backward speed after one warm-up, and peak memory in GiB."""
    tokens = batch["input_ids"].shape[1]
    torch.cuda.reset_peak_memory_stats()
    best = float("inf")
    for step in range(steps + 1):
        torch.cuda.synchronize()
        start = time.perf_counter()
        logits = model(**batch, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), batch["input_ids"][0, 1:])
        loss.backward()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step:
            best = min(best, time.perf_counter() - start)
        del logits, loss
    return tokens / best, torch.cuda.max_memory_allocated() / 2**30


def throughput(device: torch.device, runnable: list[str], token_counts: list[int], steps: int) -> list[dict]:
    model = small_llama(device)
    print(f"\npacked forward+backward, Llama {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M bf16")
    print(f"{'attention':<28}" + "".join(f"{f'{n // 1024}k tok/s':>14}{'GiB':>7}" for n in token_counts))
    rows = []
    for row in [*runnable, "sdpa_segments", "transformers sdpa"]:
        if row == "transformers sdpa":
            model.set_attn_implementation("sdpa")
        else:
            longalign.patch.apply(model, backend=row)
        cells = []
        for tokens in token_counts:
            batch = packed_batch(tokens, device)
            if row == "transformers sdpa":  # it finds the samples from position_ids alone
                batch = {key: batch[key] for key in ("input_ids", "position_ids")}
            try:
                speed, memory = tokens_per_second(model, batch, steps)
                cells.append(f"{speed:>14,.0f}{memory:>7.1f}")
                rows.append(
                    {"attention": row, "tokens": tokens, "tokens_per_second": speed, "peak_gib": memory}
                )
            except torch.OutOfMemoryError:
                model.zero_grad(set_to_none=True)
                cells.append(f"{'out of memory':>21}")
                rows.append({"attention": row, "tokens": tokens, "error": "out of memory"})
            torch.cuda.empty_cache()
        print(f"{row:<28}" + "".join(cells))
    return rows


def toml_value(value) -> str:
    """A Python value as TOML writes it inline: ``{a = 1, b = "x"}``."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key} = {toml_value(item)}" for key, item in value.items()) + "}"
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else repr(value)


def ladder_step(length: int, model: dict, overrides: list[str], work: Path) -> dict:
    """Two optimizer steps of the run's trainer on one synthetic pack of ``length`` tokens; what they cost."""
    packs = work / f"packs-{length}"
    datasets.Dataset.from_list([synthetic_pack(length, vocab_size=model["vocab_size"])]).save_to_disk(packs)
    settings = probe_overrides(length, train_file=packs, output_dir=work / f"run-{length}")
    settings += [
        f"model.init_from_config={toml_value(model)}",
        f"model.tokenizer='{ROOT / 'data' / 'tokenizer'}'",
    ]
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.reset_peak_host_memory_stats()
    # On the GPU the random weights are made there, in a second rather than a minute on the CPU.
    with torch.device("cuda") if cuda else contextlib.nullcontext():
        trainer = build_trainer(load_config(ROOT / "configs" / "demo.toml", [*settings, *overrides]))
    try:
        measured = measure_steps(trainer)
    except torch.OutOfMemoryError as err:
        return {"tokens": length, "error": f"out of memory: {str(err).splitlines()[0][:120]}"}
    finally:
        release(trainer)
        del trainer
        gc.collect()
    host = torch.cuda.host_memory_stats().get("active_bytes.peak", 0) if cuda else 0
    return {"tokens": length, **measured, "host_bytes": host}


def simulated_peak(length: int, model: dict, overrides: list[str], work: Path) -> float | None:
    """The peak of :func:`ladder_step`'s step as ``longalign probe --simulate`` counts it on fake tensors (the
    GPU attention kernel's stand-in, the run's own model and step), or ``None`` when it cannot simulate it."""
    settings = probe_overrides(length, train_file=work / f"packs-{length}", output_dir=work / f"sim-{length}")
    settings += [
        f"model.init_from_config={toml_value(model)}",
        f"model.tokenizer='{ROOT / 'data' / 'tokenizer'}'",
    ]
    try:
        cfg = load_config(ROOT / "configs" / "demo.toml", [*settings, *overrides])
        (row,) = simulate_lengths(cfg, [length], Setup())
    except SimulationError as err:
        print(f"  simulation: {err}")
        return None
    return row["peak"]


def predicted_peak(rows: list[dict], length: int) -> float | None:
    """The peak at ``length`` as the probe's plan predicts it: linear in the tokens through the two rows
    before (``None`` with fewer)."""
    if len(rows) < 2:
        return None
    a, b = rows[-2], rows[-1]
    per_token = (b["peak_bytes"] - a["peak_bytes"]) / (b["tokens"] - a["tokens"])
    return b["peak_bytes"] + per_token * (length - b["tokens"])


def write_report(report: dict, directory: Path) -> tuple[Path, Path]:
    """``gpu_check.json`` (everything) and ``gpu_check.md`` (its tables) in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    json_path, markdown_path = directory / "gpu_check.json", directory / "gpu_check.md"
    json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    lines = [f"# GPU check: {report['device']}", "", f"torch {report['torch']}, {report['verdict']}", ""]
    for title, rows in report["sections"].items():
        rows = rows if isinstance(rows, list) else [rows]
        lines += [f"## {title}", ""]
        if not rows:
            lines += ["(nothing ran)", ""]
            continue
        keys = list(dict.fromkeys(key for row in rows for key in row))
        lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(_cell(row.get(key)) for key in keys) + " |" for row in rows]
        lines.append("")
    markdown_path.write_text("\n".join(lines))
    return json_path, markdown_path


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value).replace("|", "/")


def long_context_ladder(lengths: list[int], model: dict, overrides: list[str]) -> list[dict]:
    """:func:`ladder_step` at every length, smallest first, printed as a table as it goes."""
    layers = model["num_hidden_layers"]
    print(
        f"\nlong-context ladder: {layers} layers of hidden {model['hidden_size']}, MLP {model['intermediate_size']}, "
        f"vocabulary {model['vocab_size']:,}; {', '.join(o.split('.', 1)[1] for o in overrides)}"
    )
    print(
        f"{'tokens':>8}{'step s':>9}{'tok/s':>9}{'GPU peak':>12}{'growth/token':>14}{'predicted':>12}"
        f"{'error':>8}{'simulated':>12}{'error':>8}{'host/token/layer':>18}"
    )
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as work:
        for length in lengths:
            row = ladder_step(length, model, overrides, Path(work))
            if "error" in row:
                print(f"{length:>8,}  {row['error']}")
                break
            before = rows[-1] if rows else None
            growth = (
                (row["peak_bytes"] - before["peak_bytes"]) / (length - before["tokens"]) if before else None
            )
            row["growth_bytes_per_token"] = growth
            row["predicted_peak_bytes"] = predicted_peak(rows, length)
            error = (
                None
                if row["predicted_peak_bytes"] is None
                else row["predicted_peak_bytes"] / row["peak_bytes"] - 1
            )
            row["prediction_error"] = error
            row["simulated_peak_bytes"] = simulated_peak(length, model, overrides, Path(work))
            simulated = row["simulated_peak_bytes"]
            row["simulation_error"] = None if simulated is None else simulated / row["peak_bytes"] - 1
            sim_error = "-" if simulated is None else f"{row['simulation_error']:+.1%}"
            sim_error = f"{sim_error:>8}"
            host = row["host_bytes"] / length / layers
            print(
                f"{length:>8,}{row['step_seconds']:>9.2f}{length / row['step_seconds']:>9,.0f}"
                f"{format_bytes(row['peak_bytes']):>12}{f'{growth:,.0f} B' if growth else '-':>14}"
                f"{format_bytes(row['predicted_peak_bytes']) if error is not None else '-':>12}"
                f"{f'{error:+.1%}' if error is not None else '-':>8}"
                f"{format_bytes(simulated) if simulated is not None else '-':>12}"
                f"{sim_error}"
                f"{f'{host:,.0f} B' if host else '-':>18}"
            )
            rows.append({key: value for key, value in row.items() if key != "model_sizes"})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[8192, 32768, 65536])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument(
        "--ladder", default="64k,128k,256k,512k", help="pack lengths of the long-context ladder"
    )
    parser.add_argument("--report", type=Path, default=Path("out/gpu_check"), help="where the reports go")
    args = parser.parse_args()
    ladder = parse_lengths(args.ladder)
    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device, nothing to check here (tests/test_attention_kernels.py runs the GPU "
            "backends' Python layers on CPU; tests/test_gpu_check.py runs this script's steps at a tiny size)",
            file=sys.stderr,
        )
        return 2
    device = torch.device("cuda")
    name, capability = torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)
    print(f"{name}, compute capability {capability[0]}.{capability[1]}, torch {torch.__version__}")
    reasons = available_backends(device, torch.bfloat16)
    for backend, reason in reasons.items():
        print(f"  {backend:<16} {'runs' if reason is None else 'unavailable: ' + reason}")
    runnable = [backend for backend in GPU_BACKENDS if reasons[backend] is None]
    on_gpu = [
        "training.use_cpu=false",
        "training.bf16=true",
        "model.torch_dtype='bfloat16'",
        "model.attn_backend='auto'",
    ]
    kernels_ok, agreement = check_agreement(device, runnable)
    step_ok, steps = model_step_agreement(device, runnable, LLAMA_31_8B_LAYERS)
    small = {
        **small_llama_shape(),
        "model_type": "llama",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    qlora = qlora_step(small, on_gpu)
    speed = throughput(device, runnable, args.tokens, args.steps)
    ladders = {
        f"long-context ladder, {name}": long_context_ladder(
            ladder, LLAMA_31_8B_LAYERS, [*long_context(tiling), *on_gpu]
        )
        for name, tiling in TILINGS.items()
    }
    ok = kernels_ok and step_ok and "error" not in qlora
    report = {
        "device": f"{name}, compute capability {capability[0]}.{capability[1]}",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "verdict": "all backends agree" if ok else "SOME CHECKS FAILED",
        "sections": {
            "backends": [{"backend": b, "unavailable": r} for b, r in reasons.items()],
            "attention against sdpa_segments": agreement,
            "training step against sdpa_segments": steps,
            "QLoRA step": qlora,
            "throughput": speed,
            **ladders,
        },
    }
    json_path, markdown_path = write_report(report, args.report)
    print(f"\n{report['verdict']}; reports: {json_path}, {markdown_path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

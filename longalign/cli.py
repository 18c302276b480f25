"""The ``longalign`` command: one subcommand per stage of the pipeline, each with ``--help``.

    longalign pre-tokenize --input chats.jsonl --tokenizer MODEL --output out/tok --max-seq-len 65536
    longalign pack --input out/tok --output out/packed --max-seq-len 65536
    accelerate launch -m longalign train --config run.toml [section.key=value ...]
    longalign probe --config run.toml --lengths 16k,32k,64k
    accelerate launch -m longalign preflight --config run.toml
    longalign merge --adapter out/run --output out/merged
    longalign data self-instruct --docs docs/ --tokenizer MODEL --max-tokens 60000 --output out/gen --base-url URL --served-model NAME
    longalign eval needle --model out/run --lengths 4k,8k,16k --output out/eval/needle
    longalign convert THUDM/glm-4-9b-chat out/glm-4-9b-chat-native

``scripts/pre_tokenize.py``, ``scripts/sort_and_group.py``, ``scripts/probe_memory.py``,
``scripts/preflight.py``, ``scripts/merge_adapter.py`` and ``train.py`` run the same subcommands. Every command reports a bad argument,
config, input file or model in one line (``longalign train: error: ...``) and exits with status 2; any other
error, and any error once training has started, keeps its traceback (status 1). The rest of what each
prints is its result.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from longalign import reports
from longalign.arguments import at_least
from longalign.datagen import command as datagen
from longalign.errors import ConfigError, LongAlignError, PathError
from longalign.eval import commands as eval_commands
from longalign.flops import DEFAULT_EFFICIENCY, GPU_PEAK_FLOPS


@dataclass(frozen=True)
class Command:
    summary: str  # one line for `longalign --help`
    description: str  # the subcommand's --help text
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def main(argv: list[str] | None = None) -> int:
    """``longalign SUBCOMMAND ...``: the console entry point."""
    parser = argparse.ArgumentParser(
        prog="longalign", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
    for name, command in COMMANDS.items():
        sub = commands.add_parser(
            name,
            help=command.summary,
            description=command.description,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        command.add_arguments(sub)
    args = parser.parse_args(argv)
    return _run(f"longalign {args.command}", COMMANDS[args.command], args)


def script(name: str) -> int:
    """Run subcommand ``name`` as the script it also is (``python scripts/pre_tokenize.py ...``)."""
    command = COMMANDS[name]
    prog = Path(sys.argv[0]).name
    parser = argparse.ArgumentParser(
        prog=prog, description=command.description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    command.add_arguments(parser)
    return _run(prog, command, parser.parse_args(sys.argv[1:]))


# bitsandbytes (which peft imports when it is installed) logs at import, on CPUs with AVX512-BF16, that it
# could not fetch an optional CPU kernel from the Hugging Face Hub; its own kernel then runs, with the same
# results. Shown, that line would open every command's output, one-line errors included.
QUIET_LOGGERS = ("bitsandbytes.backends.cpu.ops",)


def _run(prog: str, command: Command, args: argparse.Namespace) -> int:
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        return command.run(args)
    except LongAlignError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        if err.filename is None:  # not about a path: a fault to debug, with its traceback
            raise
        print(f"{prog}: error: {err.filename}: {err.strerror or err}", file=sys.stderr)
        return 2


def _config_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, required=True, help="the run's TOML file")
    parser.add_argument("overrides", nargs="*", help="section.key=value settings that win over the file")


# --- pre-tokenize ----------------------------------------------------------------------------------------


def _pre_tokenize_arguments(parser: argparse.ArgumentParser) -> None:
    from longalign.config import TRUNCATIONS
    from longalign.tokenize import SPECIAL_TEXT_MODES

    parser.add_argument(
        "--input",
        required=True,
        action="append",
        help="chats: a .jsonl, .json or .parquet file, a directory of them, a saved datasets directory or "
        "a Hub dataset id; repeat for several (report.json accounts for each)",
    )
    parser.add_argument("--split", help="the split of dataset inputs (default: train)")
    parser.add_argument("--tokenizer", required=True, help="tokenizer directory or hub name")
    parser.add_argument("--output", required=True, help="output dataset directory (replaced atomically)")
    parser.add_argument(
        "--max-seq-len", type=at_least(1), required=True, help="longest sample kept, in tokens"
    )
    parser.add_argument(
        "--truncation", choices=TRUNCATIONS, default="right", help="what to do with longer samples"
    )
    parser.add_argument("--num-proc", type=at_least(1), default=1, help="tokenizer processes")
    parser.add_argument(
        "--strict", action="store_true", help="stop at the first bad line instead of skipping it"
    )
    parser.add_argument(
        "--chat-template", type=Path, help="Jinja file that replaces the tokenizer's chat template"
    )
    parser.add_argument(
        "--special-tokens-in-text",
        choices=SPECIAL_TEXT_MODES,
        default="text",
        help="message text that spells a control token (e.g. <|eot_id|>): tokenize it as the text it is "
        "(default), or as the control token",
    )
    parser.add_argument("--trust-remote-code", action="store_true")


def _pre_tokenize(args: argparse.Namespace) -> int:
    from longalign.chat_template import open_tokenizer
    from longalign.config import Source
    from longalign.tokenize import pre_tokenize

    tokenizer = open_tokenizer(args.tokenizer, trust_remote_code=args.trust_remote_code)
    if args.chat_template is not None:
        if not args.chat_template.is_file():
            raise PathError(f"{args.chat_template}: chat template file not found")
        tokenizer.chat_template = args.chat_template.read_text(encoding="utf-8")
    report = pre_tokenize(
        [Source(path, split=args.split) for path in args.input],
        tokenizer,
        args.output,
        max_seq_len=args.max_seq_len,
        truncation=args.truncation,
        num_proc=args.num_proc,
        strict=args.strict,
        special_tokens_in_text=args.special_tokens_in_text,
    )
    print(reports.pre_tokenize_summary(report, args.output))
    return 0


# --- pack ------------------------------------------------------------------------------------------------


def _pack_arguments(parser: argparse.ArgumentParser) -> None:
    from longalign.config import STRATEGIES

    parser.add_argument("--input", required=True, help="dataset directory written by pre-tokenize")
    parser.add_argument("--output", required=True, help="output dataset directory (replaced atomically)")
    parser.add_argument("--max-seq-len", type=at_least(1), required=True, help="tokens per pack, at most")
    parser.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="bfd",
        help="bfd/ffd: best/first-fit decreasing; greedy: next-fit in input order; "
        "sorted: no packing, batches of similar length; none: one sample per row",
    )
    parser.add_argument("--seed", type=at_least(0), default=0, help="order of equal lengths and of the packs")
    parser.add_argument(
        "--batch-size", type=at_least(1), default=1, help="samples per batch (strategy sorted)"
    )
    parser.add_argument(
        "--sort-by-length",
        action="store_true",
        help="order the samples by length before packing; with greedy: LongAlign's sort-and-group",
    )
    parser.add_argument(
        "--drop-long", action="store_true", help="leave out samples over --max-seq-len instead of failing"
    )
    parser.add_argument(
        "--min-seq-len", type=at_least(0), default=0, help="leave out samples with fewer tokens (counted)"
    )
    parser.add_argument(
        "--max-seq-len-filter",
        type=at_least(1),
        help="leave out samples with more tokens (counted, never truncated); at most --max-seq-len",
    )


def _pack(args: argparse.Namespace) -> int:
    from longalign.packing import write_packs

    report = write_packs(
        args.input,
        args.output,
        max_seq_len=args.max_seq_len,
        strategy=args.strategy,
        seed=args.seed,
        batch_size=args.batch_size,
        sort_by_length=args.sort_by_length,
        drop_long=args.drop_long,
        min_sample_len=args.min_seq_len,
        max_sample_len=args.max_seq_len_filter,
    )
    reports.plot_packing(report, Path(args.output) / reports.PLOT_NAME)
    print(reports.pack_summary(report, args.output))
    return 0


# --- train -----------------------------------------------------------------------------------------------


def _train_arguments(parser: argparse.ArgumentParser) -> None:
    _config_arguments(parser)
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check the run file, prepare the data (cached), print every setting with where it came from "
        "and the packing summary, and stop before loading model weights",
    )


def _train(args: argparse.Namespace) -> int:
    from longalign.config import load_config
    from longalign.run import dry_run, train

    cfg = load_config(args.config, args.overrides)
    if not args.dry_run:
        return train(cfg)
    result = dry_run(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        print(reports.dry_run_summary(result))
    return 0


# --- probe -----------------------------------------------------------------------------------------------


def _probe_arguments(parser: argparse.ArgumentParser) -> None:
    _config_arguments(parser)
    parser.add_argument(
        "--lengths", default="4k,8k,16k,32k,64k", help="tokens per pack, e.g. 4k,8k,16k or 3000"
    )
    parser.add_argument(
        "--max-memory",
        help="memory cap per rank, e.g. 70GiB: on CUDA the allocator refuses more; on CPU a step whose "
        "peak resident set is over the cap counts as out of memory",
    )
    parser.add_argument("--output", type=Path, default=Path("probe.json"), help="where the results go")
    parser.add_argument(
        "--seed", type=at_least(0), default=0, help="seed of the synthetic sample lengths and tokens"
    )
    parser.add_argument("--trace", action="store_true", help="also print the failing step's traceback")
    parser.add_argument(
        "--compare-full",
        action="store_true",
        help="with [lora]: also run each length as full fine-tuning and show the memory the adapters save",
    )
    parser.add_argument(
        "--plan",
        help="lengths to predict the peak per GPU of, e.g. 512k,1m: weights, gradients and optimizer states "
        "as the run places them, plus the memory per token fitted from the measured lengths below each",
    )
    parser.add_argument(
        "--gpus", type=at_least(1), help="GPUs the plan is for (default: the ranks the probe runs on)"
    )
    parser.add_argument(
        "--gpu-memory",
        help="memory of each planned GPU, e.g. 80GiB (default: --max-memory, or the CUDA device's)",
    )
    parser.add_argument(
        "--simulate",
        action="store_true",
        help="count one step of the run at each length on this CPU, on fake tensors (nothing computed), "
        "instead of running steps: the peak per GPU by part and the host memory per node",
    )
    parser.add_argument("--host-memory", help="with --simulate: host memory of each node, e.g. 2TiB")
    parser.add_argument(
        "--kernel",
        help="with --simulate: the attention kernel to stand in for (flash_attn_2, flash_attn_3, "
        "torch_varlen, sdpa_segments; default: the one model.attn_backend runs on a GPU)",
    )
    parser.add_argument(
        "--accelerate-config",
        type=Path,
        help="with --simulate: the accelerate config the run is launched with (its DeepSpeed or FSDP "
        "settings, and its num_processes as the default --gpus)",
    )
    parser.add_argument(
        "--gpu",
        choices=sorted(GPU_PEAK_FLOPS),
        help="with --simulate: the GPU the step's time is for, at its dense bf16 peak (with --efficiency): "
        "the step's seconds, tokens per second and the run's GPU-hours",
    )
    parser.add_argument(
        "--efficiency",
        type=float,
        default=DEFAULT_EFFICIENCY,
        help="with --gpu: the share of the peak the step's executed FLOPs run at (default "
        f"{DEFAULT_EFFICIENCY}, as Llama 3's 131k-token training measured)",
    )
    parser.add_argument(
        "--tokens",
        type=at_least(1),
        help="with --gpu: tokens of one pass over the run's data, for its GPU-hours (default: the report.json "
        "of its packed data.train_file)",
    )


def _simulate(args: argparse.Namespace) -> int:
    import os

    from longalign.arguments import parse_lengths
    from longalign.artifacts import write_json
    from longalign.config import load_config
    from longalign.flops import Throughput
    from longalign.probe import _deepspeed_config, parse_size, sharding
    from longalign.simulate import Setup, accelerate_environment, packed_run_tokens, run_simulation

    cfg = load_config(args.config, args.overrides)
    environ, processes = dict(os.environ), None
    if args.accelerate_config:
        launch, processes = accelerate_environment(args.accelerate_config)
        environ.update(launch)
    memory = args.gpu_memory or args.max_memory
    gpus = args.gpus or processes or cfg.training.sequence_parallel_size
    setup = Setup(
        gpus=gpus,
        gpu_memory=parse_size(memory) if memory else None,
        host_memory=parse_size(args.host_memory) if args.host_memory else None,
        kernel=args.kernel,
        how=sharding(cfg, environ),
        deepspeed=_deepspeed_config(cfg.training.args, environ),
        seed=args.seed,
        throughput=Throughput(args.gpu, args.efficiency) if args.gpu else None,
        run_tokens=packed_run_tokens(cfg, epoch_tokens=args.tokens, gpus=gpus) if args.gpu else None,
    )
    rows = run_simulation(
        cfg, parse_lengths(args.lengths), setup, lambda line: print(line, flush=True), source=str(args.config)
    )
    write_json(args.output, {"config": str(args.config), "simulated": rows})
    print(f"wrote {args.output}")
    fits = [row["fits_gpu"] is not False and row["fits_host"] is not False for row in rows]
    return 0 if fits and fits[0] else 1


def _probe(args: argparse.Namespace) -> int:
    from longalign.arguments import parse_lengths
    from longalign.config import load_config
    from longalign.probe import ProbeRequest, ladder, parse_size

    if args.simulate:
        return _simulate(args)
    if args.host_memory or args.kernel or args.accelerate_config or args.gpu or args.tokens:
        raise ConfigError(
            "--host-memory, --kernel, --accelerate-config, --gpu and --tokens describe a simulation: add --simulate"
        )
    if (args.gpus or args.gpu_memory) and not args.plan:
        raise ConfigError("--gpus and --gpu-memory describe the GPUs of a plan: add --plan LENGTHS")
    request = ProbeRequest(
        config=args.config,
        overrides=tuple(args.overrides),
        lengths=parse_lengths(args.lengths),
        max_memory=parse_size(args.max_memory) if args.max_memory else None,
        seed=args.seed,
        output=args.output,
        trace=args.trace,
        compare_full=args.compare_full,
        plan=tuple(parse_lengths(args.plan)) if args.plan else (),
        gpus=args.gpus,
        gpu_memory=parse_size(args.gpu_memory) if args.gpu_memory else None,
    )
    cfg = load_config(args.config, args.overrides)
    return ladder(request, cfg, say=lambda line: print(line, flush=True))


# --- preflight -------------------------------------------------------------------------------------------


def _preflight_arguments(parser: argparse.ArgumentParser) -> None:
    from longalign.preflight import DEFAULT_ENV

    _config_arguments(parser)
    parser.add_argument(
        "--env",
        default="",
        help=f"more environment variables to compare, comma-separated; NAME_* matches a prefix "
        f"(always checked: {', '.join(DEFAULT_ENV)})",
    )
    parser.add_argument("--no-default-env", action="store_true", help="check only the --env names")


def _preflight(args: argparse.Namespace) -> int:
    from longalign.config import load_config
    from longalign.preflight import DEFAULT_ENV
    from longalign.run import preflight

    cfg = load_config(args.config, args.overrides)
    extra = [name.strip() for name in args.env.split(",") if name.strip()]
    env_names = list(dict.fromkeys(([] if args.no_default_env else list(DEFAULT_ENV)) + extra))
    report = preflight(cfg, env_names)
    if int(os.environ.get("RANK", "0")) == 0:  # set by the launcher; one process otherwise
        print(report)
    return 0 if report.ok else 1


# --- merge ------------------------------------------------------------------------------------------------


def _merge_arguments(parser: argparse.ArgumentParser) -> None:
    from longalign.config import TORCH_DTYPES

    parser.add_argument(
        "--adapter", required=True, help="a [lora] run's output_dir or one of its checkpoint-N directories"
    )
    parser.add_argument(
        "--output", required=True, help="directory for the merged model (replaced atomically)"
    )
    parser.add_argument(
        "--base", help="the base model (hub name or directory); default: the one adapter_config.json names"
    )
    parser.add_argument(
        "--dtype",
        choices=TORCH_DTYPES,
        default="auto",
        help="dtype of the merged model; auto: the base's own",
    )


def _merge(args: argparse.Namespace) -> int:
    from longalign.lora import merge_adapter

    merge_adapter(args.adapter, args.output, base_model=args.base, dtype=args.dtype)
    print(f"wrote {args.output}: {args.adapter} merged into its base")
    return 0


# --- convert ----------------------------------------------------------------------------------------------


def _convert_arguments(parser: argparse.ArgumentParser) -> None:
    from longalign.chatglm_layout import LAYOUTS
    from longalign.config import TORCH_DTYPES

    parser.add_argument("source", help="checkpoint directory, or a Hub id already in the local cache")
    parser.add_argument("output", help="directory for the converted checkpoint (replaced atomically)")
    parser.add_argument(
        "--to", choices=LAYOUTS, help="the layout to write; default: the one SOURCE is not in"
    )
    parser.add_argument(
        "--dtype", choices=TORCH_DTYPES, default="auto", help="cast the weights; auto: as stored"
    )


def _convert(args: argparse.Namespace) -> int:
    from longalign.checkpoints import convert

    layout = convert(args.source, args.output, to=args.to, dtype=args.dtype)
    print(f"wrote {args.output}: {args.source} in the {layout} layout")
    return 0


COMMANDS = {
    "pre-tokenize": Command(
        "chat data -> tokenized samples with assistant-only labels",
        "Chat data (JSONL, JSON, Parquet, directories, saved or Hub datasets) -> tokenized sample dataset\n"
        "(Arrow) with assistant-only labels, plus report.json accounting for every input.\n\n"
        "    longalign pre-tokenize --input data/sample.jsonl --tokenizer data/tokenizer \\\n"
        "        --output out/tokenized --max-seq-len 8192",
        _pre_tokenize_arguments,
        _pre_tokenize,
    ),
    "pack": Command(
        "tokenized samples -> packs with cu_seqlens (sort and group)",
        "Tokenized sample dataset -> packs of at most --max-seq-len tokens with cu_seqlens, plus report.json\n"
        "and packing.png (sample-length and pack-fill histograms).\n\n"
        "    longalign pack --input out/tokenized --output out/packed --max-seq-len 8192",
        _pack_arguments,
        _pack,
    ),
    "train": Command(
        "train on packs with exact sequence- or token-level loss weighting",
        "Train on packed long-context chat data with exact sequence- or token-level loss weighting.\n\n"
        "    accelerate launch -m longalign train --config run.toml [section.key=value ...]\n\n"
        "[data] train_file (or [[data.sources]], a mix) is raw chat data (JSONL, JSON, Parquet, a directory,\n"
        "a saved or Hub dataset), pre-tokenized and packed here and cached next to the run, or a\n"
        "pre-tokenized or packed directory. Exit status: 0 trained, 1 the preflight failed, 2 bad input.",
        _train_arguments,
        _train,
    ),
    "probe": Command(
        "length-ladder memory probe: the longest pack this run fits",
        "Length-ladder memory probe: the longest pack this run's training steps fit in.\n\n"
        "    longalign probe --config run.toml --lengths 4k,8k,16k,32k,64k\n"
        "    accelerate launch -m longalign probe --config run.toml --lengths 16k,32k,64k\n\n"
        "For each length, smallest first, a fresh process per rank builds the run's trainer from the config\n"
        "on synthetic packs of exactly that many tokens, per_device_batch_size packs per rank, and runs two\n"
        "optimizer steps (the second carries the optimizer states: the steady-state peak, and the step time\n"
        "shown). Peak memory is CUDA max_memory_allocated, or on CPU the peak resident set of that fresh\n"
        "process. The ladder stops at the first length that fails and says what would raise the limit. The\n"
        "table and every rank's numbers, with the failure's traceback, go to --output. For a [lora] run,\n"
        "--compare-full runs each length that fits again as full fine-tuning and shows the memory saved.\n"
        "--plan 512k,1m predicts the peak per GPU at longer lengths (--gpus N of --gpu-memory SIZE): the\n"
        "weights, gradients and optimizer states as ZeRO or FSDP and offload place them, plus the memory per\n"
        "token fitted from the two longest measured lengths below each; one that was measured shows both.\n"
        "--simulate counts one step of the run at each length on this CPU instead, on fake tensors (the\n"
        "model from its config alone, a stand-in for the GPU attention kernel, ZeRO/FSDP and offload as\n"
        "--accelerate-config sets them), in seconds at any length: the peak per GPU by part, the host\n"
        "memory per node, and whether both fit --gpu-memory and --host-memory.\n\n"
        "Exit status: 0 when at least the smallest length fits, 1 when none does, 2 for bad arguments.",
        _probe_arguments,
        _probe,
    ),
    "preflight": Command(
        "check that every rank would train on the same thing",
        "Preflight check: every rank reports what it would train with; rank 0 prints one table.\n\n"
        "    accelerate launch -m longalign preflight --config run.toml [--env WANDB_PROJECT,...]\n\n"
        "Rows: python and package versions, the attention backend `auto` resolves to, fingerprints of the\n"
        "config, tokenizer (vocabulary + chat template) and packed dataset, the environment variables the\n"
        "run depends on (secret-looking values only as a short hash), an all-reduce round trip, and each\n"
        "rank's host, device and free memory (which may differ). The model is not loaded.\n\n"
        "Exit status: 0 when every rank agrees, 1 otherwise (naming the rank and the fix), 2 for bad input.",
        _preflight_arguments,
        _preflight,
    ),
    "data": Command(
        "long instruction data from documents or writing prompts, through any OpenAI-compatible model",
        datagen.DESCRIPTION,
        datagen.add_arguments,
        datagen.run,
    ),
    "eval": Command(
        "evaluate a model: needle heatmap, RULER, judged long chat, long-writing length score",
        "Evaluate a trained model: longalign eval needle|ruler|chat|write --help for each task.",
        eval_commands.add_arguments,
        eval_commands.run,
    ),
    "merge": Command(
        "fold a [lora] run's adapter into its base: a full model",
        "Fold the LoRA adapter of a [lora] run into its base model and write a full model (with the\n"
        "tokenizer) that AutoModelForCausalLM.from_pretrained loads.\n\n"
        "    longalign merge --adapter out/run --output out/merged\n"
        "    longalign merge --adapter out/run/checkpoint-200 --output out/merged-200 --dtype bfloat16\n\n"
        "The base is the model the run started from, as adapter_config.json names it (a random init_from_config\n"
        "base is saved by the run as <output_dir>/base_model); --base overrides it. A QLoRA adapter merges into\n"
        "the unquantized base. Exit status: 0 written, 2 for bad input.",
        _merge_arguments,
        _merge,
    ),
    "convert": Command(
        "GLM-4-9B's ChatGLM layout <-> transformers' GlmForCausalLM, offline",
        "Convert a checkpoint between GLM-4-9B's ChatGLM layout (model_type chatglm, remote code) and\n"
        "transformers' own GlmForCausalLM, without running the checkpoint's code.\n\n"
        "    longalign convert THUDM/glm-4-9b-chat out/glm-4-9b-chat-native\n"
        "    longalign convert out/run/checkpoint-200 out/chatglm-200 --to chatglm\n\n"
        "ChatGLM -> native writes GlmForCausalLM and tokenizer.json (built from tokenizer.model); native ->\n"
        "ChatGLM writes the fused weights and config.json (the original one when SOURCE was converted from it);\n"
        "copy tokenizer.model and the .py files from the original checkpoint for its remote code. Weights are\n"
        "renamed, split or joined, never changed, unless --dtype casts them. Exit status: 0 written, 2 for bad input.",
        _convert_arguments,
        _convert,
    ),
}

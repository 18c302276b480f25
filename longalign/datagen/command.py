"""``longalign data self-instruct|agentwrite``: the flags, and the run that reads them."""

from __future__ import annotations

import argparse

from longalign.answers import FILE, BatchFileWritten, add_answer_arguments, answer_options
from longalign.arguments import at_least
from longalign.datagen.prompts import SHIPPED
from longalign.serving import ChatClient, add_server_arguments, server_settings

DESCRIPTION = """\
Long instruction data from any OpenAI-compatible model (vllm serve, SGLang, a hosted API), written as chat
JSONL that pre-tokenize and train read as they are.

    longalign data self-instruct --docs docs/ --tokenizer MODEL --max-tokens 30000 --per-doc 3 \\
        --output out/gen --base-url http://127.0.0.1:8000/v1 --served-model Qwen2.5-72B-Instruct
    longalign data agentwrite --prompts writing.jsonl --output out/write \\
        --base-url http://127.0.0.1:8000/v1 --served-model Qwen2.5-72B-Instruct

Both write OUTPUT/data.jsonl ({"messages": [...], "meta": {...}} per sample), OUTPUT/report.json and
OUTPUT/calls.jsonl (every answer paid for; .OUTPUT.calls.jsonl next to it while the run is in progress).
Run again into the same OUTPUT (after a crash, a kill -9, failed calls, or with more documents, --per-doc
or --turns) and only the requests without an answer are asked; --fresh asks everything. --batch sends the
requests of each round through the server's batch API; --batch-file-only writes them as a file for
vllm run-batch, and --batch-results FILE reads its results back."""

SELF_INSTRUCT = """\
Self-instruct over long documents: for each sample, one call asks the model for an instruction of a task
type that needs the whole document, and one answers it with the document in context.

    longalign data self-instruct --docs docs/ --tokenizer MODEL --min-tokens 8000 --max-tokens 60000 \\
        --per-doc 4 --turns 2 --output out/gen --base-url URL --served-model NAME

Documents over --max-tokens (counted with --tokenizer, the model you will train) are cut at their last
paragraph break that fits; documents under --min-tokens, or with no break in range, are skipped; the
report counts both. The prompts are the files in {shipped}; --prompts DIR replaces any of them
(instruction.txt, follow_up.txt, user_turn.txt, tasks.txt) by a file of the same name."""

AGENTWRITE = """\
AgentWrite: for each writing prompt, the model plans the answer as numbered paragraphs with word counts,
then writes them one by one, each call given the instruction, the plan and the text so far.

    longalign data agentwrite --prompts writing.jsonl --output out/write --base-url URL --served-model NAME

--prompts holds one {{"prompt": "...", "length": 5000}} object a line (length in words, optional). A plan
that cannot be parsed, or has more than --max-steps paragraphs, is dropped and its reason reported. The
prompts are plan.txt and write.txt in {shipped}; --templates DIR replaces either."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``data`` command's subcommands and their flags."""
    tasks = parser.add_subparsers(dest="task", required=True, metavar="TASK")
    shipped = str(SHIPPED)
    for name, help_text, description, add in (
        ("self-instruct", "long documents -> instruction chats", SELF_INSTRUCT, _self_instruct_arguments),
        ("agentwrite", "writing prompts -> long planned answers", AGENTWRITE, _agentwrite_arguments),
    ):
        sub = tasks.add_parser(
            name,
            help=help_text,
            description=description.format(shipped=shipped),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        add(sub)
        sub.add_argument("--output", required=True, help="output directory (replaced atomically)")
        sub.add_argument("--seed", type=at_least(0), default=0, help="seed of task choices and of the calls")
        sub.add_argument(
            "--temperature", type=float, default=0.7, help="sampling temperature of every call (default 0.7)"
        )
        sub.add_argument(
            "--max-new-tokens",
            type=at_least(1),
            default=4096,
            help="longest reply of one call (default 4096)",
        )
        add_server_arguments(sub, required=False)
        add_answer_arguments(sub)


def _self_instruct_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--docs", required=True, help="a directory of .txt/.md files, or JSONL with a 'text' field"
    )
    parser.add_argument("--tokenizer", required=True, help="the tokenizer of the model you will train")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument(
        "--min-tokens", type=at_least(0), default=0, help="documents shorter than this are skipped"
    )
    parser.add_argument(
        "--max-tokens", type=at_least(1), required=True, help="longer documents are cut at a paragraph break"
    )
    parser.add_argument("--tasks", help="task types, comma-separated (default: all those in tasks.txt)")
    parser.add_argument("--per-doc", type=at_least(1), default=1, help="samples per document (default 1)")
    parser.add_argument("--turns", type=at_least(1), default=1, help="user turns per sample (default 1)")
    parser.add_argument("--prompts", help="a directory of prompt files that replace the shipped ones")


def _agentwrite_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prompts", required=True, help='JSONL of writing prompts: {"prompt": "...", "length": WORDS}'
    )
    parser.add_argument(
        "--templates", help="a directory with plan.txt / write.txt that replace the shipped ones"
    )
    parser.add_argument(
        "--max-steps",
        type=at_least(1),
        default=20,
        help="plans with more paragraphs are dropped (default 20)",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``longalign data TASK`` and print where the samples went (or the batch input file written)."""
    from longalign.datagen import agentwrite, self_instruct

    answers = answer_options(args)
    client = ChatClient(server_settings(args, url_needed=answers.mode != FILE))
    common = {
        "client": client,
        "seed": args.seed,
        "temperature": args.temperature,
        "max_new_tokens": args.max_new_tokens,
        "answers": answers,
    }
    try:
        if args.task == "self-instruct":
            from longalign.chat_template import open_tokenizer

            report = self_instruct.generate(
                args.docs,
                args.output,
                tokenizer=open_tokenizer(args.tokenizer, trust_remote_code=args.trust_remote_code),
                min_tokens=args.min_tokens,
                max_tokens=args.max_tokens,
                tasks=args.tasks,
                per_doc=args.per_doc,
                turns=args.turns,
                prompts_dir=args.prompts,
                **common,
            )
        else:
            report = agentwrite.generate(
                args.prompts, args.output, templates_dir=args.templates, max_steps=args.max_steps, **common
            )
    except BatchFileWritten as written:
        print(written.instructions())
        return 0
    print(summary(report, args.output))
    return 0


def summary(report: dict, output: str) -> str:
    """The lines a run prints: samples made and dropped, calls, answers reused, batches, tokens, time."""
    samples, calls, tokens, batch = report["samples"], report["calls"], report["tokens"], report["batch"]
    dropped = ", ".join(f"{n} {reason}" for reason, n in samples["dropped"].items()) or "none"
    limited = (
        f", {calls['rate_limited']} rate-limited ({calls['rate_limit_wait_seconds']:.1f} s waited, "
        f"concurrency down to {calls['lowest_concurrency']})"
        if calls["rate_limited"]
        else ""
    )
    lines = [
        f"wrote {output}/data.jsonl: {samples['made']} of {samples['planned']} samples (dropped: {dropped})",
        f"calls: {calls['made']} made ({calls['failed']} failed, {calls['retried']} retried{limited}), "
        f"{calls['reused']} answers reused ({tokens['reused_prompt'] + tokens['reused_completion']} tokens saved)",
        f"tokens: {tokens['prompt']} prompt + {tokens['completion']} completion, as the server reported",
        f"time: {report['wall_seconds']:.1f} s, {report['seconds_per_sample']:.2f} s per sample",
    ]
    if batch is not None:
        lines.insert(
            2,
            f"batches: {batch['submitted']} submitted, {batch['picked_up']} picked up again, "
            f"{batch['files_written']} files written; {batch['requests']} requests, {batch['answered']} "
            f"answered, {batch['failed']} failed",
        )
    if "documents" in report:
        documents = report["documents"]
        skipped = ", ".join(f"{n} {reason}" for reason, n in documents["skipped"].items()) or "none"
        lines.insert(
            0,
            f"documents: {documents['read']} read, {documents['used']} used ({documents['cut']} cut), "
            f"skipped: {skipped}",
        )
    return "\n".join(lines)

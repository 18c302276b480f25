"""``longalign eval needle|ruler|chat|write``: the flags of each task and the run from flags to an output directory.

    longalign eval needle --model out/run --lengths 1000,2000,4000 --output out/eval/needle
    longalign eval needle --model out/run --lengths 1000,2000,4000 --score logprob --output out/eval/needle-lp
    longalign eval ruler --model out/run --lengths 4k,8k,16k --samples-per-task 50 --output out/eval/ruler
    longalign eval chat --model out/run --data longbench_chat.jsonl --judge-base-url URL --judge-model M --output DIR
    longalign eval write --backend openai --base-url URL --served-model M --data w.jsonl ...   # no tokenizer needed
    accelerate launch -m longalign eval needle --model out/run ...      # prompts shared out; rank 0 writes

Every task writes ``results.jsonl``, ``summary.json`` and ``run_config.json`` (every setting; the API
key's variable named, never the key) into ``--output`` by the rules of every stage's output. A task that
asks a server (``--backend openai``, a judge) also writes ``calls.jsonl`` (every answer paid for, read
first by the next run into the same output; ``longalign.answers``) and ``report.json`` (its calls).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from longalign.answers import (
    FILE,
    AnswerStore,
    BatchFileWritten,
    StoredCalls,
    add_answer_arguments,
    answer_options,
)
from longalign.arguments import at_least, parse_lengths
from longalign.errors import ConfigError
from longalign.redact import redact_text
from longalign.serving import ChatClient, ServerSettings, add_server_arguments, server_settings

if TYPE_CHECKING:
    from longalign.eval.judge import Judge
    from longalign.eval.models import Generator, Prompt

JUDGE_KEY_ENV = "JUDGE_API_KEY"  # the judge's key; OPENAI_API_KEY when this one is unset


_positive_int = at_least(1)


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``needle``, ``ruler``, ``chat`` and ``write`` subcommands under ``parser``."""
    tasks = parser.add_subparsers(dest="task", required=True, metavar="TASK")
    for name, (summary, description, add_task_arguments) in TASKS.items():
        sub = tasks.add_parser(
            name, help=summary, description=description, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        _model_arguments(sub)
        add_task_arguments(sub)


def run(args: argparse.Namespace) -> int:
    """Run the chosen task; the exit status (0 too when a batch input file was written for an offline runner)."""
    try:
        return RUNNERS[args.task](args)
    except BatchFileWritten as written:
        print(written.instructions())
        return 0


def _model_arguments(parser: argparse.ArgumentParser) -> None:
    from longalign.config import TORCH_DTYPES

    group = parser.add_argument_group("the model")
    group.add_argument(
        "--model",
        help="a run's output directory or checkpoint, a [lora] adapter directory (its base from "
        "adapter_config.json), or a hub id (--backend transformers)",
    )
    group.add_argument(
        "--backend",
        choices=("transformers", "openai"),
        default="transformers",
        help="transformers: load --model here; openai: an OpenAI-compatible server (--base-url, --served-model)",
    )
    group.add_argument(
        "--tokenizer",
        help="measures lengths and renders the chat template (default: --model's own; with --backend openai "
        "only needle, ruler and chat's --max-length need one)",
    )
    group.add_argument("--chat-template", type=Path, help="Jinja file that replaces the tokenizer's template")
    group.add_argument(
        "--dtype", choices=TORCH_DTYPES, default="auto", help="weights dtype (default: the model's)"
    )
    group.add_argument("--max-new-tokens", type=_positive_int, help="tokens generated per prompt, at most")
    group.add_argument(
        "--temperature", type=_non_negative_float, default=0.0, help="0 (the default): greedy decoding"
    )
    group.add_argument(
        "--batch-size", type=_positive_int, default=1, help="prompts per generate() call, grouped by length"
    )
    group.add_argument("--seed", type=int, default=0, help="the prompts' randomness and sampling")
    group.add_argument("--trust-remote-code", action="store_true")
    group.add_argument("--output", required=True, help="output directory (replaced atomically)")
    add_server_arguments(parser, required=False)
    add_answer_arguments(parser)


def _needle_arguments(parser: argparse.ArgumentParser) -> None:
    from longalign.config import NEEDLE_DEPTHS, NEEDLE_LENGTHS

    parser.add_argument(
        "--lengths",
        default=",".join(map(str, NEEDLE_LENGTHS)),
        help="prompt lengths in tokens, chat template included (4k = 4096)",
    )
    parser.add_argument(
        "--depths", default=",".join(map(str, NEEDLE_DEPTHS)), help="needle depths, percent of the haystack"
    )
    parser.add_argument(
        "--samples-per-cell", type=_positive_int, default=1, help="prompts per length and depth"
    )
    parser.add_argument(
        "--haystack",
        type=Path,
        help="a .txt file or a directory of them (default: generated filler sentences)",
    )
    parser.add_argument(
        "--needle", help="the fact to hide (default: a random key and 7-digit value per prompt)"
    )
    parser.add_argument("--question", help="the question about --needle")
    parser.add_argument("--answer", help="the answer to --question; a reply scores 100 if it contains it")
    parser.add_argument(
        "--answer-prefix", default="", help="how an answer to --question begins (--score logprob)"
    )
    _score_arguments(parser)


def _score_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--score",
        choices=("generate", "logprob"),
        default="generate",
        help="generate: the answer must appear in the reply; logprob: one teacher-forced forward per prompt "
        "(the answer's mean log-probability, and whether greedy decoding gives it)",
    )
    parser.add_argument(
        "--pack-tokens",
        type=_positive_int,
        help="--score logprob: tokens per packed row (default: the longest length)",
    )
    parser.add_argument(
        "--attn-backend", default="auto", help="--score logprob: the varlen attention backend"
    )


def _ruler_arguments(parser: argparse.ArgumentParser) -> None:
    from longalign.config import RULER_LENGTHS

    parser.add_argument(
        "--lengths",
        default=",".join(f"{n // 1024}k" for n in RULER_LENGTHS),
        help="lengths in tokens as RULER counts them: the prompt (chat template and answer prefix included) "
        "and the task's generation budget (4k = 4096)",
    )
    parser.add_argument(
        "--tasks",
        help="comma-separated task names (default: every task whose file is given; with --score logprob, "
        "those whose answer has one order)",
    )
    parser.add_argument(
        "--samples-per-task", type=_positive_int, default=100, help="prompts per task and length"
    )
    parser.add_argument(
        "--haystack",
        type=Path,
        help="essay text: RULER's PaulGrahamEssays.json (its download's {\"text\": ...}; needed for a run "
        "comparable with RULER's table), a .txt file or a directory of them (default: generated filler sentences)",
    )
    parser.add_argument("--squad", type=Path, help="qa_squad: SQuAD's JSON (e.g. dev-v2.0.json)")
    parser.add_argument(
        "--english-words",
        type=Path,
        help="cwe: RULER's english_words.json (a Git LFS file of its repository), the words it draws past "
        "wonderwords' lists, at the longest lengths (without it adjective-noun pairs there, not comparable)",
    )
    parser.add_argument(
        "--served-endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="--backend openai: completions (default): /v1/completions with the chat template applied here and "
        "the answer prefix in the assistant's turn (RULER's path for open models, served by vLLM); chat: "
        "/v1/chat/completions with the prefix ending the user's message (RULER's path for API models)",
    )
    parser.add_argument(
        "--hotpot", type=Path, help="qa_hotpot: HotpotQA's JSON (e.g. hotpot_dev_distractor_v1.json)"
    )
    parser.add_argument(
        "--threshold",
        type=_non_negative_float,
        help="the effective length is the longest up to which every average is at least this "
        "(default: 85.6, RULER's)",
    )
    _score_arguments(parser)


def _chat_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data", type=Path, required=True, help="JSON or JSONL rows: prompt, query, answer (, idx)"
    )
    parser.add_argument("--few-shots", type=Path, help="graded example answers shown to the judge")
    parser.add_argument("--max-length", type=_positive_int, help="cut the middle of longer prompts (tokens)")
    _judge_arguments(parser, required=True)


def _write_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", type=Path, required=True, help="JSON or JSONL rows: prompt, length (, idx)")
    _judge_arguments(parser, required=False)


def _judge_arguments(parser: argparse.ArgumentParser, *, required: bool) -> None:
    add_server_arguments(parser, prefix="judge-", default_key_env=JUDGE_KEY_ENV, required=required)
    parser.add_argument(
        "--judge-retries",
        type=at_least(0),
        default=2,
        help="asks again when a reply holds no [[rating]] (default: 2)",
    )


# --- shared steps ------------------------------------------------------------------------------------------


class Session:
    """What every task resolves from the model flags: the tokenizer, the generator, the judge, the answer store.

    ``needs_tokenizer`` says why the task needs a tokenizer with ``--backend openai`` (None: it does not);
    without one, ``tokenizer`` is None and prompts are text (``models.text_prompt``). Served models and
    judges answer through one ``AnswerStore`` of ``--output``, written with the outputs
    (``write_outputs``); local generation needs none.
    """

    def __init__(
        self,
        args: argparse.Namespace,
        *,
        default_new_tokens: int,
        needs_tokenizer: str | None = "it measures the prompts' lengths",
    ) -> None:
        from longalign.eval.models import default_tokenizer, eval_tokenizer

        self.args = args
        self.max_new_tokens = args.max_new_tokens or default_new_tokens
        self.answers = answer_options(args)
        self.settings: ServerSettings | None = None
        self._store: AnswerStore | None = None
        self._calls: dict[str, StoredCalls] = {}  # "model", "judge"
        if args.backend == "openai":
            self.settings = server_settings(args, url_needed=self.answers.mode != FILE)
            if not args.tokenizer and needs_tokenizer:
                raise ConfigError(f"--tokenizer: needed with --backend openai ({needs_tokenizer})")
        elif not args.model:
            raise ConfigError("--model: missing; name a run's output, a checkpoint or an adapter directory")
        self.tokenizer = None
        if args.tokenizer or args.backend != "openai":
            self.tokenizer = eval_tokenizer(
                args.tokenizer or default_tokenizer(args.model),
                chat_template=args.chat_template,
                trust_remote_code=args.trust_remote_code,
            )

    def load_model(self, *, packed: bool = False, attn_backend: str = "auto"):
        """The local model on this rank's device."""
        from accelerate import PartialState

        from longalign.eval.models import load_model
        from longalign.eval.ranks import leave_group_at_exit

        state = PartialState()  # joins the launch's process group, if any
        leave_group_at_exit()
        return load_model(
            self.args.model,
            dtype=self.args.dtype,
            device=state.device,
            packed=packed,
            attn_backend=attn_backend,
            trust_remote_code=self.args.trust_remote_code,
        )

    def served(self, settings: ServerSettings, *, role: str) -> StoredCalls:
        """The calls to a served model (``role`` "model" or "judge"), answered through ``--output``'s store."""
        if self._store is None:
            self._store = AnswerStore(self.args.output, fresh=self.answers.fresh)
        self._calls[role] = StoredCalls(self._store, ChatClient(settings), self.answers)
        return self._calls[role]

    def generator(
        self, lengths: Sequence[int], new_tokens: Sequence[int] | None = None, *, endpoint: str = "chat"
    ) -> Generator:
        """The local or served generator, after checking that the prompts fit the local model with the tokens
        each may generate (``new_tokens``, one per prompt; else ``--max-new-tokens``); a served one asks
        ``endpoint`` (``ServedGenerator``)."""
        from longalign.eval.models import LocalGenerator, ServedGenerator, check_fits, context_limit

        if self.settings is not None:
            return ServedGenerator(
                self.served(self.settings, role="model"),
                max_new_tokens=self.max_new_tokens,
                temperature=self.args.temperature,
                seed=self.args.seed,
                endpoint=endpoint,
            )
        model = self.load_model()
        check_fits(
            lengths,
            context_limit(model),
            new_tokens=self.max_new_tokens if new_tokens is None else new_tokens,
        )
        return LocalGenerator(
            model,
            self.tokenizer,
            max_new_tokens=self.max_new_tokens,
            temperature=self.args.temperature,
            batch_size=self.args.batch_size,
            seed=self.args.seed,
        )

    def judge(self, *, system: str) -> Judge:
        """The ``Judge`` of the ``--judge-*`` flags; the key from JUDGE_API_KEY, else OPENAI_API_KEY."""
        from longalign.eval.judge import Judge

        args = self.args
        if args.judge_api_key_env == JUDGE_KEY_ENV and not os.environ.get(JUDGE_KEY_ENV):
            args.judge_api_key_env = "OPENAI_API_KEY"
        settings = server_settings(args, prefix="judge-", url_needed=self.answers.mode != FILE)
        return Judge(self.served(settings, role="judge"), retries=args.judge_retries, system=system)

    def prompts(self, texts: Sequence[str], *, max_length: int | None = None) -> list[Prompt]:
        """One-turn chats of ``texts``: in token ids (middle cut to ``max_length``) with a tokenizer, else text."""
        from longalign.eval.chat import middle_cut_prompt
        from longalign.eval.models import chat_frame, text_prompt

        if self.tokenizer is None:
            return [text_prompt(text) for text in texts]
        frame = chat_frame(self.tokenizer)
        return [middle_cut_prompt(self.tokenizer, t, max_length=max_length, frame=frame) for t in texts]

    def record(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """``run_config.json``: every flag (URLs without passwords, key variables by name), versions, extras."""
        import torch
        import transformers

        import longalign

        flags = {
            key: redact_text(value) if key.endswith("base_url") and value else value
            for key, value in vars(self.args).items()
            if not callable(value)
        }
        return {
            "task": self.args.task,
            "flags": json.loads(json.dumps(flags, default=str)),
            "max_new_tokens": self.max_new_tokens,
            "server": self.settings.record() if self.settings else None,
            "versions": {
                "longalign": getattr(longalign, "__version__", None),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
            },
            **(extra or {}),
        }

    def write_outputs(
        self,
        inputs: Sequence[Any],
        rows: Sequence[dict[str, Any]],
        summary: dict[str, Any],
        record: dict[str, Any],
        plot: Callable[[Path], None] | None = None,
        extra_files: dict[str, str] | None = None,
    ) -> None:
        """The task's files into ``--output``, with ``calls.jsonl`` and ``report.json`` when a server answered."""
        from longalign.artifacts import write_report
        from longalign.eval.outputs import write_outputs

        def calls(staging: Path) -> None:
            self._store.write(staging)
            write_report(staging, {role: _calls_report(c) for role, c in self._calls.items()})

        write_outputs(
            self.args.output,
            rows,
            summary,
            record,
            stage=f"eval {self.args.task}",
            inputs=inputs,
            extra_files=extra_files,
            plot=plot,
            calls=calls if self._store is not None else None,
        )
        if self._store is not None:
            self._store.discard_work()
            for role, served in self._calls.items():
                print(f"{role}: {_calls_line(served.report())}")


def _calls_report(calls: StoredCalls) -> dict[str, Any]:
    return {"server": calls.settings.record(), **calls.report()}


def _calls_line(report: dict[str, Any]) -> str:
    """``12 calls made (0 failed, 0 retried, 0 rate-limited), 38 answers reused (51200 tokens saved)``."""
    calls, tokens, batch = report["calls"], report["tokens"], report["batch"]
    line = (
        f"{calls['made']} calls made ({calls['failed']} failed, {calls['retried']} retried, "
        f"{calls['rate_limited']} rate-limited), {calls['reused']} answers reused "
        f"({tokens['reused_prompt'] + tokens['reused_completion']} tokens saved)"
    )
    if batch is not None:
        line += f"; batches: {batch['submitted']} submitted, {batch['requests']} requests"
    return line


def _teacher_forced(
    session: Session, cases: Sequence[Any], *, row: Callable, progress: str
) -> list[dict[str, Any]] | None:
    """``--score logprob``: every case's answer read in packed rows of the local model; the rows on rank 0.

    ``cases`` carry ``length``, ``prompt`` and ``answer_ids``; ``row(case, score, tokenizer)`` makes each
    result row. The packed rows are dealt over the ranks, not the prompts: the same rows, so the same
    scores, on any number of ranks, and in a training run's ``[eval_tasks]``.
    """
    from longalign.eval.models import check_fits, context_limit
    from longalign.eval.needle import default_pack_tokens, score_answers_across_ranks

    args = session.args
    model = session.load_model(packed=True, attn_backend=args.attn_backend)
    check_fits([len(c.prompt.input_ids) + len(c.answer_ids) for c in cases], context_limit(model))
    scores = score_answers_across_ranks(
        model,
        [(c.prompt.input_ids, c.answer_ids) for c in cases],
        pack_tokens=args.pack_tokens or default_pack_tokens(cases),
        progress=progress,
    )
    return (
        None if scores is None else [row(c, s, session.tokenizer) for c, s in zip(cases, scores, strict=True)]
    )


def _check_output(args: argparse.Namespace, *, inputs: Sequence[str]) -> None:
    """Refuse a bad ``--output`` before any work (the same rule holds again when it is written)."""
    from longalign.artifacts import check_output

    check_output(args.output, inputs=inputs)


def _local_inputs(args: argparse.Namespace, *paths: Path | None) -> list[str]:
    """The inputs the output may not be or contain: a local --model and the task's files."""
    found = [str(p) for p in paths if p is not None]
    if args.model and Path(args.model).exists():
        found.append(args.model)
    return found


# --- needle ------------------------------------------------------------------------------------------------


def _needle_setting(args: argparse.Namespace):
    from longalign.eval.needle import Needle

    given = {flag: getattr(args, flag) for flag in ("needle", "question", "answer")}
    if not any(given.values()):
        return None
    missing = [f"--{flag}" for flag, value in given.items() if not value]
    if missing:
        raise ConfigError(
            f"{', '.join(missing)}: missing; a needle of your own needs --needle, --question and --answer"
        )
    return Needle(args.needle, args.question, args.answer, args.answer_prefix)


def _run_needle(args: argparse.Namespace) -> int:
    from longalign.eval import needle as nd
    from longalign.eval.ranks import across_ranks

    lengths = parse_lengths(args.lengths)
    try:
        depths = sorted({int(part) for part in args.depths.split(",") if part.strip()})
    except ValueError:
        raise ConfigError(f"--depths {args.depths!r}: expected percentages, e.g. 0,25,50,75,100") from None
    if not depths or not all(0 <= d <= 100 for d in depths):
        raise ConfigError(f"--depths {args.depths!r}: expected percentages from 0 to 100")
    logprob = args.score == "logprob"
    if logprob and args.backend == "openai":
        raise ConfigError("--score logprob: needs the model's weights (--backend transformers)")
    _check_output(args, inputs=_local_inputs(args, args.haystack))
    session = Session(args, default_new_tokens=32, needs_tokenizer="it builds prompts of exact token lengths")
    pool = nd.haystack_pool(session.tokenizer, args.haystack, seed=args.seed)
    cases = nd.build_cases(
        session.tokenizer,
        pool,
        lengths=lengths,
        depths=depths,
        samples=args.samples_per_cell,
        seed=args.seed,
        needle=_needle_setting(args),
        with_answer_prefix=logprob,
    )
    started = time.perf_counter()
    if logprob:
        rows = _teacher_forced(session, cases, row=nd.logprob_row, progress="needle (rows)")
    else:
        generator = session.generator([len(c.prompt.input_ids) for c in cases])

        def work(mine):
            replies = generator.generate([c.prompt for c in mine], progress="needle")
            return [nd.generation_row(c, r) for c, r in zip(mine, replies, strict=True)]

        rows = across_ranks(cases, work)
    if rows is None:
        return 0
    seconds = time.perf_counter() - started
    summary = {**nd.summary(rows), "score": args.score, "seconds": round(seconds, 3)}
    title = f"{args.model or args.served_model} ({args.score})"
    session.write_outputs(
        _local_inputs(args, args.haystack),
        rows,
        summary,
        session.record({"lengths": lengths, "depths": depths}),
        plot=lambda d: nd.plot_heatmap(summary, d / "heatmap.png", title=title),
        extra_files={"summary.csv": nd.summary_csv(summary)},
    )
    overall = "n/a" if summary["overall"] is None else f"{summary['overall']:.1f}"
    extra = f", mean log-probability {summary['mean_logprob']:.3f}" if "mean_logprob" in summary else ""
    print(f"needle: {len(rows)} prompts in {seconds:.1f} s, score {overall}{extra}; wrote {args.output}")
    return 0


# --- ruler -------------------------------------------------------------------------------------------------


def _run_ruler(args: argparse.Namespace) -> int:
    from longalign.eval import ruler
    from longalign.eval.ranks import across_ranks

    lengths = parse_lengths(args.lengths)
    logprob = args.score == "logprob"
    if logprob and args.backend == "openai":
        raise ConfigError("--score logprob: needs the model's weights (--backend transformers)")
    squad = ruler.read_squad(args.squad) if args.squad else None
    hotpot = ruler.read_hotpot(args.hotpot) if args.hotpot else None
    tasks = ruler.select_tasks(args.tasks, squad=squad, hotpot=hotpot, logprob=logprob)
    threshold = ruler.THRESHOLD if args.threshold is None else args.threshold
    files = (args.haystack, args.squad, args.hotpot, args.english_words)
    chat = args.backend == "openai" and args.served_endpoint == "chat"
    path = ruler.PROMPT_PATHS["chat" if chat else "completions" if args.backend == "openai" else "local"]
    _check_output(args, inputs=_local_inputs(args, *files))
    new_tokens = {task: args.max_new_tokens or ruler.TASKS[task].new_tokens for task in tasks}
    session = Session(
        args,
        default_new_tokens=max(new_tokens.values()),
        needs_tokenizer="it sizes the prompts in tokens and renders the chat template, as RULER does",
    )
    cases = ruler.build_instances(
        session.tokenizer,
        tasks=tasks,
        lengths=lengths,
        samples_per_task=args.samples_per_task,
        seed=args.seed,
        haystack=args.haystack,
        squad=squad,
        hotpot=hotpot,
        english_words=args.english_words,
        new_tokens=new_tokens,
        # a chat server writes the generation prompt itself: RULER ends the user's message with the prefix
        prefix_in="user" if chat else "assistant",
    )
    started = time.perf_counter()
    if logprob:
        rows = _teacher_forced(session, cases, row=ruler.logprob_row, progress="ruler (rows)")
    else:
        generator = session.generator(
            [len(c.prompt.input_ids) for c in cases],
            [c.new_tokens for c in cases],
            endpoint="chat" if chat else "completions",
        )

        def work(mine):
            replies = [None] * len(mine)
            for budget in sorted(set(new_tokens.values())):
                group = [i for i, c in enumerate(mine) if new_tokens[c.task] == budget]
                if not group:
                    continue
                generator.max_new_tokens = budget  # one generator (one model load), each task's own budget
                found = generator.generate(
                    [mine[i].prompt for i in group], progress=f"ruler ({budget} tokens)"
                )
                for i, reply in zip(group, found, strict=True):
                    replies[i] = reply
            return [ruler.generation_row(c, r) for c, r in zip(mine, replies, strict=True)]

        rows = across_ranks(cases, work)
    if rows is None:
        return 0
    seconds = time.perf_counter() - started
    inputs = ruler.reference_inputs(args.haystack, args.squad, args.hotpot, args.english_words)
    summary = {
        **ruler.summary(rows, threshold=threshold, inputs=inputs),
        "prompt_path": path,
        "score": args.score,
        "seconds": round(seconds, 3),
    }
    extra = {
        "wonderwords": importlib.metadata.version("wonderwords"),  # its word lists make the prompts
        "lengths": lengths,
        "tasks": tasks,
        "threshold": threshold,
        "new_tokens": new_tokens,
        "prompt_path": path,
        "qa_skipped": {name: data.skipped for name, data in (("squad", squad), ("hotpot", hotpot)) if data},
    }
    title = f"{args.model or args.served_model} ({args.score})"
    session.write_outputs(
        _local_inputs(args, *files),
        rows,
        summary,
        session.record(extra),
        plot=lambda d: ruler.plot_heatmap(summary, d / "ruler.png", title=title),
        extra_files={"summary.csv": ruler.summary_csv(summary)},
    )
    label, values = ruler.averages(summary)
    shown = ", ".join(f"{length} {'n/a' if v is None else f'{v:.1f}'}" for length, v in values.items())
    if summary["comparable"]:
        verdict = f"effective length {summary['effective_length'] or 'none'} (threshold {threshold:g})"
    else:
        verdict = "not comparable with RULER's table: " + "; ".join(summary["not_comparable_because"])
    print(
        f"ruler: {len(rows)} prompts in {seconds:.1f} s; {label} by length: {shown}; {verdict}; wrote {args.output}"
    )
    return 0


# --- chat --------------------------------------------------------------------------------------------------


def _run_chat(args: argparse.Namespace) -> int:
    from longalign.eval import chat
    from longalign.eval.judge import JUDGE_SYSTEM, JudgeCase
    from longalign.eval.ranks import across_ranks

    cases = chat.read_chat_cases(args.data)
    examples = chat.read_examples(args.few_shots, cases) if args.few_shots else None
    _check_output(args, inputs=_local_inputs(args, args.data, args.few_shots))
    cut = None if args.max_length is None else "--max-length cuts the prompts' middle in tokens"
    session = Session(args, default_new_tokens=1024, needs_tokenizer=cut)
    judge = session.judge(system=JUDGE_SYSTEM)
    prompts = session.prompts([c.prompt for c in cases], max_length=args.max_length)
    generator = session.generator(_lengths(prompts))
    replies = across_ranks(prompts, lambda mine: generator.generate(mine, progress="chat"))
    if replies is None:
        return 0
    answered = [i for i, r in enumerate(replies) if not r.error]
    verdicts = judge.rate(
        [
            JudgeCase(question=cases[i].query, answer=replies[i].text, reference=cases[i].answer)
            for i in answered
        ],
        [examples[i] for i in answered] if examples else None,
        progress="judging",
    )
    ratings = dict(zip(answered, verdicts, strict=True))
    rows = [
        chat.chat_row(c, p, r, ratings.get(i))
        for i, (c, p, r) in enumerate(zip(cases, prompts, replies, strict=True))
    ]
    summary = chat.chat_summary(rows)
    record = session.record({"judge": judge.client.settings.record()})
    session.write_outputs(_local_inputs(args, args.data, args.few_shots), rows, summary, record)
    mean = "n/a" if summary["mean"] is None else f"{summary['mean']:.2f}"
    print(f"chat: mean rating {mean} over {summary['rated']} of {summary['n']} cases "
         f"({summary['unrated']} unrated); wrote {args.output}")  # fmt: skip
    return 0


def _lengths(prompts: Sequence[Prompt]) -> list[int]:
    """The prompts' lengths in tokens, for a local model's limit; none for text prompts (a server measures)."""
    return [len(p.input_ids) for p in prompts if p.input_ids is not None]


# --- write -------------------------------------------------------------------------------------------------


def _run_write(args: argparse.Namespace) -> int:
    from longalign.eval import write
    from longalign.eval.judge import QUALITY_SYSTEM, JudgeCase
    from longalign.eval.ranks import across_ranks

    cases = write.read_write_cases(args.data)
    _check_output(args, inputs=_local_inputs(args, args.data))
    judged = bool(args.judge_base_url or args.judge_model)
    session = Session(args, default_new_tokens=8192, needs_tokenizer=None)
    judge = session.judge(system=QUALITY_SYSTEM) if judged else None
    prompts = session.prompts([c.prompt for c in cases])
    generator = session.generator(_lengths(prompts))
    replies = across_ranks(prompts, lambda mine: generator.generate(mine, progress="write"))
    if replies is None:
        return 0
    ratings: dict[int, Any] = {}
    if judge is not None:
        answered = [i for i, r in enumerate(replies) if not r.error]
        verdicts = judge.rate(
            [JudgeCase(question=cases[i].prompt, answer=replies[i].text) for i in answered],
            progress="judging",
        )
        ratings = dict(zip(answered, verdicts, strict=True))
    rows = [
        write.write_row(c, r, ratings.get(i)) for i, (c, r) in enumerate(zip(cases, replies, strict=True))
    ]
    summary = write.write_summary(rows, judged=judged)
    record = session.record({"judge": judge.client.settings.record() if judge else None})
    title = f"{args.model or args.served_model}: length score {summary['length_score'] or 0:.1f}"
    session.write_outputs(
        _local_inputs(args, args.data),
        rows,
        summary,
        record,
        plot=lambda d: write.plot_scatter(rows, d / "scatter.png", title=title),
    )
    score = "n/a" if summary["length_score"] is None else f"{summary['length_score']:.1f}"
    print(f"write: length score {score} over {summary['n']} requests; wrote {args.output}")
    return 0


TASKS = {
    "needle": (
        "needle-in-a-haystack grid: depth x length heatmap",
        "Needle in a haystack over a grid of prompt lengths x needle depths; writes results.jsonl,\n"
        "summary.json, summary.csv and heatmap.png.\n\n"
        "    longalign eval needle --model out/run --lengths 1000,2000,4000 --output out/eval/needle\n"
        "    longalign eval needle --model out/run --lengths 1k,2k,4k --score logprob --output out/eval/lp\n\n"
        "Prompts are built in token ids and are exactly --lengths tokens, chat template included. The needle\n"
        "goes to the sentence boundary nearest each depth; by default each prompt hides its own random key and\n"
        "7-digit value. --score logprob generates nothing: one teacher-forced forward per prompt, packed rows.",
        _needle_arguments,
    ),
    "ruler": (
        "RULER's synthetic tasks: retrieval, tracing, aggregation, QA; the effective length",
        "RULER's synthetic tasks (niah_single_1-3, niah_multikey_1-3, niah_multivalue, niah_multiquery, vt, cwe,\n"
        "fwe; qa_squad and qa_hotpot with --squad / --hotpot) at each of --lengths; writes results.jsonl,\n"
        "summary.json, summary.csv and ruler.png (tasks x lengths, with the average).\n\n"
        "    longalign eval ruler --model out/run --lengths 4k,8k,16k,32k --samples-per-task 50 --output out/eval/ruler\n"
        "    longalign eval ruler --model out/run --lengths 4k,8k --score logprob --output out/eval/ruler-lp\n\n"
        "Every prompt is RULER's: its text, the chat template around it, the answer prefix in the assistant's\n"
        "turn, sized as RULER sizes it (prompt + generation budget at most each of --lengths, in whole units of\n"
        "the haystack). Served models get it raw at /v1/completions (--served-endpoint chat: a chat with the\n"
        "prefix ending the user's message, RULER's path for API models). A reply scores the share of the\n"
        "references it contains x 100 (QA: 100 if it contains any). The effective length is the longest length\n"
        "up to which the average over the tasks stays at or above --threshold. Nothing is downloaded.",
        _ruler_arguments,
    ),
    "chat": (
        "LongBench-Chat style: answers rated 1-10 by a judge model",
        "The model answers each row's prompt; a judge model rates the answer 1-10 against the reference,\n"
        "writing [[n]] (the last one counts; a reply without one is asked again, then counted unrated).\n"
        "The judge's key comes from JUDGE_API_KEY, else OPENAI_API_KEY, or --judge-api-key-env.\n\n"
        "    longalign eval chat --model out/run --data longbench_chat.jsonl --max-length 32000 \\\n"
        "        --judge-base-url https://api.openai.com/v1 --judge-model gpt-4o --output out/eval/chat",
        _chat_arguments,
    ),
    "write": (
        "LongBench-Write: length score of long generations",
        "The model writes for each row's prompt; the length score compares the words + CJK characters\n"
        "written with the row's required length. With --judge-base-url, a judge also rates quality 1-10.\n"
        "Writes results.jsonl, summary.json and scatter.png.\n\n"
        "    longalign eval write --model out/run --data longbench_write.jsonl --output out/eval/write",
        _write_arguments,
    ),
}
RUNNERS = {"needle": _run_needle, "ruler": _run_ruler, "chat": _run_chat, "write": _run_write}

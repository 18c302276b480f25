"""Long-context scores while a run trains: the run file's ``[eval_tasks]``.

    [eval_tasks]
    needle = { lengths = [4096, 16384], depths = [0, 50, 100], every_steps = 200 }
    ruler = { tasks = ["niah_single_1", "vt"], lengths = [4096, 8192], samples_per_task = 20, every_steps = 500 }

Before the first step each task builds its prompts, once, as ``longalign eval needle|ruler --score
logprob`` builds them from the same settings. Then at step 0 (``on_start``) and after every
``every_steps`` optimizer steps, the trainer's own model scores the due tasks teacher-forced: the prompts
packed into rows, the rows dealt over the ranks, one forward per row, one gather. It logs, to every logger
of ``report_to`` and to ``trainer_state.json``::

    eval_tasks/needle            100 x the share of prompts whose answer greedy decoding reproduces
    eval_tasks/needle/logprob    the answers' mean log-probability
    eval_tasks/needle/4096       the score at each length
    eval_tasks/ruler             the average over the tasks scored and lengths (each length counts once)
    eval_tasks/ruler/4096        the average over the tasks at each length (not RULER's 13-task average:
                                 the tasks whose answer has one order, teacher-forced)
    eval_tasks/ruler/vt/4096     each task at each length
    eval_tasks/ruler/logprob, eval_tasks/ruler/effective_length (0: under the threshold at every length)

and rank 0 writes ``output_dir/eval_tasks/step-N/needle/`` (and ``ruler/``), the files of ``longalign
eval``. The rows are the command's rows, so the scores at step N are the command's on ``checkpoint-N``.

A task is a small piece (``ScoredTask``): its prompts with their answers, and what its scores become
(rows, summary, logged numbers, files). ``TASKS`` names them, as ``longalign.config.EVAL_TASKS`` names
their settings.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from transformers import TrainerCallback

import longalign.patch
from longalign.config import EvalTasksConfig, NeedleTaskConfig, RulerTaskConfig
from longalign.errors import ConfigError
from longalign.eval import needle as nd
from longalign.eval import ruler
from longalign.eval.needle import AnswerScore
from longalign.eval.outputs import write_outputs

PREFIX = "eval_tasks"  # of every logged name, and of the results' directory in output_dir


@dataclass
class TaskResults:
    """What one evaluation of a task gives: the rows of ``results.jsonl``, ``summary.json``, the logged numbers."""

    rows: list[dict[str, Any]]
    summary: dict[str, Any]
    metrics: dict[str, float]  # logged names (eval_tasks/...) -> values


class ScoredTask(Protocol):
    """A task scored teacher-forced during training, its prompts built once."""

    name: str  # the key of [eval_tasks], the directory under eval_tasks/step-N/
    every_steps: int
    settings: Any  # its [eval_tasks] table, checked (recorded in run_config.json)
    sequences: list[tuple[list[int], list[int]]]  # (prompt_ids, answer_ids) of every prompt, in order
    pack_tokens: int  # tokens per packed row

    plot_file: str  # the plot ``longalign eval`` draws of the summary

    def results(self, scores: Sequence[AnswerScore]) -> TaskResults: ...

    def summary_csv(self, summary: dict[str, Any]) -> str: ...

    def plot(self, summary: dict[str, Any], path: Path, *, title: str) -> None: ...


class NeedleTask:
    """``[eval_tasks] needle``: the needle grid of ``longalign eval needle --score logprob``."""

    name = "needle"
    plot_file = "heatmap.png"
    summary_csv = staticmethod(nd.summary_csv)
    plot = staticmethod(nd.plot_heatmap)

    def __init__(self, settings: NeedleTaskConfig, tokenizer) -> None:
        haystack = Path(settings.haystack) if settings.haystack else None
        pool = nd.haystack_pool(tokenizer, haystack, seed=settings.seed)
        self.cases = nd.build_cases(
            tokenizer,
            pool,
            lengths=settings.lengths,
            depths=settings.depths,
            samples=settings.samples_per_cell,
            seed=settings.seed,
            with_answer_prefix=True,
            lengths_setting="eval_tasks.needle.lengths",
        )
        self.settings = settings
        self.tokenizer = tokenizer
        self.every_steps = settings.every_steps
        self.sequences = [(c.prompt.input_ids, c.answer_ids) for c in self.cases]
        self.pack_tokens = settings.pack_tokens or nd.default_pack_tokens(self.cases)

    def results(self, scores: Sequence[AnswerScore]) -> TaskResults:
        rows = [nd.logprob_row(c, s, self.tokenizer) for c, s in zip(self.cases, scores, strict=True)]
        summary = {**nd.summary(rows), "score": "logprob"}
        metrics = {
            f"{PREFIX}/needle": summary["overall"],
            f"{PREFIX}/needle/logprob": summary["mean_logprob"],
            **{f"{PREFIX}/needle/{length}": score for length, score in summary["by_length"].items()},
        }
        return TaskResults(rows, summary, metrics)


class RulerTask:
    """``[eval_tasks] ruler``: RULER's tasks as ``longalign eval ruler --score logprob`` builds them."""

    name = "ruler"
    plot_file = "ruler.png"
    summary_csv = staticmethod(ruler.summary_csv)
    plot = staticmethod(ruler.plot_heatmap)

    def __init__(self, settings: RulerTaskConfig, tokenizer) -> None:
        hotpot = ruler.read_hotpot(Path(settings.hotpot)) if settings.hotpot else None
        self.cases = ruler.build_instances(
            tokenizer,
            tasks=_ruler_tasks(settings.tasks, hotpot=hotpot),
            lengths=settings.lengths,
            samples_per_task=settings.samples_per_task,
            seed=settings.seed,
            haystack=Path(settings.haystack) if settings.haystack else None,
            hotpot=hotpot,
            lengths_setting="eval_tasks.ruler.lengths",
        )
        self.settings = settings
        self.tokenizer = tokenizer
        self.every_steps = settings.every_steps
        self.threshold = ruler.THRESHOLD if settings.threshold is None else settings.threshold
        self.sequences = [(c.prompt.input_ids, c.answer_ids) for c in self.cases]
        self.pack_tokens = settings.pack_tokens or nd.default_pack_tokens(self.cases)

    def results(self, scores: Sequence[AnswerScore]) -> TaskResults:
        rows = [ruler.logprob_row(c, s, self.tokenizer) for c, s in zip(self.cases, scores, strict=True)]
        inputs = ruler.reference_inputs(
            Path(self.settings.haystack) if self.settings.haystack else None,
            hotpot=Path(self.settings.hotpot) if self.settings.hotpot else None,
        )
        summary = {
            **ruler.summary(rows, threshold=self.threshold, inputs=inputs),
            "prompt_path": ruler.PROMPT_PATHS["local"],
            "score": "logprob",
        }
        # the tasks that can be teacher-forced are never RULER's 13: their average, a signal for training
        _, average = ruler.averages(summary)
        averages = [v for v in average.values() if v is not None]
        effective = ruler.effective_length({int(n): v for n, v in average.items()}, self.threshold)
        metrics = {
            f"{PREFIX}/ruler": sum(averages) / len(averages) if averages else None,
            f"{PREFIX}/ruler/logprob": sum(r["logprob"] for r in rows) / len(rows),
            f"{PREFIX}/ruler/effective_length": effective or 0,  # 0: under the threshold at every length
            **{f"{PREFIX}/ruler/{length}": value for length, value in average.items()},
            **{
                f"{PREFIX}/ruler/{task}/{length}": value
                for task, by_length in summary["by_task_length"].items()
                for length, value in by_length.items()
            },
        }
        return TaskResults(rows, summary, metrics)


def _ruler_tasks(given: list[str] | None, *, hotpot) -> list[str]:
    """``eval_tasks.ruler.tasks`` checked: known, teacher-forceable, with their data; default all of those."""
    where = "eval_tasks.ruler.tasks"
    ordered = [name for name, task in ruler.TASKS.items() if task.one_order]
    unknown = [name for name in given or [] if name not in ruler.TASKS]
    if unknown:
        raise ConfigError(f"{where}: unknown task {', '.join(unknown)}; known: {', '.join(ruler.TASKS)}")
    unordered = [name for name in given or [] if name not in ordered]
    if unordered:
        raise ConfigError(
            f"{where}: {', '.join(unordered)}: the answer has no one order to teacher-force (scores during training "
            f"are teacher-forced); tasks it can score: {', '.join(ordered)}"
        )
    if "qa_hotpot" in (given or []) and hotpot is None:
        raise ConfigError(f"{where}: qa_hotpot needs HotpotQA's JSON, eval_tasks.ruler.hotpot")
    return ruler.select_tasks(given, hotpot=hotpot, logprob=True)


TASKS = {"needle": NeedleTask, "ruler": RulerTask}  # [eval_tasks] key -> the task built from its table


def build_tasks(config: EvalTasksConfig, tokenizer, *, context_limit: int | None) -> list[ScoredTask]:
    """Every task of ``[eval_tasks]`` with its prompts, built once; a length over ``context_limit`` is refused."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "[eval_tasks]: the run's tokenizer has no chat template, which the prompts are built with"
        )
    tasks = [TASKS[name](settings, tokenizer) for name, settings in config.tasks().items()]
    for task in tasks:
        longest = max(len(prompt) + len(answer) for prompt, answer in task.sequences)
        if context_limit is not None and longest > context_limit:
            raise ConfigError(
                f"eval_tasks.{task.name}.lengths: prompts of up to {longest} tokens with their answers are over the "
                f"model's limit of {context_limit} (max_position_embeddings)"
            )
    return tasks


def write_results(
    task: ScoredTask, directory: Path, results: TaskResults, record: dict[str, Any], *, title: str
) -> None:
    """The files ``longalign eval`` writes for the task, into ``directory``."""
    write_outputs(
        directory,
        results.rows,
        results.summary,
        record,
        stage=f"eval {task.name}",
        extra_files={"summary.csv": task.summary_csv(results.summary)},
        plot=lambda d: task.plot(results.summary, d / task.plot_file, title=title),
    )


def plan(tasks: Sequence[ScoredTask], world_size: int) -> list[str]:
    """What one evaluation of each task costs, a line each:

    ``needle every 200 steps: 44 prompts, 180,224 tokens in 12 rows of up to 16,416 (6 forwards per rank)``
    """
    lines = []
    for task in tasks:
        lengths = [len(prompt) + len(answer) - 1 for prompt, answer in task.sequences]
        rows = nd.pack_rows(lengths, task.pack_tokens)
        lines.append(
            f"{task.name} every {task.every_steps} step{'s' * (task.every_steps != 1)}: {len(lengths)} prompts, "
            f"{sum(lengths):,} tokens in "
            f"{len(rows)} rows of up to {task.pack_tokens:,} ({math.ceil(len(rows) / world_size)} forwards per rank)"
        )
    return lines


class EvalTasksCallback(TrainerCallback):
    """Scores ``tasks`` with the trainer's model at step 0 (``on_start``) and every task's ``every_steps``.

    Every rank takes part in every forward (a rank short of rows repeats one and drops its result), in eval
    mode, without gradients or a KV cache, and a model that splits packs over ranks attends whole rows
    (``longalign.patch.whole_rows``); so ZeRO-3, FSDP and sequence parallelism run it as DDP does.

        trainer.add_callback(EvalTasksCallback(trainer, build_tasks(cfg.eval_tasks, tokenizer, context_limit=8192)))
    """

    def __init__(self, trainer, tasks: Sequence[ScoredTask], *, on_start: bool = True) -> None:
        self.trainer = trainer
        self.tasks = list(tasks)
        self.on_start = on_start
        self.timed: set[str] = set()  # the tasks whose first evaluation has been timed

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            for line in plan(self.tasks, args.world_size):
                print(f"{PREFIX}: {line}", flush=True)
        if self.on_start and state.global_step == 0:  # a resume has been scored at its step already
            self.evaluate(0, self.tasks)

    def on_step_end(self, args, state, control, **kwargs):
        due = [task for task in self.tasks if state.global_step % task.every_steps == 0]
        if due:
            self.evaluate(state.global_step, due)

    def evaluate(self, step: int, tasks: Sequence[ScoredTask]) -> dict[str, float]:
        """Score ``tasks`` now, log their numbers and (rank 0) write their files; the numbers logged."""
        trainer = self.trainer
        model = trainer.model
        was_training = model.training
        model.eval()
        done: list[tuple[ScoredTask, TaskResults, float]] = []
        try:
            with longalign.patch.whole_rows(trainer.accelerator.unwrap_model(model)):
                for task in tasks:
                    start = time.perf_counter()
                    scores = nd.score_answers_across_ranks(
                        model,
                        task.sequences,
                        pack_tokens=task.pack_tokens,
                        lockstep=True,
                        every_rank=True,
                        device=trainer.args.device,
                    )
                    done.append((task, task.results(scores), time.perf_counter() - start))
        finally:
            model.train(was_training)
        logs: dict[str, float] = {}
        for task, results, seconds in done:
            results.summary.update(seconds=round(seconds, 3), step=step)
            logs.update({name: value for name, value in results.metrics.items() if value is not None})
            if not trainer.is_world_process_zero():
                continue
            record = {"task": task.name, "step": step, "settings": dataclasses.asdict(task.settings)}
            title = f"{Path(trainer.args.output_dir).name} step {step} (logprob)"
            directory = Path(trainer.args.output_dir) / PREFIX / f"step-{step}" / task.name
            write_results(task, directory, results, record, title=title)
            if task.name not in self.timed:
                print(
                    f"{PREFIX}: {task.name}'s first evaluation (step {step}) took {seconds:.1f} s", flush=True
                )
        self.timed.update(task.name for task in tasks)
        should_log = trainer.control.should_log  # the step's own log line, which logging would cancel
        trainer.log(logs)
        trainer.control.should_log = should_log
        return logs


def plot_scores(log_history: Sequence[dict[str, Any]], path: Path, *, title: str) -> None:
    """``trainer_state.json``'s ``eval_tasks/`` numbers against the step: scores, then mean log-probabilities.

    Each task's score and its score per length (ruler: the average over its tasks) on the left, its mean
    log-probability on the right, the value at step 0 (the model as the run started) drawn across as a
    dashed line.
    """
    from matplotlib.figure import Figure  # no pyplot, no display

    entries = [e for e in log_history if any(key.startswith(f"{PREFIX}/") for key in e)]
    names = sorted({key for e in entries for key in e if _drawn(key)}, key=_plot_order)
    panels = [
        ([n for n in names if not n.endswith("/logprob")], "score (0-100)"),
        ([n for n in names if n.endswith("/logprob")], "mean log-probability of the answer"),
    ]
    panels = [(keys, label) for keys, label in panels if keys]
    figure = Figure(figsize=(4.6 * len(panels), 3.4), layout="constrained")
    axes = figure.subplots(1, len(panels), squeeze=False)[0]
    for ax, (keys, label) in zip(axes, panels, strict=True):
        for key in keys:
            steps, values = zip(*[(e["step"], e[key]) for e in entries if key in e], strict=True)
            (line,) = ax.plot(steps, values, marker="o", markersize=3, label=key.removeprefix(f"{PREFIX}/"))
            if steps[0] == 0:
                ax.axhline(values[0], color=line.get_color(), linestyle="--", linewidth=0.8, alpha=0.6)
        ax.set(xlabel="optimizer step", ylabel=label)
        if label.startswith("score"):
            ax.set_ylim(-4, 104)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    figure.suptitle(title)
    figure.savefig(path, dpi=100)


def _drawn(name: str) -> bool:
    """A task's number, its number per length or its log-probability (not ruler's per task and length)."""
    if not name.startswith(f"{PREFIX}/"):
        return False
    _, _, rest = name.removeprefix(f"{PREFIX}/").partition("/")
    return rest in ("", "logprob") or rest.isdigit()


def _plot_order(name: str) -> tuple[str, int]:
    """A task's overall number first, then its lengths in order: needle, needle/256, needle/1024."""
    task, _, rest = name.removeprefix(f"{PREFIX}/").partition("/")
    return task, int(rest) if rest.isdigit() else -1

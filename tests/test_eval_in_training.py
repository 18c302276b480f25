"""[eval_tasks]: the scores a run logs while it trains are ``longalign eval --score logprob`` on its checkpoints.

The fast tests build the tasks and run the callback in one process; the launched ones train on two CPU
ranks (DDP, DDP with packs split over both ranks, ZeRO-3 with packs split) and score every saved
checkpoint afterwards with the command, whose files must equal what the run wrote and logged. Everything
runs with the network blocked (every rank of a launch too): only 127.0.0.1 can be reached.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import (
    DEMO,
    FLOAT32_BOUND,
    ROOT,
    TOKENIZER,
    assert_relatively_close,
    count_packs,
    demo_overrides,
    launch,
    launch_with_config,
    needs_deepspeed,
    needs_launcher,
    network_blocked_env,
    save_packs,
    save_tiny_model,
    tiny_model,
)
from transformers import AutoTokenizer, TrainerCallback, TrainingArguments

from longalign.artifacts import load_stage
from longalign.cli import main
from longalign.config import EvalTasksConfig, NeedleTaskConfig, load_config
from longalign.errors import ConfigError
from longalign.eval import needle as nd
from longalign.eval import ruler
from longalign.eval.in_training import (
    EvalTasksCallback,
    NeedleTask,
    build_tasks,
    plan,
    plot_scores,
    write_results,
)
from longalign.eval.models import load_model
from longalign.trainer import LongAlignTrainer

# 2 lengths x 3 depths: 6 prompts in 5 rows of up to 307 tokens (the two shortest share one), so on 2
# ranks one rank has a row fewer and repeats one in lockstep.
GRID = {"lengths": [110, 300], "depths": [0, 50, 100], "samples_per_cell": 1}
COMMAND_GRID = ["--lengths", "110,300", "--depths", "0,50,100", "--samples-per-cell", "1"]

# Each task of these tests: its [eval_tasks] table and the command's flags for the same prompts.
RUN_TASKS = {
    "needle": (GRID, COMMAND_GRID),
    "ruler": (
        {"tasks": ["niah_single_1", "fwe"], "lengths": [600], "samples_per_task": 2},
        ["--tasks", "niah_single_1,fwe", "--lengths", "600", "--samples-per-task", "2"],
    ),
}


def logged_numbers(name: str, summary: dict) -> dict[str, float]:
    """What the run must have logged for a task, read off the command's ``summary.json``."""
    if name == "needle":
        return {"eval_tasks/needle": summary["overall"], "eval_tasks/needle/logprob": summary["mean_logprob"]}
    return {
        # teacher-forced tasks are never RULER's 13: the run logs their partial average and its effective length
        "eval_tasks/ruler/effective_length": ruler.effective_length(
            {int(n): v for n, v in summary["partial_average_by_length"].items()}, summary["threshold"]
        )
        or 0,
        **{f"eval_tasks/ruler/{n}": v for n, v in summary["partial_average_by_length"].items()},
        **{
            f"eval_tasks/ruler/{t}/{n}": v
            for t, cells in summary["by_task_length"].items()
            for n, v in cells.items()
        },
    }


@pytest.fixture(autouse=True)
def offline(no_network):
    """Nothing here may reach the network: the prompts, haystacks and word lists are all local."""


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER)


def sample_model(**overrides) -> torch.nn.Module:
    """The tiny Llama with the sample tokenizer's vocabulary, patched for packed rows, in float64."""
    return tiny_model(
        "llama", vocab_size=4096, max_position_embeddings=1024, backend="sdpa_segments", **overrides
    ).double()


def rows_of(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "results.jsonl").read_text().splitlines()]


def test_rows_deal_unevenly_over_two_ranks(tokenizer):
    task = NeedleTask(NeedleTaskConfig(every_steps=1, **GRID), tokenizer)
    rows = nd.pack_rows([len(p) + len(a) - 1 for p, a in task.sequences], task.pack_tokens)
    assert len(task.sequences) == 6 and len(rows) == 5
    assert plan([task], 2) == [
        f"needle every 1 step: 6 prompts, {sum(len(p) + len(a) - 1 for p, a in task.sequences):,} tokens in 5 "
        f"rows of up to {task.pack_tokens} (3 forwards per rank)"
    ]


@pytest.mark.parametrize("name", list(RUN_TASKS))
def test_a_task_writes_and_logs_what_the_command_writes(tokenizer, tmp_path, name):
    """The same settings as the command's flags: the same prompts, rows, scores and files."""
    saved = save_tiny_model(tmp_path / "model", max_position_embeddings=1024)
    table, flags = RUN_TASKS[name]
    args = ["eval", name, "--model", str(saved), "--score", "logprob", *flags, "--seed", "3", "--dtype", "float64",
            "--attn-backend", "sdpa_segments", "--output", str(tmp_path / "command")]  # fmt: skip
    assert main(args) == 0

    (task,) = build_tasks(
        EvalTasksConfig(**{name: {**table, "seed": 3, "every_steps": 1}}), tokenizer, context_limit=None
    )
    model = load_model(str(saved), dtype="float64", packed=True, attn_backend="sdpa_segments")
    scores = nd.score_answers_across_ranks(model, task.sequences, pack_tokens=task.pack_tokens, lockstep=True)
    results = task.results(scores)
    write_results(task, tmp_path / "task", results, {"task": name}, title="tiny")
    assert rows_of(tmp_path / "task") == rows_of(tmp_path / "command")
    command = json.loads((tmp_path / "command" / "summary.json").read_text())
    assert results.summary == {key: value for key, value in command.items() if key != "seconds"}
    assert sorted(p.name for p in (tmp_path / "task").iterdir()) == sorted(
        p.name for p in (tmp_path / "command").iterdir()
    )
    expected = logged_numbers(name, command)
    assert {key: results.metrics[key] for key in expected} == expected


def test_prompts_that_do_not_fit_name_the_key(tokenizer):
    config = EvalTasksConfig(needle={"every_steps": 1, **GRID})
    with pytest.raises(ConfigError, match=r"eval_tasks.needle.lengths: prompts of up to 30\d tokens with their "
                       r"answers are over the model's limit of 256 \(max_position_embeddings\)"):  # fmt: skip
        build_tasks(config, tokenizer, context_limit=256)
    with pytest.raises(ConfigError, match="eval_tasks.needle.lengths 20: too short for the needle"):
        build_tasks(
            EvalTasksConfig(needle={"every_steps": 1, "lengths": [20]}), tokenizer, context_limit=None
        )
    with pytest.raises(ConfigError, match="eval_tasks.ruler.lengths 300: too short for niah_single_1"):
        build_tasks(
            EvalTasksConfig(ruler={"every_steps": 1, "lengths": [300]}), tokenizer, context_limit=None
        )


@pytest.mark.parametrize(
    "tasks, message",
    [
        (["niah_single_1", "vtt"], "eval_tasks.ruler.tasks: unknown task vtt; known: niah_single_1"),
        (["cwe", "vt"], "eval_tasks.ruler.tasks: cwe: the answer has no one order to teacher-force"),
        (["qa_hotpot"], "eval_tasks.ruler.tasks: qa_hotpot needs HotpotQA's JSON, eval_tasks.ruler.hotpot"),
    ],
)
def test_ruler_tasks_that_cannot_be_scored_name_the_key(tokenizer, tasks, message):
    with pytest.raises(ConfigError, match=message):
        build_tasks(EvalTasksConfig(ruler={"every_steps": 1, "tasks": tasks}), tokenizer, context_limit=None)


def test_the_dry_run_of_the_retrieval_demo_builds_its_prompts_and_says_what_they_cost(
    tokenized_sample, tmp_path
):
    from longalign.run import dry_run

    overrides = [f"data.train_file={json.dumps(str(tokenized_sample))}", f"training.output_dir={json.dumps(str(tmp_path))}",
                 "data.max_seq_len=1024"]  # fmt: skip
    result = dry_run(load_config(ROOT / "configs" / "demo_retrieval.toml", overrides))
    assert result["eval_tasks"] == [
        "needle every 200 steps: 30 prompts, 5,914 tokens in 7 rows of up to 1,024 (7 forwards per rank)"
    ]
    settings = {key: value for key, value, _ in result["settings"]}
    assert settings["eval_tasks.needle"]["every_steps"] == 200 and settings["eval_tasks.on_start"] is True


class Logged(TrainerCallback):
    """What the run's loggers receive: every ``report_to`` integration is a callback fed by ``on_log``."""

    def __init__(self) -> None:
        self.logs: list[tuple[int, dict]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append((state.global_step, dict(logs)))


@pytest.mark.integration  # a short training run in this process
def test_the_callback_scores_at_its_steps_logs_writes_and_gives_the_model_back(tokenizer, tmp_path, capsys):
    model = sample_model()
    packs = save_packs(tmp_path / "packs", count_packs([[40, 21], [30], [50, 11], [25, 24]]))
    args = TrainingArguments(
        output_dir=str(tmp_path / "run"), use_cpu=True, report_to="none", max_steps=3, logging_steps=1,
        save_strategy="no", remove_unused_columns=False, disable_tqdm=True, learning_rate=1e-2,
    )  # fmt: skip
    trainer = LongAlignTrainer(
        model=model, args=args, train_dataset=load_stage(packs), processing_class=tokenizer, max_seq_len=128
    )
    tasks = build_tasks(EvalTasksConfig(needle={"every_steps": 2, **GRID}), tokenizer, context_limit=1024)
    logged = Logged()
    trainer.add_callback(EvalTasksCallback(trainer, tasks, on_start=True))
    trainer.add_callback(logged)
    trainer.train()

    scored = [(step, logs) for step, logs in logged.logs if "eval_tasks/needle" in logs]
    assert [step for step, _ in scored] == [0, 2]  # the start, then every 2 steps (3 is not a multiple)
    history = [e for e in trainer.state.log_history if "eval_tasks/needle/logprob" in e]
    assert [e["step"] for e in history] == [0, 2]
    assert [e["step"] for e in trainer.state.log_history if "loss" in e] == [1, 2, 3]  # step 2's too
    for step, logs in scored:
        summary = json.loads(
            (tmp_path / "run" / "eval_tasks" / f"step-{step}" / "needle" / "summary.json").read_text()
        )
        assert logs["eval_tasks/needle/logprob"] == summary["mean_logprob"] and summary["step"] == step
    # At the start the model is the one it was built as.
    fresh = nd.score_answers(sample_model().eval(), tasks[0].sequences, pack_tokens=tasks[0].pack_tokens)
    assert scored[0][1]["eval_tasks/needle/logprob"] == pytest.approx(
        sum(s.logprob for s in fresh) / len(fresh), rel=1e-12
    )
    assert (
        scored[1][1]["eval_tasks/needle/logprob"] != scored[0][1]["eval_tasks/needle/logprob"]
    )  # it trained
    assert model.training  # given back in training mode
    out = capsys.readouterr().out
    assert out.count("eval_tasks: needle every 2 steps: 6 prompts") == 1
    assert out.count("eval_tasks: needle's first evaluation (step 0) took") == 1


def test_the_logged_scores_are_drawn_against_the_step(tmp_path):
    history = [
        {
            "eval_tasks/needle": 0.0,
            "eval_tasks/needle/logprob": -8.3,
            "eval_tasks/needle/256": 0.0,
            "step": 0,
        },
        {"loss": 2.0, "step": 10},
        {
            "eval_tasks/needle": 50.0,
            "eval_tasks/needle/logprob": -1.2,
            "eval_tasks/needle/256": 60.0,
            "step": 20,
        },
    ]
    plot_scores(history, tmp_path / "curve.png", title="tiny")
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- on two ranks, against the command on each checkpoint ------------------------------------------------


def run_overrides(output_dir: Path, packs: Path, tasks: list[str]) -> list[str]:
    """The demo run on ``packs`` for 4 steps, checkpoints at 2 and 4, ``tasks`` scored every 2 steps."""
    tables = []
    for name in tasks:
        settings = {**RUN_TASKS[name][0], "every_steps": 2}
        table = ", ".join(f"{key} = {json.dumps(value)}" for key, value in settings.items())
        tables.append(f"eval_tasks.{name}={{{table}}}")
    return [
        *demo_overrides(output_dir, packs), *tables, "training.max_steps=4", "training.save_steps=2",
        "training.logging_steps=1", "training.disable_tqdm=true", "data.max_seq_len=128",
    ]  # fmt: skip


def check_against_the_command(
    run: Path, tmp_path: Path, tasks: list[str], *, dtype: str, bound: float
) -> None:
    """Each checkpoint of ``run`` scored by ``longalign eval`` gives the rows the run wrote and the numbers it
    logged at that step."""
    history = json.loads((run / "trainer_state.json").read_text())["log_history"]
    assert [e["step"] for e in history if "loss" in e] == [1, 2, 3, 4]  # scoring leaves the loss lines alone
    for name in tasks:
        logged = {e["step"]: e for e in history if f"eval_tasks/{name}" in e}
        assert sorted(logged) == [0, 2, 4]
        for step in (2, 4):
            out = tmp_path / f"{name}-{step}"
            args = ["eval", name, "--model", str(run / f"checkpoint-{step}"), "--score", "logprob",
                    *RUN_TASKS[name][1], "--dtype", dtype, "--output", str(out)]  # fmt: skip
            assert main(args) == 0
            during, after = rows_of(run / "eval_tasks" / f"step-{step}" / name), rows_of(out)
            assert_relatively_close(
                [r.pop("logprob") for r in during], [r.pop("logprob") for r in after], bound
            )
            assert during == after  # the prompts, where each needle went, the greedy answer and its score
            for key, value in logged_numbers(name, json.loads((out / "summary.json").read_text())).items():
                assert logged[step][key] == pytest.approx(value, rel=bound), key


PACKS = [[40, 21], [30], [50, 11], [25, 24], [60], [33, 20]]
# One launch per scenario, shared by the tests that read it: (launcher, accelerate config, split, tasks, dtype).
LAUNCHES = {
    "ddp": ("launch", None, 1, list(RUN_TASKS), "float64"),
    "sequence_parallel": ("launch", None, 2, list(RUN_TASKS), "float64"),
    "zero3_sequence_parallel": ("launch_with_config", "zero3.yaml", 2, ["needle"], "float32"),
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Train ``LAUNCHES[name]`` once per module on 2 CPU ranks: ``(result, run directory)``."""
    done: dict[str, tuple] = {}

    def run(name: str) -> tuple:
        if name not in done:
            launcher, config, split, tasks, dtype = LAUNCHES[name]
            tmp = tmp_path_factory.mktemp(name)
            run_dir, packs = tmp / "run", save_packs(tmp / "packs", count_packs(PACKS))
            args = [str(ROOT / "train.py"), "--config", str(DEMO), *run_overrides(run_dir, packs, tasks),
                    f"model.torch_dtype='{dtype}'", f"training.sequence_parallel_size={split}"]  # fmt: skip
            if launcher == "launch":
                result = launch(*args, env=network_blocked_env(), cwd=ROOT, timeout=800)
            else:
                result = launch_with_config(config, *args, env=network_blocked_env(), timeout=800)
            assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
            done[name] = (result, run_dir)
        return done[name]

    return run


@pytest.mark.integration
@needs_launcher
@pytest.mark.parametrize(
    "split",
    ["ddp", pytest.param("sequence_parallel", marks=needs_deepspeed)],
    ids=["ddp", "sequence_parallel"],
)
def test_logged_scores_at_step_n_are_the_command_on_checkpoint_n(tmp_path, launched, split):
    """DDP on 2 CPU ranks in float64, and with every pack split over both ranks (the scoring attends whole
    rows, around the split): the command's rows, so its scores, to float64 rounding."""
    result, run = launched(split)
    assert result.stdout.count("eval_tasks: needle every 2 steps: 6 prompts") == 1  # rank 0, once
    assert result.stdout.count("eval_tasks: ruler every 2 steps: 4 prompts") == 1
    assert result.stdout.count("eval_tasks: needle's first evaluation (step 0) took") == 1
    assert result.stdout.count("eval_tasks: ruler's first evaluation (step 0) took") == 1
    check_against_the_command(run, tmp_path, list(RUN_TASKS), dtype="float64", bound=1e-12)


@pytest.mark.integration
@needs_launcher
@needs_deepspeed
def test_train_splits_each_pack_over_two_ranks_after_the_preflight(launched):
    """train.py with sequence_parallel_size 2 on 2 ranks (the launch above): the preflight's rows, and each
    pack counted once in the step's logs, not once per rank."""
    result, run = launched("sequence_parallel")
    rows = {line.split("  ")[0]: line.split() for line in result.stdout.splitlines()}
    assert rows["sequence parallel"][2:] == ["ok", "all", "2", "ranks", "per", "pack,", "1", "group"]
    assert rows["first packs"][2:5] == ["ok", "all", "group"]  # one group: both ranks hold the same packs
    state = json.loads((run / "trainer_state.json").read_text())
    steps = [entry for entry in state["log_history"] if "loss" in entry]
    assert [entry["packs_per_step"] for entry in steps] == [1, 1, 1, 1]


@pytest.mark.integration
@needs_launcher
@needs_deepspeed
def test_zero3_with_split_packs_scores_on_every_rank_without_hanging(tmp_path, launched):
    """ZeRO-3 on 2 CPU ranks, each pack split over both: every rank gathers the weights for every row's
    forward, the rank short of a row included; float32, so the scores agree to float32 rounding."""
    result, run = launched("zero3_sequence_parallel")
    assert "DeepSpeed ZeRO-3 over 2 CPU ranks on 1 node; sequence parallel: 2 ranks per pack" in result.stdout
    check_against_the_command(run, tmp_path, ["needle"], dtype="float32", bound=FLOAT32_BOUND)


@pytest.mark.integration
@needs_launcher
@needs_deepspeed
def test_train_reports_zero3_with_sequence_parallelism_on_cpu_ranks(launched):
    """The same launch (``configs/accelerate/zero3.yaml``, train.py): the preflight's parallelism row."""
    out = launched("zero3_sequence_parallel")[0].stdout
    line = next(line for line in out.splitlines() if line.startswith("parallelism "))
    assert line.split(None, 3)[1:] == [
        "ok", "all", "DeepSpeed ZeRO-3 over 2 CPU ranks on 1 node; sequence parallel: 2 ranks per pack, 1 group"
    ]  # fmt: skip
    assert "asked for" not in out and "preflight: ok" in out and "train_runtime" in out

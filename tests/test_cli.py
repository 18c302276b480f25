"""The `longalign` command: subcommands, their --help, one-line errors, and the scripts that run them."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from conftest import DEMO, ROOT, SAMPLE, TOKENIZER, make_samples, run_process, save_samples

from longalign.cli import COMMANDS, main
from longalign.reports import PLOT_NAME

SUBCOMMANDS = ["pre-tokenize", "pack", "train", "probe", "preflight", "data", "eval", "merge", "convert"]


def test_help_lists_the_subcommands(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert list(COMMANDS) == SUBCOMMANDS
    assert all(f"    {name}" in out for name in SUBCOMMANDS)


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_every_subcommand_has_help(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([name, "--help"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: longalign {name}")


def test_pack_writes_plot_and_prints_summary(tmp_path, capsys):
    lengths = np.random.default_rng(1).integers(1, 41, 90).tolist()
    tokenized = save_samples(make_samples(lengths), tmp_path / "tokenized")
    out = tmp_path / "packed"
    assert main(["pack", "--input", str(tokenized), "--output", str(out), "--max-seq-len", "64"]) == 0
    assert (out / PLOT_NAME).stat().st_size > 0
    printed = capsys.readouterr().out
    assert "efficiency" in printed and "lower bound" in printed
    assert main(["pack", "--input", str(tokenized), "--output", str(out), "--max-seq-len", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("longalign pack: error: line") and err.count("\n") == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["train", "--config", "nope.toml"], "longalign train: error: nope.toml: config file not found"),
        (["train", "--config", str(DEMO), "loss.weighting=mean"], "loss.weighting: 'mean' is not one of"),
        (
            ["train", "--config", str(DEMO), "training.remove_unused_columns=true"],
            "training.remove_unused_columns: longalign sets it to false",
        ),
        (["preflight", "--config", str(DEMO), "packing.strategy=tight"], "packing.strategy: 'tight'"),
        (
            ["train", "--config", str(DEMO), "training.sequence_parallel_size=3", "training.max_steps=1"],
            "training.sequence_parallel_size = 3 cannot run: the world size 1 is not a multiple of it",
        ),
        (["probe", "--config", str(DEMO), "--lengths", "4x"], "length '4x'"),
        (
            [
                "pre-tokenize",
                "--input",
                "missing.jsonl",
                "--tokenizer",
                str(TOKENIZER),
                "--output",
                "o",
                "--max-seq-len",
                "64",
            ],
            "missing.jsonl: not found",
        ),  # fmt: skip
        (
            [
                "pre-tokenize",
                "--input",
                str(SAMPLE),
                "--tokenizer",
                "/no/such/tokenizer",
                "--output",
                "o",
                "--max-seq-len",
                "64",
            ],
            "/no/such/tokenizer: no tokenizer there",
        ),  # fmt: skip
        (
            [
                "pre-tokenize",
                "--input",
                str(SAMPLE),
                "--tokenizer",
                str(TOKENIZER),
                "--chat-template",
                "/no/template.jinja",
                "--output",
                "o",
                "--max-seq-len",
                "64",
            ],
            "/no/template.jinja: chat template file not found",
        ),  # fmt: skip
        (
            ["merge", "--adapter", "nowhere", "--output", "o"],
            "longalign merge: error: nowhere: no adapter_config.json",
        ),
        (
            ["train", "--config", str(DEMO), "lora.rank=8"],
            "lora.rank: unknown key",
        ),
    ],
)
def test_bad_input_is_one_line_naming_it(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.integration
def test_console_command_and_scripts_run_the_same_subcommands(tmp_path):
    """The installed `longalign` command and `python scripts/X.py` both parse and run their subcommand."""
    longalign = [str(ROOT / ".venv" / "bin" / "longalign")]
    if not (ROOT / ".venv" / "bin" / "longalign").exists():
        longalign = [sys.executable, "-m", "longalign"]
    result = run_process([*longalign, "--help"], timeout=120)
    assert result.returncode == 0, result.stderr
    assert all(name in result.stdout for name in SUBCOMMANDS)
    out = tmp_path / "tok"
    result = run_process(
        [sys.executable, str(ROOT / "scripts" / "pre_tokenize.py"), "--input", str(SAMPLE), "--tokenizer",
         str(TOKENIZER), "--output", str(out), "--max-seq-len", "512", "--truncation", "drop"],
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "lines read     400" in result.stdout
    assert json.loads((out / "report.json").read_text())["lines_read"] == 400
    result = run_process(
        [sys.executable, str(ROOT / "train.py"), "--config", str(DEMO), "data.max_seq_len=0x"],
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.startswith("train.py: error: data.max_seq_len: expected int")


def test_pre_tokenize_reads_control_token_text_as_chosen(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    quoting = [
        {"role": "user", "content": "what is <|eot_id|>?"},
        {"role": "assistant", "content": "An end."},
    ]
    src.write_text(json.dumps({"messages": quoting}) + "\n")
    argv = ["pre-tokenize", "--input", str(src), "--tokenizer", str(TOKENIZER), "--max-seq-len", "64"]
    for mode in ("text", "parse"):
        out = tmp_path / mode
        assert main([*argv, "--output", str(out), "--special-tokens-in-text", mode]) == 0
        assert f"control-token text in 1 samples, read as {mode}" in capsys.readouterr().out
        assert json.loads((out / "report.json").read_text())["special_tokens_in_text"] == mode


@pytest.mark.parametrize("value", ["0", "-5"])
def test_pre_tokenize_max_seq_len_below_one_names_the_flag(tmp_path, capsys, value):
    argv = [
        "pre-tokenize",
        "--input",
        str(SAMPLE),
        "--tokenizer",
        str(TOKENIZER),
        "--output",
        str(tmp_path / "o"),
    ]
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--max-seq-len", value])
    assert exit_.value.code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert (
        last
        == f"longalign pre-tokenize: error: argument --max-seq-len: expected an integer >= 1, got {value}"
    )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["pack", "--input", "t", "--output", "p", "--max-seq-len", "64", "--seed", "-1"], "--seed"),
        (["pack", "--input", "t", "--output", "p", "--max-seq-len", "0"], "--max-seq-len"),
        (["probe", "--config", "c.toml", "--seed", "-3"], "--seed"),
    ],
)
def test_out_of_range_flags_name_themselves(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert f"error: argument {flag}: expected an integer >= " in capsys.readouterr().err

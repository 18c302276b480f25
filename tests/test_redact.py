"""Secrets never in clear: by name, by URL shape, in the preflight table, mismatch messages and JSON."""

from __future__ import annotations

import pytest
from conftest import DEMO

from longalign.config import load_config
from longalign.preflight import compare, config_check, env_checks
from longalign.redact import is_secret_name, redact, redact_override


@pytest.mark.parametrize(
    "name",
    ["HF_TOKEN", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "DB_PASSWD", "DB_PASSWORD", "GITHUB_PAT",
     "AZURE_CREDENTIALS", "BASIC_AUTH", "training.hub_token", "hub-token", "apikey", "OAUTH", "AWS_SESSION_TOKEN"],
)  # fmt: skip
def test_secret_names(name):
    assert is_secret_name(name)
    assert redact(name, "s3cr3t-value").startswith("sha256:")
    assert "s3cr3t" not in redact(name, "s3cr3t-value")


@pytest.mark.parametrize(
    "name", ["PYTHONPATH", "PATH", "HF_HOME", "WANDB_PROJECT", "NCCL_DEBUG", "data.train_file"]
)
def test_ordinary_names(name):
    assert not is_secret_name(name)
    assert redact(name, "/some/value") == "/some/value"


def test_passwords_inside_urls_are_masked_whatever_the_name():
    assert redact("HTTPS_PROXY", "http://alice:hunter2@proxy:3128") == "http://alice:***@proxy:3128"
    assert (
        redact("DATABASE_URL", "postgresql://app:p%40ss@db.internal:5432/x")
        == "postgresql://app:***@db.internal:5432/x"
    )
    assert redact("MIRROR", "https://mirror.example/simple") == "https://mirror.example/simple"


def test_env_rows_never_show_secrets():
    env = {
        "DB_PASSWD": "hunter2",
        "GITHUB_PAT": "ghp_x1",
        "HTTPS_PROXY": "http://u:hunter3@p:1",
        "PYTHONPATH": "/a",
    }
    values = " ".join(
        check.value for check in env_checks(["DB_PASSWD", "GITHUB_PAT", "HTTPS_PROXY", "PYTHONPATH"], env)
    )
    assert "hunter" not in values and "ghp_x1" not in values
    assert "/a" in values and "http://u:***@p:1" in values


def test_config_mismatch_message_does_not_print_the_hub_token():
    a = load_config(DEMO, ["training.hub_token='hf_first_secret'"])
    b = load_config(DEMO, ["training.hub_token='hf_other_secret'"])
    report = compare([[config_check(a)], [config_check(b)]])
    assert not report.ok and "training.hub_token sha256:" in report.problems[0]
    assert "secret" not in report.problems[0] + report.table


def test_overrides_written_to_json_are_redacted():
    assert redact_override("training.hub_token='hf_abc'").startswith("training.hub_token=sha256:")
    assert redact_override("data.train_file='out/packed'") == "data.train_file='out/packed'"

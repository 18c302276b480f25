"""Stage outputs: what --output may replace, staging that never outlives its run, and the umask."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from conftest import SAMPLE, TOKENIZER, make_samples, save_samples

from longalign.artifacts import (
    MARKER_NAME,
    OutputError,
    check_output,
    remove_stale,
    stage_output,
    staging_dir,
)
from longalign.packing import write_packs
from longalign.tokenize import pre_tokenize


@pytest.fixture
def tokenized(tmp_path):
    lengths = np.random.default_rng(1).integers(1, 41, 30).tolist()
    return save_samples(make_samples(lengths), tmp_path / "tokenized")


def test_output_that_is_or_contains_the_input_is_refused_before_any_work(tmp_path, sample_tokenizer):
    chats = tmp_path / "chats.jsonl"
    chats.write_text(SAMPLE.read_text().splitlines()[0] + "\n")
    before = chats.read_bytes()
    with pytest.raises(OutputError, match="the output is the input"):
        pre_tokenize(chats, sample_tokenizer, chats, max_seq_len=512)
    with pytest.raises(OutputError, match="the output contains the input"):
        pre_tokenize(chats, sample_tokenizer, tmp_path, max_seq_len=512)
    assert chats.read_bytes() == before


def test_pack_output_that_is_its_input_is_refused(tokenized):
    listing = sorted(p.name for p in tokenized.iterdir())
    with pytest.raises(OutputError, match="the output is the input"):
        write_packs(tokenized, tokenized, max_seq_len=64)
    assert sorted(p.name for p in tokenized.iterdir()) == listing


def test_only_empty_or_stage_directories_are_replaced(tmp_path, tokenized):
    unrelated = tmp_path / "photos"
    unrelated.mkdir()
    (unrelated / "cat.jpg").write_bytes(b"\xff\xd8")
    with pytest.raises(OutputError, match="no longalign stage wrote"):
        write_packs(tokenized, unrelated, max_seq_len=64)
    assert (unrelated / "cat.jpg").exists()
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep me")
    with pytest.raises(OutputError, match="is not a directory"):
        write_packs(tokenized, a_file, max_seq_len=64)
    assert a_file.read_text() == "keep me"

    empty = tmp_path / "empty"
    empty.mkdir()
    write_packs(tokenized, empty, max_seq_len=64)
    assert (empty / MARKER_NAME).exists() and (empty / "report.json").exists()
    write_packs(tokenized, empty, max_seq_len=48)  # an earlier stage output is replaced
    assert json.loads((empty / "report.json").read_text())["max_seq_len"] == 48
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_an_output_that_cannot_be_written_fails_before_any_work(tmp_path, tokenized):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(OutputError, match="cannot write there"):
        write_packs(tokenized, blocker / "packed", max_seq_len=64)
    with pytest.raises(OutputError, match="cannot write there"):
        check_output(blocker / "packed")  # no error yet: only the staging directory finds out
        with stage_output(blocker / "packed", stage="test"):
            pytest.fail("the block must not run")


def test_without_replace_an_output_that_appeared_meanwhile_is_kept(tmp_path):
    out = tmp_path / "cache"
    with stage_output(out, stage="test", replace=False) as staging:
        (staging / "first").write_text("1")
        with stage_output(out, stage="test", replace=False) as other:  # another writer finishes first
            (other / "second").write_text("2")
    assert sorted(p.name for p in out.iterdir()) == [MARKER_NAME, "second"]
    assert [p.name for p in tmp_path.iterdir()] == ["cache"]


def test_stale_staging_of_dead_processes_is_removed(tmp_path):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    host = socket.gethostname()
    for name, owner in {
        ".out.tmp-1-dead": {"host": host, "pid": dead_pid},
        ".out.tmp-2-alive": {"host": host, "pid": os.getpid()},
        ".out.tmp-3-elsewhere": {"host": "another-node", "pid": dead_pid},
    }.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / ".owner").write_text(json.dumps(owner))
    (tmp_path / f".out.tmp-{dead_pid}-unnamed").mkdir()  # killed before it wrote its owner
    (tmp_path / ".out.old-x").mkdir()  # a retired output whose removal was cut short
    (tmp_path / ".other.tmp-1-dead").mkdir()  # another output's staging: not ours to judge
    removed = sorted(p.name for p in remove_stale(tmp_path, "out"))
    assert removed == [".out.old-x", ".out.tmp-1-dead", f".out.tmp-{dead_pid}-unnamed"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".other.tmp-1-dead",
        ".out.tmp-2-alive",
        ".out.tmp-3-elsewhere",
    ]


def test_staging_follows_the_umask_and_is_removed_on_error(tmp_path):
    old = os.umask(0o027)
    try:
        with pytest.raises(RuntimeError), staging_dir(tmp_path, "out") as staging:
            assert staging.stat().st_mode & 0o777 == 0o750
            raise RuntimeError("the stage failed")
    finally:
        os.umask(old)
    assert list(tmp_path.iterdir()) == []


def session_processes(session: int) -> list[int]:
    """The live processes (zombies aside) of ``session``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (command)"
        except (OSError, IndexError):
            continue  # ended meanwhile
        if fields[0] != "Z" and int(fields[3]) == session:
            found.append(int(stat.parent.name))
    return found


# pre-tokenize with every tokenizing call held mid-work: each process that reaches one says so with a
# file in SIGNS, then waits there until the test signals or kills the stage.
_HELD_PRE_TOKENIZE = """
import os, sys, time
from pathlib import Path

import longalign.tokenize as stage
from longalign import cli

signs, real = Path(sys.argv[1]), stage.process_line


def held(*args, **kwargs):
    (signs / f"at-work-{os.getpid()}").touch()
    time.sleep(3600)
    return real(*args, **kwargs)


stage.process_line = held
sys.exit(cli.main(["pre-tokenize", *sys.argv[2:]]))
"""


@contextmanager
def pre_tokenize_at_work(tmp_path: Path, num_proc: int) -> Iterator[subprocess.Popen]:
    """pre-tokenize in a session of its own, yielded once it is held mid-work in its staging directory
    (with ``num_proc`` > 1, in each of its tokenizer workers); every process of it ends after."""
    signs = tmp_path / "signs"
    signs.mkdir()
    (tmp_path / "tmp").mkdir()
    # $TMPDIR is tmp_path/tmp, reached through a short link: the workers' pool binds a Unix socket under it,
    # whose path may hold 107 characters, which a deep pytest base directory passes.
    short = Path(tempfile.mkdtemp(prefix="la-"))
    (short / "t").symlink_to(tmp_path / "tmp")
    env = {**os.environ, "TMPDIR": str(short / "t")}
    process = subprocess.Popen(
        [sys.executable, "-c", _HELD_PRE_TOKENIZE, str(signs), "--input", str(SAMPLE), "--tokenizer",
         str(TOKENIZER), "--output", str(tmp_path / "tok"), "--max-seq-len", "4096", "--num-proc", str(num_proc)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while len(list(signs.iterdir())) < num_proc:  # one process, or one per worker, at work
            assert process.poll() is None, process.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the stage never reached its work"
            time.sleep(0.05)
        assert list(tmp_path.glob(".tok.tmp-*"))  # mid-stage: the staging directory exists
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        shutil.rmtree(short)  # the link, not what it points to


def gone_within(session: int, seconds: float) -> list[int]:
    """The processes of ``session`` still alive after waiting up to ``seconds`` for them to end."""
    deadline = time.monotonic() + seconds
    while (alive := session_processes(session)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


@pytest.mark.integration
@pytest.mark.parametrize("num_proc", [1, 2])
def test_sigterm_mid_stage_leaves_nothing_behind(tmp_path, num_proc):
    """A terminated pre-tokenize removes its staging (work files included), leaves no output and no
    process, and exits with 143 in silence, tokenizer workers or not."""
    with pre_tokenize_at_work(tmp_path, num_proc) as process:
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
        assert process.returncode == 128 + signal.SIGTERM
        assert "Traceback" not in err  # datasets' pool turned the exit into its TimeoutError before
        assert gone_within(process.pid, 30) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["signs", "tmp"]
    assert list((tmp_path / "tmp").iterdir()) == []  # nothing in $TMPDIR either


@pytest.mark.integration
def test_tokenizer_workers_end_with_a_killed_stage(tmp_path):
    """After a ``kill -9`` of pre-tokenize its workers end too, instead of waiting for work forever.

    (The staging directory it leaves is removed by the next run: ``test_stale_staging_of_dead_processes_is_removed``.)
    """
    with pre_tokenize_at_work(tmp_path, 2) as process:
        assert len(session_processes(process.pid)) >= 3  # the stage and its two workers
        process.kill()
        process.wait(timeout=60)
        assert gone_within(process.pid, 30) == []


def test_workers_forked_in_a_stage_die_on_sigterm_as_by_default(tmp_path):
    """datasets' process pool forks its workers inside a stage: they keep the default SIGTERM.

    With the stage's handler, workers idle in the pool's queue lock were seen never to run it: after a
    ``--strict`` error in ``num_proc`` workers the pool's ``terminate`` then waited for them forever.
    """
    import multiprocess

    before = signal.getsignal(signal.SIGTERM)
    with staging_dir(tmp_path, "out"):
        assert signal.getsignal(signal.SIGTERM) is not before  # the stage's own handler
        with multiprocess.get_context("fork").Pool(1) as pool:
            assert pool.apply(signal.getsignal, (signal.SIGTERM,)) == signal.SIG_DFL
    assert signal.getsignal(signal.SIGTERM) is before  # and the process has its own back

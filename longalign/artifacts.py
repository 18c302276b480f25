"""Stage outputs on disk: an Arrow dataset directory plus its ``report.json``, written atomically.

Every pipeline stage (pre-tokenize, pack) writes one directory::

    OUT_DIR/
      data-00000-of-00001.arrow, dataset_info.json, state.json   # datasets.save_to_disk
      report.json                                                # what the stage did, with counts
      .longalign-stage                                           # marker: a longalign stage wrote this
      ...                                                        # stage extras (plots)

:func:`stage_output` guards it: before any work, an ``--output`` that is the input or contains it, a
file, or a directory that no longalign stage wrote (no marker) is refused; only an empty directory or an
earlier stage output is replaced. Everything is written into a hidden sibling staging directory first
(``.OUT_DIR.tmp-<pid>-...``) and renamed into place when the stage finishes; on an error, Ctrl-C or
SIGTERM the staging directory is removed, and one left by a killed run (its process gone) is removed by
the next run that writes next to it. New directories get the permissions of the user's umask.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import datasets

from longalign.errors import ConfigError, InputError, PathError
from longalign.processes import sigterm_as_exit

REPORT_NAME = "report.json"
MARKER_NAME = ".longalign-stage"
_OWNER_NAME = ".owner"  # in a staging directory: {"host": ..., "pid": ...} of the process writing it


class OutputError(ConfigError):
    """An output path that a stage may not write; the message names it."""


def check_output(output_dir: str | os.PathLike, *, inputs: Sequence[str | os.PathLike] = ()) -> Path:
    """The resolved ``output_dir`` if a stage may replace it; raises :class:`OutputError` otherwise.

    Allowed: a path that does not exist yet, an empty directory, or a directory with a stage marker.
    Refused: a file, any other directory, and a path that is one of ``inputs`` or contains one.
    """
    output = Path(output_dir).resolve()
    for path in inputs:
        source = Path(path).resolve()
        if source == output or output in source.parents:
            raise OutputError(
                f"{output_dir}: the output {'is' if source == output else 'contains'} the input {path}"
            )
    if output.is_file() or (output.exists() and not output.is_dir()):
        raise OutputError(f"{output_dir}: exists and is not a directory; choose another output")
    if output.is_dir() and not (output / MARKER_NAME).exists() and any(output.iterdir()):
        raise OutputError(
            f"{output_dir}: a non-empty directory that no longalign stage wrote (no {MARKER_NAME} marker); "
            "remove it or choose another output"
        )
    return output


@contextmanager
def stage_output(
    output_dir: str | os.PathLike,
    *,
    stage: str,
    inputs: Sequence[str | os.PathLike] = (),
    replace: bool = True,
) -> Iterator[Path]:
    """Yield an empty staging directory that becomes ``output_dir`` when the block succeeds.

    The output is checked first (:func:`check_output`), and the staging directory is made at once, so a
    refused or unwritable output fails before any work. On an exception (Ctrl-C and SIGTERM included) the
    staging directory is removed and ``output_dir`` is left as it was. With ``replace=False`` an output
    that appeared meanwhile (another process wrote the same content) is kept and the staging discarded.
    """
    output = check_output(output_dir, inputs=inputs)
    with staging_dir(output.parent, output.name) as staging:
        yield staging
        (staging / _OWNER_NAME).unlink()
        (staging / MARKER_NAME).write_text(json.dumps({"stage": stage}) + "\n", encoding="utf-8")
        if output.exists() and not replace:
            return
        if output.exists():
            # Move the old output aside first so that at every moment one complete directory exists.
            retired = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
            os.replace(output, retired / output.name)
            os.replace(staging, output)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            try:
                os.replace(staging, output)
            except OSError:  # a directory of the same name appeared meanwhile (another writer)
                if replace or not output.is_dir():
                    raise


@contextmanager
def staging_dir(parent: str | os.PathLike, name: str) -> Iterator[Path]:
    """A fresh hidden directory ``parent/.name.tmp-...``, removed when the block ends unless moved away.

    Stale staging of ``name`` left by killed processes on this host is removed first. Removal on SIGTERM
    works by turning the signal into ``SystemExit`` while the block runs (main thread only).
    """
    parent = Path(parent)
    try:
        parent.mkdir(parents=True, exist_ok=True)
        remove_stale(parent, name)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-{os.getpid()}-", dir=parent))
    except OSError as err:
        raise OutputError(f"{parent}: cannot write there ({err.strerror or err})") from None
    os.chmod(staging, 0o777 & ~_umask())  # mkdtemp makes it private; outputs follow the umask
    owner = {"host": socket.gethostname(), "pid": os.getpid()}
    (staging / _OWNER_NAME).write_text(json.dumps(owner), encoding="utf-8")
    try:
        with sigterm_as_exit():
            yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already when it became the output


def remove_stale(parent: Path, name: str) -> list[Path]:
    """Remove ``.name.tmp-*`` / ``.name.old-*`` siblings whose writer on this host is no longer running."""
    removed = []
    host = socket.gethostname()
    for path in parent.glob(f".{name}.*-*"):
        if not path.is_dir() or not path.name.startswith((f".{name}.tmp-", f".{name}.old-")):
            continue
        try:
            owner = json.loads((path / _OWNER_NAME).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            owner = None  # a retired output, or staging killed before it named its owner
        if owner is not None and (owner.get("host") != host or _alive(owner.get("pid"))):
            continue
        if owner is None and path.name.startswith(f".{name}.tmp-") and _alive(_pid_in_name(path, name)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _pid_in_name(path: Path, name: str) -> int | None:
    pid = path.name.removeprefix(f".{name}.tmp-").split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_json(path: str | os.PathLike, value: Any) -> Path:
    """Write ``value`` as indented JSON to ``path``: readers see the old file or the whole new one."""
    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
    os.replace(partial, path)
    return path


def write_report(directory: str | os.PathLike, report: dict[str, Any]) -> Path:
    """Write ``report`` to ``directory/report.json``."""
    return write_json(Path(directory) / REPORT_NAME, report)


def read_report(directory: str | os.PathLike) -> dict[str, Any]:
    """Read the ``report.json`` of a stage output directory."""
    return json.loads((Path(directory) / REPORT_NAME).read_text(encoding="utf-8"))


def load_stage(directory: str | os.PathLike, *, required_columns: tuple[str, ...] = ()) -> datasets.Dataset:
    """Memory-map a stage's Arrow dataset, checking that it has ``required_columns``."""
    directory = Path(directory)
    if not (directory / "dataset_info.json").exists() and not (directory / "state.json").exists():
        raise PathError(f"{directory}: not a dataset directory written by a longalign stage")
    dataset = datasets.load_from_disk(str(directory))
    missing = [c for c in required_columns if c not in dataset.column_names]
    if missing:
        raise InputError(f"{directory}: dataset lacks column(s) {missing}; has {dataset.column_names}")
    return dataset

"""Stage outputs on disk: an Arrow dataset directory plus its ``report.json``, written atomically.

Every pipeline stage (pre-tokenize, pack) writes one directory::

    OUT_DIR/
      data-00000-of-00001.arrow, dataset_info.json, state.json   # datasets.save_to_disk
      report.json                                                # what the stage did, with counts
      ...                                                        # stage extras (plots)

A failed run leaves no half-written directory behind: everything is written into a hidden sibling
directory first and renamed into place only when the stage finishes.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import datasets

REPORT_NAME = "report.json"


@contextmanager
def atomic_output_dir(output_dir: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty staging directory that replaces ``output_dir`` when the block succeeds.

    On an exception the staging directory is removed and ``output_dir`` is left as it was.
    """
    output_dir = Path(output_dir).resolve()
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.tmp-", dir=output_dir.parent))
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if output_dir.exists():
        # Move the old output aside first so that at every moment one complete directory exists.
        retired = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.old-", dir=output_dir.parent))
        os.replace(output_dir, retired / output_dir.name)
        os.replace(staging, output_dir)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.replace(staging, output_dir)


def write_report(directory: str | os.PathLike, report: dict[str, Any]) -> Path:
    """Write ``report`` as indented JSON to ``directory/report.json``."""
    path = Path(directory) / REPORT_NAME
    path.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return path


def read_report(directory: str | os.PathLike) -> dict[str, Any]:
    """Read the ``report.json`` of a stage output directory."""
    return json.loads((Path(directory) / REPORT_NAME).read_text(encoding="utf-8"))


def load_stage(directory: str | os.PathLike, *, required_columns: tuple[str, ...] = ()) -> datasets.Dataset:
    """Memory-map a stage's Arrow dataset, checking that it has ``required_columns``."""
    directory = Path(directory)
    if not (directory / "dataset_info.json").exists() and not (directory / "state.json").exists():
        raise FileNotFoundError(f"{directory}: not a dataset directory written by a longalign stage")
    dataset = datasets.load_from_disk(str(directory))
    missing = [c for c in required_columns if c not in dataset.column_names]
    if missing:
        raise ValueError(f"{directory}: dataset lacks column(s) {missing}; has {dataset.column_names}")
    return dataset

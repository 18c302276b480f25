"""Run NVIDIA/RULER's own generators on the stand-in inputs and keep their instances as test data.

    python tests/data/ruler/make_reference.py --ruler RULER_DIR --work SCRATCH [--site SITE]

``RULER_DIR`` holds RULER's repository (its ``scripts/``), ``SCRATCH`` is a directory outside this
repository where RULER's scripts are copied and run, ``SITE`` a directory of the packages RULER needs and
longalign does not (``pip install --target SITE scipy tenacity``). Nothing is downloaded:

- NLTK's punkt model cannot be fetched, so a stand-in ``nltk`` package answers ``nltk.data.find`` and
  gives ``nltk.tokenize.sent_tokenize`` longalign's sentence splitter (``longalign.eval.needle.split_sentences``),
  the one longalign's instances use;
- the essays and the QA files are the stand-ins of ``make_inputs.py``, copied to where RULER reads them
  (``scripts/data/synthetic/json/PaulGrahamEssays.json``, ``squad.json``, ``hotpotqa.json``);
- RULER's ``english_words.json`` is a Git LFS file the repository snapshot does not hold: an empty object
  stands in (cwe draws from it only past wonderwords' 8,166 words, far more than 16k tokens hold).

RULER's ``prepare.py`` then runs for each of its 13 tasks at 4096 and 16384 tokens, 20 samples each, with
the shipped tokenizer (``--tokenizer_type hf``) and RULER's ``meta-llama3`` template (the shipped
tokenizer's own chat template, character for character). Kept: the first ``KEEP`` instances of each task
and length (``reference/TASK-LENGTH.jsonl.gz``, RULER's lines as it writes them) and every sample's
``length`` (``lengths.json``: prompt and budget, as RULER counts them).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
TASKS = {
    "niah_single_1": "niah_single_1",
    "niah_single_2": "niah_single_2",
    "niah_single_3": "niah_single_3",
    "niah_multikey_1": "niah_multikey_1",
    "niah_multikey_2": "niah_multikey_2",
    "niah_multikey_3": "niah_multikey_3",
    "niah_multivalue": "niah_multivalue",
    "niah_multiquery": "niah_multiquery",
    "vt": "vt",
    "cwe": "cwe",
    "fwe": "fwe",
    "qa_squad": "qa_1",
    "qa_hotpot": "qa_2",
}  # fmt: skip  (longalign's name: RULER's)
LENGTHS = (4096, 16384)
SAMPLES = 20
KEEP = {4096: 3, 16384: 2}
NLTK = {
    "__init__.py": "from . import data, tokenize  # noqa: F401\n",
    "data.py": "def find(name):\n    return name\n",
    "tokenize.py": "from longalign.eval.needle import split_sentences as sent_tokenize  # noqa: F401\n",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ruler", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--site", type=Path)
    args = parser.parse_args()
    work = args.work.resolve()
    scripts = work / "scripts"
    shutil.rmtree(scripts, ignore_errors=True)  # RULER's outputs under SCRATCH/out are kept: a rerun goes on
    shutil.rmtree(work / "shims", ignore_errors=True)
    shutil.rmtree(work / "bin", ignore_errors=True)
    shutil.copytree(args.ruler / "scripts", scripts)
    for name, target in (("essays.json", "PaulGrahamEssays.json"), ("squad.json", "squad.json"),
                         ("hotpot.json", "hotpotqa.json")):  # fmt: skip
        shutil.copyfile(HERE / name, scripts / "data" / "synthetic" / "json" / target)
    # RULER's english_words.json is a Git LFS file; cwe reads it at start and draws from it only past
    # wonderwords' 8,166 words, which 16k tokens never reach: an empty object stands in
    (scripts / "data" / "synthetic" / "json" / "english_words.json").write_text("{}\n")
    shims = work / "shims"
    (shims / "nltk").mkdir(parents=True)
    for name, text in NLTK.items():
        (shims / "nltk" / name).write_text(text)
    bin_ = work / "bin"  # RULER's prepare.py runs each task's script as `python ...`
    bin_.mkdir()
    (bin_ / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_ / "python").chmod(0o755)
    paths = [str(shims), str(ROOT), *([str(args.site.resolve())] if args.site else [])]
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "PYTHONPATH": ":".join(paths),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    out = work / "out"
    lengths: dict[str, dict[str, list[int]]] = {}
    (HERE / "reference").mkdir(exist_ok=True)
    for ours, theirs in TASKS.items():
        for length in LENGTHS:
            save = out / str(length)
            command = [str(bin_ / "python"), "prepare.py", "--save_dir", str(save), "--benchmark", "synthetic",
                       "--task", theirs, "--tokenizer_path", str(ROOT / "data" / "tokenizer"), "--tokenizer_type",
                       "hf", "--max_seq_length", str(length), "--model_template_type", "meta-llama3",
                       "--num_samples", str(SAMPLES)]  # fmt: skip
            done = subprocess.run(command, cwd=scripts / "data", env=env, capture_output=True, text=True)
            if done.returncode != 0 or "Error" in done.stdout:
                sys.exit(f"RULER's prepare.py failed for {theirs} at {length}:\n{done.stdout}\n{done.stderr}")
            produced = save / theirs / "validation.jsonl"
            if not produced.is_file():
                sys.exit(f"RULER wrote no {produced} for {theirs} at {length}")
            lines = produced.read_text().splitlines()
            lengths.setdefault(ours, {})[str(length)] = [json.loads(line)["length"] for line in lines]
            kept = "".join(line + "\n" for line in lines[: KEEP[length]])
            with gzip.GzipFile(HERE / "reference" / f"{ours}-{length}.jsonl.gz", "wb", mtime=0) as f:
                f.write(kept.encode())
            print(f"{ours} {length}: {len(lines)} samples, lengths {min(lengths[ours][str(length)])}-"
                  f"{max(lengths[ours][str(length)])}", flush=True)  # fmt: skip
    (HERE / "lengths.json").write_text(json.dumps(lengths, indent=1) + "\n")


if __name__ == "__main__":
    main()

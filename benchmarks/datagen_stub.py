"""`longalign data self-instruct` over this repository's own text, against the local test stub, side by side.

    python benchmarks/datagen_stub.py [--latency 0.05] [--per-doc 2] [--report out.json]

Documents: README.md, data/README.md, and the docstrings of every module under longalign/ (module, classes,
functions: one .txt file per module, one paragraph per docstring), written to a temporary directory. The
server is tests/openai_stub.py on 127.0.0.1 with a bearer key; each reply waits ``--latency`` seconds (a
stand-in for the model's time) and is a deterministic function of the request.

Rows: concurrency 1, 4 and 8 from an empty answer store, and a rerun of the same arguments whose calls are all
answered from the store but the last (a run stopped before its last call, then restarted). Every row writes the same
data.jsonl (checked); the table shows the calls sent, the time per sample and the speed-up over concurrency 1.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from openai_stub import OpenAIStub  # noqa: E402 (the test helper server, found through tests/)

from longalign.datagen import self_instruct  # noqa: E402
from longalign.serving import ChatClient, ServerError, ServerSettings  # noqa: E402

KEY_ENV = "LONGALIGN_BENCH_KEY"


def write_documents(folder: Path) -> None:
    """The repository's READMEs, and each module's docstrings as one .txt document."""
    for readme in (ROOT / "README.md", ROOT / "data" / "README.md"):
        (folder / f"{readme.parent.name or 'repo'}-{readme.name}").write_text(readme.read_text())
    for module in sorted((ROOT / "longalign").rglob("*.py")):
        tree = ast.parse(module.read_text())
        nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef))]
        docstrings = [doc for doc in map(ast.get_docstring, nodes) if doc]
        name = module.relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
        (folder / f"{name}.txt").write_text("\n\n".join(docstrings))


def reply_after(latency: float):
    def reply(body: dict) -> str:
        time.sleep(latency)
        tag = hashlib.sha256(json.dumps(body["messages"]).encode()).hexdigest()[:12]
        prompt = body["messages"][-1]["content"]
        if "write one instruction" in prompt:
            return f"Which settings ({tag}) does the text name, and how do they interact?"
        return f"Answer {tag}: " + " ".join(f"w{i}" for i in range(200)) + "."

    return reply


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--latency", type=float, default=0.05, help="seconds the stub takes per reply")
    parser.add_argument("--per-doc", type=int, default=2)
    parser.add_argument("--report", type=Path, help="also write the concurrency-4 run's report.json here")
    args = parser.parse_args()
    os.environ[KEY_ENV] = "sk-bench"
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "data" / "tokenizer")
    with (
        tempfile.TemporaryDirectory() as tmp,
        OpenAIStub(reply_after(args.latency), key="sk-bench") as server,
    ):
        docs = Path(tmp) / "docs"
        docs.mkdir()
        write_documents(docs)

        def run(name: str, concurrency: int) -> dict:
            client = ChatClient(
                ServerSettings(server.base_url, server.model, api_key_env=KEY_ENV, concurrency=concurrency)
            )
            return self_instruct.generate(
                docs, Path(tmp) / name, tokenizer=tokenizer, client=client, min_tokens=300,
                max_tokens=4000, per_doc=args.per_doc, seed=0,
            )  # fmt: skip

        rows = [(f"concurrency {c}", run(f"c{c}", c)) for c in (1, 4, 8)]
        # A run stopped before its last call (the key revoked), then restarted with the same arguments.
        total = rows[0][1]["calls"]["made"]
        answered = 0

        def revoke_before_last(body: dict) -> str:
            nonlocal answered
            answered += 1
            if answered == total - 1:
                server.key = "sk-revoked"
            return reply(body)

        reply, server.reply = server.reply, revoke_before_last
        try:
            run("restarted", 4)
        except ServerError:
            pass
        server.key, server.reply = "sk-bench", reply
        rows.append(("restart at last call", run("restarted", 4)))
        data = {(Path(tmp) / d / "data.jsonl").read_bytes() for d in ("c1", "c4", "c8", "restarted")}
        assert len(data) == 1, "the rows wrote different files"
    first = rows[1][1]
    documents = first["documents"]
    print(
        f"documents: {documents['read']} read, {documents['used']} used ({documents['cut']} cut), "
        f"skipped {documents['skipped']}; samples {first['samples']['made']}; stub latency {args.latency} s\n"
    )
    print(f"{'run':<22}{'calls sent':>11}{'reused':>11}{'wall s':>9}{'s/sample':>10}{'vs c=1':>8}")
    base = rows[0][1]["wall_seconds"]
    for name, report in rows:
        calls = report["calls"]
        print(
            f"{name:<22}{calls['made']:>11}{calls['reused']:>11}{report['wall_seconds']:>9.2f}"
            f"{report['seconds_per_sample']:>10.4f}{base / report['wall_seconds']:>7.1f}x"
        )
    if args.report:
        args.report.write_text(json.dumps(first, indent=2) + "\n")


if __name__ == "__main__":
    main()

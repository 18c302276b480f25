"""Chat JSONL -> tokenized sample dataset (Arrow) with assistant-only labels, plus report.json.

    python scripts/pre_tokenize.py --input data/sample.jsonl --tokenizer data/tokenizer \
        --output out/tokenized --max-seq-len 8192
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from transformers import AutoTokenizer

from longalign.tokenize import TRUNCATIONS, InputError, RecordError, TemplateError, pre_tokenize


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--input", required=True, help="JSONL file, one chat record per line")
    parser.add_argument("--tokenizer", required=True, help="tokenizer directory or hub name")
    parser.add_argument("--output", required=True, help="output dataset directory (replaced atomically)")
    parser.add_argument("--max-seq-len", type=int, required=True, help="longest sample kept, in tokens")
    parser.add_argument(
        "--truncation", choices=TRUNCATIONS, default="right", help="what to do with longer samples"
    )
    parser.add_argument("--num-proc", type=int, default=1, help="tokenizer processes")
    parser.add_argument(
        "--strict", action="store_true", help="stop at the first bad line instead of skipping it"
    )
    parser.add_argument(
        "--chat-template", type=Path, help="Jinja file that replaces the tokenizer's chat template"
    )
    parser.add_argument("--trust-remote-code", action="store_true")
    args = parser.parse_args(argv)

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer, trust_remote_code=args.trust_remote_code)
    if not tokenizer.is_fast:
        parser.error(
            f"{args.tokenizer}: a fast tokenizer is needed (token offsets locate the assistant turns)"
        )
    if args.chat_template is not None:
        tokenizer.chat_template = args.chat_template.read_text(encoding="utf-8")
    try:
        report = pre_tokenize(
            args.input,
            tokenizer,
            args.output,
            max_seq_len=args.max_seq_len,
            truncation=args.truncation,
            num_proc=args.num_proc,
            strict=args.strict,
        )
    except (InputError, RecordError, TemplateError) as err:
        print(f"pre_tokenize: error: {err}", file=sys.stderr)
        return 2
    print(summary(report, args.output))
    return 0


def summary(report: dict, output: str) -> str:
    dropped = ", ".join(f"{k} {v}" for k, v in report["dropped"].items() if v) or "none"
    pct = report["length_percentiles"]
    lines = [
        f"lines read     {report['lines_read']}",
        f"samples kept   {report['samples_kept']}  (truncated {report['truncated']})",
        f"dropped        {report['dropped_total']}: {dropped}",
        f"tokens         {report['total_tokens']}  (targets {report['target_tokens']})",
    ]
    if pct:
        lines.append(
            "length         "
            + "  ".join(f"{k} {v:.0f}" for k, v in pct.items() if k in ("min", "p50", "p90", "max"))
        )
    lines += [f"  line {e['line']}: {e['reason']}: {e['message']}" for e in report["first_errors"][:5]]
    lines.append(f"wrote {output} (report.json inside)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

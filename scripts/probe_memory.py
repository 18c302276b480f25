"""Length-ladder memory probe: the longest pack this run's training steps fit in.

    python scripts/probe_memory.py --config run.toml --lengths 4k,8k,16k,32k,64k [section.key=value ...]
    accelerate launch scripts/probe_memory.py --config run.toml --lengths 16k,32k,64k    (DDP, FSDP, DeepSpeed)

For each length, smallest first, a fresh process per rank builds the run's trainer from the config (its
model, attention backend, precision, gradient checkpointing, sharding and loss chunking) on synthetic
packs of exactly that many tokens, per_device_batch_size packs per rank, and runs two optimizer steps
(the second is the first to carry the optimizer states through forward and backward: the steady-state
peak, and the step time shown). Peak memory is CUDA max_memory_allocated, or on CPU the peak resident set of that fresh process, so each
length's number is its own; the table shows the worst rank. The ladder stops at the first length that
fails (out of memory or any other error) and prints what would raise the limit. The table and every
rank's numbers, with the failure's traceback, go to probe.json.

--max-memory caps each rank: on CUDA the allocator refuses more (a real out-of-memory error); on CPU a
step whose peak resident set is over the cap counts as out of memory.

Exit status: 0 when at least the smallest length fits (the table is the answer), 1 when none does (so
`--lengths 64k` alone checks one length), 2 for bad arguments or config.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, NoReturn

import datasets
import torch
import torch.distributed as dist
from transformers import AutoTokenizer, TrainingArguments

from longalign.config import Config, ConfigError, load_config
from longalign.probe import (
    ERROR,
    FITS,
    OUT_OF_MEMORY,
    STOPPED,
    classify_failure,
    combine_ranks,
    format_length,
    format_row,
    format_table,
    headline,
    measure_steps,
    parse_lengths,
    parse_size,
    probe_overrides,
    suggestions,
    synthetic_pack,
)
from longalign.trainer import build_trainer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", type=Path, required=True, help="the run's TOML file")
    parser.add_argument(
        "--lengths", default="4k,8k,16k,32k,64k", help="tokens per pack, e.g. 4k,8k,16k or 3000"
    )
    parser.add_argument("--max-memory", help="memory cap per rank, e.g. 70GiB (see above)")
    parser.add_argument("--output", type=Path, default=Path("probe.json"), help="where the results go")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic sample lengths and tokens")
    parser.add_argument("--trace", action="store_true", help="also print the failing step's traceback")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)  # one length, in a fresh process
    parser.add_argument("--packs", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*", help="section.key=value settings that win over the file")
    args = parser.parse_args(argv)
    try:
        lengths = parse_lengths(args.lengths)
        max_memory = parse_size(args.max_memory) if args.max_memory else None
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, ValueError) as err:
        print(f"probe_memory: error: {err}", file=sys.stderr)
        return 2
    if args.worker is not None:
        return worker(args, max_memory)

    datasets.disable_progress_bars()
    ranks = Ranks()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a launcher stopping us: end the step too
    tokenizer = AutoTokenizer.from_pretrained(
        cfg.model.tokenizer or cfg.model.model_name_or_path, trust_remote_code=cfg.model.trust_remote_code
    )
    per_rank = cfg.training.args.get(
        "per_device_train_batch_size", TrainingArguments.per_device_train_batch_size
    )
    entries: list[dict[str, Any]] = []
    ranks.say(
        f"probe of {args.config}: {ranks.world} rank(s), {per_rank} pack(s) of each length per rank and step"
    )
    ranks.say(format_row(None))
    with tempfile.TemporaryDirectory(prefix="longalign-probe-") as tmp:
        for length in lengths:
            pack = synthetic_pack(length, vocab_size=len(tokenizer), seed=args.seed)
            work = Path(tmp) / format_length(length)
            datasets.Dataset.from_list([pack] * (per_rank * ranks.world)).save_to_disk(str(work / "packs"))
            result = run_length(args, length, work, ranks)
            entry = combine_ranks(length, ranks.gather(result), max_memory=max_memory)
            entry.update(samples_per_pack=len(pack["seq_lens"]), packs_per_rank=per_rank)
            entries.append(entry)
            ranks.say(format_row(entry))
            if entry["status"] != FITS:
                break
    for length in lengths[len(entries) :]:
        ranks.say(format_row(length))
    if ranks.rank == 0:
        report(args, cfg, entries, lengths, ranks.world, max_memory=max_memory, vocab_size=len(tokenizer))
    return 0 if entries[0]["status"] == FITS else 1


def report(
    args: argparse.Namespace,
    cfg: Config,
    entries: list[dict[str, Any]],
    lengths: list[int],
    world: int,
    *,
    max_memory: int | None,
    vocab_size: int,
) -> None:
    """Rank 0: the headline, the failure with its advice, and probe.json."""
    print()
    print(headline(entries))
    last = entries[-1]
    advice = []
    if last["status"] == OUT_OF_MEMORY:
        on_gpu = torch.cuda.is_available() and not cfg.training.args.get("use_cpu")
        advice = suggestions(
            cfg, device_type="cuda" if on_gpu else "cpu", vocab_size=vocab_size, environ=os.environ
        )
        print("what would raise the limit:")
        print("\n".join(f"  {i}. {line}" for i, line in enumerate(advice, 1)))
    if last.get("traceback") and args.trace:
        print(last["traceback"], end="")
    elif last.get("traceback"):
        print(f"(traceback in {args.output}; --trace prints it)")
    summary = {
        "config": str(args.config),
        "overrides": args.overrides,
        "lengths": lengths,
        "packs_per_rank": entries[0]["packs_per_rank"],
        "world_size": world,
        "max_memory": max_memory,
        "largest_fitting_length": max((e["length"] for e in entries if e["status"] == FITS), default=None),
        "suggestions": advice,
        "table": format_table(entries, lengths),
        "results": entries,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.output}")


def run_length(args: argparse.Namespace, length: int, work: Path, ranks: Ranks) -> dict[str, Any]:
    """This rank's step at ``length`` in a fresh process; its result, or why it has none."""
    result_path, log_path = work / "result.json", work / "worker.log"
    command = [
        sys.executable, __file__, "--config", str(args.config), "--worker", str(length),
        "--packs", str(work / "packs"), "--result", str(result_path),
        *(["--max-memory", args.max_memory] if args.max_memory else []), *args.overrides,
    ]  # fmt: skip
    env = ranks.worker_env()
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            stopped = ranks.wait(process, length)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    if result_path.exists():
        result = json.loads(result_path.read_text())
    elif stopped:
        result = {"status": STOPPED, "error": "ended because another rank failed"}
    else:
        code = process.returncode
        why = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
        oom = code == -signal.SIGKILL  # what the kernel's out-of-memory killer sends
        result = {
            "status": OUT_OF_MEMORY if oom else ERROR,
            "error": f"the step's process was {why}"
            + (" (the kernel's out-of-memory killer?)" if oom else ""),
            "traceback": log_path.read_text(errors="replace")[-4000:],
        }
    if result["status"] not in (FITS, STOPPED):
        ranks.flag_failure(length)
    return {"rank": ranks.rank, **result}


def worker(args: argparse.Namespace, max_memory: int | None) -> NoReturn:
    """The steps at ``args.worker`` tokens per pack; writes the result and leaves at once."""
    length = args.worker
    result: dict[str, Any] = {}
    try:
        if max_memory is not None and torch.cuda.is_available():
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, max_memory / total), device)
        overrides = probe_overrides(length, train_file=args.packs, output_dir=args.packs.parent / "run")
        trainer = build_trainer(load_config(args.config, [*args.overrides, *overrides]))
        result = {"status": FITS, **measure_steps(trainer)}
    except Exception as err:  # any failure is the answer for this length, reported in one line
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0]
        result = {
            "status": classify_failure(err),
            "error": f"{type(err).__name__}: {first_line[:300]}",
            "traceback": traceback.format_exc(),
        }
    args.result.write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    # Leave without interpreter teardown: after a failure, peers may hold collectives open forever.
    os._exit(0)


class Ranks:
    """The probe's own processes, one per rank under ``accelerate launch`` (just this one otherwise).

    Each is the parent of its rank's step processes. Per length, the step processes form a process
    group of their own on a fresh port; when one rank's step fails, the others' steps (possibly waiting
    in a collective for it) are ended, through a key-value store the parents share.
    """

    def __init__(self) -> None:
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.store: dist.TCPStore | None = None
        if self.world > 1:
            dist.init_process_group("gloo")
            host = os.environ["MASTER_ADDR"]
            if self.rank == 0:
                self.store = dist.TCPStore(host, 0, self.world, True, wait_for_workers=False)
            port = [self.store.port if self.store else None]
            dist.broadcast_object_list(port, src=0)
            if self.rank != 0:
                self.store = dist.TCPStore(host, port[0], self.world, False)

    def say(self, line: str) -> None:
        if self.rank == 0:
            print(line, flush=True)

    def worker_env(self) -> dict[str, str]:
        """The step's environment: under a launcher, a fresh rendezvous that rank 0's step hosts."""
        env = dict(os.environ)
        if "MASTER_ADDR" in env:
            port = [_free_port() if self.rank == 0 else None]
            if self.world > 1:
                dist.broadcast_object_list(port, src=0)
            # Not the launcher's store: each length's steps form a process group of their own.
            env.update(MASTER_PORT=str(port[0]), TORCHELASTIC_USE_AGENT_STORE="False")
        return env

    def wait(self, process: subprocess.Popen, length: int) -> bool:
        """Wait for the step to end; ``True`` when it was ended because another rank failed."""
        while process.poll() is None:
            if self.store is not None and self.store.check([f"failed/{length}"]):
                return True
            time.sleep(0.2)
        return False

    def flag_failure(self, length: int) -> None:
        if self.store is not None:
            self.store.set(f"failed/{length}", str(self.rank))

    def gather(self, result: dict[str, Any]) -> list[dict[str, Any]]:
        if self.world == 1:
            return [result]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, result)
        return out


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())

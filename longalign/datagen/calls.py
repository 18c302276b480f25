"""Calls that are paid for once: every finished completion is kept in a cache file next to the output.

    cache = CallCache(cache_path("out/gen"))          # out/.gen.cache.jsonl, read back if it exists
    call = CachedCalls(client, cache)
    call([{"role": "user", "content": "..."}], max_tokens=512, temperature=0.7, seed=17)
        -> Completion(...)       # from the server, appended to the cache (flushed) before returning
    call(...same request...)
        -> Completion(...)       # from the cache: no request is sent

The cache is JSON Lines, one finished call a line, keyed by the SHA-256 of the request as sent (model,
messages, sampling settings); a restart with the same arguments sends the same requests, so it finds its
earlier answers. A line cut short by a killed process is ignored. Failed calls are not kept: a restart
tries them again. The API key is part of no request body, so it is never in the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from longalign.serving import CallFailure, ChatClient, Completion


def cache_path(output_dir: str | os.PathLike) -> Path:
    """Where the call cache of an output directory lives: a hidden sibling file.

    cache_path("out/gen") -> PosixPath('out/.gen.cache.jsonl')
    """
    output = Path(output_dir)
    return output.parent / f".{output.name}.cache.jsonl"


def request_key(request: dict[str, Any]) -> str:
    """The cache key of a request body: SHA-256 of its canonical JSON."""
    canonical = json.dumps(request, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


class CallCache:
    """Finished calls by request key, loaded from ``path`` and appended to it, one line per call."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._entries: dict[str, Completion] = {}
        self._cut_short = False  # the file's last line has no newline: a killed run was writing it
        if self.path.exists():
            with open(self.path, encoding="utf-8") as f:
                for line in f:
                    self._cut_short = not line.endswith("\n")
                    try:
                        entry = json.loads(line)
                        self._entries[entry["key"]] = Completion(**entry["completion"])
                    except (ValueError, KeyError, TypeError):
                        continue
        self._file = None

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def get(self, key: str) -> Completion | None:
        """The kept answer to the request with ``key``, if there is one."""
        with self._lock:
            return self._entries.get(key)

    def put(self, key: str, completion: Completion) -> None:
        """Keep ``completion``; it is on disk (flushed and synced) when this returns."""
        line = json.dumps({"key": key, "completion": asdict(completion)}, ensure_ascii=False) + "\n"
        with self._lock:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "a", encoding="utf-8")  # closed by close() or remove()
                if self._cut_short:
                    self._file.write("\n")
            self._file.write(line)
            self._file.flush()
            os.fsync(self._file.fileno())
            self._entries[key] = completion

    def close(self) -> None:
        """Close the file; the entries stay readable."""
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def remove(self) -> None:
        """Close and delete the cache file (once the output it served is written)."""
        self.close()
        self.path.unlink(missing_ok=True)


@dataclass
class CacheCounts:
    """What the cache saved this run: answers reused and the tokens the server reported for them."""

    hits: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


class Stopped(Exception):
    """Another sample's call raised; this one stops before its next call."""


class CachedCalls:
    """``client.complete`` through a ``CallCache``; thread-safe; ``stop()`` makes further calls raise ``Stopped``."""

    def __init__(self, client: ChatClient, cache: CallCache) -> None:
        self.client = client
        self.cache = cache
        self.counts = CacheCounts()
        self._lock = threading.Lock()
        self._stopped = threading.Event()

    def __call__(
        self, messages: Sequence[dict[str, str]], *, max_tokens: int, temperature: float, seed: int
    ) -> Completion | CallFailure:
        """The answer to one chat request: kept, or asked for and kept if it succeeds."""
        if self._stopped.is_set():
            raise Stopped
        request = {
            "messages": list(messages),
            "max_tokens": max_tokens,
            "temperature": temperature,
            "seed": seed,
        }
        key = request_key({"model": self.client.settings.model, **request})
        kept = self.cache.get(key)
        if kept is not None:
            with self._lock:
                self.counts.hits += 1
                self.counts.prompt_tokens += kept.prompt_tokens or 0
                self.counts.completion_tokens += kept.completion_tokens or 0
            return kept
        result = self.client.complete(**request)
        if isinstance(result, Completion):
            self.cache.put(key, result)
        return result

    def stop(self) -> None:
        """Make every later call raise ``Stopped`` (a ``ServerError`` elsewhere ends the run)."""
        self._stopped.set()

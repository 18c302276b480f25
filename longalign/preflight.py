"""Preflight: every rank reports what it would train with, and the ranks must agree before the first step.

Each rank collects a list of :class:`Check` values (library versions, the attention backend, what trains:
every weight or LoRA adapters, fingerprints of the config, how the checkpoint is read and what its
``config_overrides`` change, fingerprints of the tokenizer and packed dataset, the environment
variables the run depends on, a collective round trip, the host and device); rank 0 compares them and
prints one table, one line per distinct value::

    check              status   ranks  value
    torch              ok       all    2.13.0+cpu
    dataset            DIFFERS  0      3 packs, cu_seqlens a1dd6d869503
                                1      2 packs, cu_seqlens e5ebf382f15a
    device             info     0      cuda:0 NVIDIA H100 80GB HBM3, 79.1 GiB, 78.5 GiB free
                                1      cuda:1 NVIDIA H100 80GB HBM3, 79.1 GiB, 77.9 GiB free

    dataset: rank 1 differs from rank 0 (2 packs, ... vs 3 packs, ...). Fix: copy the same packed dataset ...

Checks made with ``must_agree=False`` (host, device, free memory) are shown but never fail the preflight.
The ``parallelism`` row says what the run's ``Accelerator`` set up (DDP, FSDP version and sharding,
DeepSpeed ZeRO stage and offload, sequence-parallel groups, world size and nodes); when the launch asked
for an engine it did not get (an FSDP accelerate config on CPU ranks runs DDP), one line under the table
says so: a warning, since the run works, only not as asked.
Under sequence parallelism two more rows: the split (every rank must agree on it), and the packs each
group's first micro-batch holds, compared within each group only (the ranks of a group share every pack,
groups get different ones).
``longalign preflight`` (``scripts/preflight.py``) runs it on its own, without a model; ``longalign train``
runs it after building the trainer when ``[training] preflight`` is true, or unset with more than one rank
(both in ``longalign.run``).
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import json
import os
import platform
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from longalign.attention import resolve_backend
from longalign.batching import PackBatchSampler, pack_costs, packs_fingerprint
from longalign.config import Config
from longalign.fingerprints import digest, tokenizer_digests
from longalign.redact import redact

# Checked by default; ``*`` matches any suffix. Secret values are shown as a hash (longalign.redact).
DEFAULT_ENV = (
    "CUDA_VISIBLE_DEVICES",
    "NCCL_*",
    "PYTORCH_CUDA_ALLOC_CONF",
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "HF_TOKEN",
)
PACKAGES = ("torch", "transformers", "accelerate", "datasets", "longalign")
FLASH_PACKAGES = ("flash-attn", "flash-attn-3", "flash-attn-4")  # FA2, FA3 (hopper/), FA4

FIX_VERSIONS = "install the same package versions on every node (compare `pip freeze` between nodes)"
FIX_BACKEND = (
    "give every node the same GPU type and attention kernels (flash-attn), or pin model.attn_backend"
)
FIX_ADAPTERS = (
    "install peft on every node (pip install 'longalign[lora]'), and for QLoRA bitsandbytes on a CUDA GPU or "
    "CPU (pip install 'longalign[qlora]')"
)
FIX_CONFIG = "launch every rank with the same config file and the same overrides"
FIX_TOKENIZER = "point every rank at the same tokenizer files (model.tokenizer)"
FIX_DATASET = "copy the same packed dataset to every node, or point data.{key} at shared storage"
FIX_ENV = "export the same value of {name} on every node, or leave it unset everywhere"
FIX_GROUP = (
    "the ranks of a sequence-parallel group must collate the same packs: give them the same packed dataset, "
    "packing.seed and per_device_batch_size"
)
FIX_PARALLELISM = (
    "launch every rank with the same accelerate config (accelerate launch --config_file ...) and the same "
    "number of processes on every node"
)
FIX_ALL_REDUCE = (
    "check the collective backend's network settings (NCCL_SOCKET_IFNAME, NCCL_IB_*, firewalls, "
    "MASTER_ADDR/MASTER_PORT)"
)


@dataclass(frozen=True)
class Check:
    """What one rank sees for one row of the table."""

    name: str  # the row, e.g. "torch", "dataset", "env HF_TOKEN"
    value: str  # compared across ranks (when must_agree) and shown
    must_agree: bool = True  # False: may differ between ranks (device, free memory, host)
    error: str | None = None  # the check itself failed on this rank
    fix: str = ""  # what to do when ranks disagree or the check fails
    detail: dict[str, str] | None = None  # parts of the value, to name the ones that differ
    group: int | None = None  # compared only with the ranks of the same group (sequence parallelism)
    warning: str | None = None  # shown under the table; the run works, but not as the launch asked


@dataclass(frozen=True)
class PreflightReport:
    """The table rank 0 prints and one line per problem; ``ok`` when there is none."""

    table: str
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # shown, never failing

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        notes = [*self.warnings, *self.problems]
        return "\n".join(
            [self.table, *(["", *notes] if notes else []), "preflight: " + ("ok" if self.ok else "FAILED")]
        )


def preflight_enabled(setting: bool | None, world_size: int) -> bool:
    """``[training] preflight``: true or false as written; unset means on when there is more than one rank."""
    return world_size > 1 if setting is None else setting


def attempt(name: str, make: Callable[[], Check], fix: str = "") -> Check:
    """``make()``, or a failed check named ``name`` that carries the error in one line."""
    try:
        return make()
    except Exception as err:  # a check that cannot run on this rank is itself the finding
        lines = str(err).strip().splitlines() or [""]
        return Check(name, "-", error=f"{type(err).__name__}: {lines[0]}", fix=fix)


def version_checks() -> list[Check]:
    """Python and package versions; one row for the flash kernels (FA2, FA3, FA4), installed or not."""
    checks = [Check("python", platform.python_version(), fix=FIX_VERSIONS)]
    checks += [Check(package, _version(package) or "not installed", fix=FIX_VERSIONS) for package in PACKAGES]
    flash = [f"{package} {_version(package)}" for package in FLASH_PACKAGES if _version(package)]
    checks.append(Check("flash-attn", ", ".join(flash) or "not installed", fix=FIX_VERSIONS))
    return checks


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def backend_check(device: torch.device, dtype: torch.dtype, backend: str) -> Check:
    """The attention backend the run's attention calls resolve to on this rank's device and dtype."""
    name = "attention backend"
    where = f"{str(dtype).removeprefix('torch.')} on {device.type}"
    return attempt(
        name,
        lambda: Check(name, f"{resolve_backend(device, dtype, backend=backend)} ({where})", fix=FIX_BACKEND),
        FIX_BACKEND,
    )


def adapter_check(cfg: Config, device: torch.device) -> Check:
    """What trains: every weight, or ``[lora]``'s adapters with this rank's peft (and bitsandbytes) version.

    QLoRA fails the check where loading the model would: on a device bitsandbytes does not quantize on,
    without bitsandbytes, or where a small quantized layer does not run forward and backward.
    """
    name = "adapters"
    lora = cfg.lora
    if lora is None:
        return Check(name, "none (full fine-tuning)")

    def check() -> Check:
        peft = _version("peft")
        if peft is None:
            raise RuntimeError("peft is not installed")
        if not (lora.load_in_4bit or lora.load_in_8bit):
            return Check(name, f"LoRA r={lora.r}, peft {peft}", fix=FIX_ADAPTERS)
        from longalign.lora import quantization_problem, try_quantized_layer

        problem = quantization_problem(lora, device)
        if problem is not None:
            raise RuntimeError(problem)
        try_quantized_layer(lora, device)
        bits = 4 if lora.load_in_4bit else 8
        return Check(
            name,
            f"QLoRA {bits}-bit r={lora.r}, peft {peft}, bitsandbytes {_version('bitsandbytes')}",
            fix=FIX_ADAPTERS,
        )

    return attempt(name, check, FIX_ADAPTERS)


def config_check(cfg: Config) -> Check:
    """A fingerprint of the whole config; ``detail`` holds every ``section.key`` to name what differs."""
    flat = {
        f"{section}.{key}": json.dumps(value, sort_keys=True, default=str)
        for section, table in cfg.to_dict().items()
        for key, value in table.items()
    }
    shown = {key: redact(key, value) for key, value in flat.items()}  # the detail may reach a message
    return Check("config", digest(flat), fix=FIX_CONFIG, detail=shown)


def layout_check(cfg: Config) -> Check:
    """How the model's checkpoint is read, from its ``config.json`` alone: native, or mapped from ChatGLM."""
    from longalign.checkpoints import layout_note

    mc = cfg.model
    note = layout_note(
        mc.model_name_or_path, trust_remote_code=mc.trust_remote_code, save_format=mc.save_format
    )
    return Check("model layout", note or "native")


def tokenizer_check(tokenizer: Any) -> Check:
    """A fingerprint of the tokenizer's vocabulary (added tokens included) and chat template.

    ``detail`` separates the two, so a failure says which one differs.
    """
    detail = tokenizer_digests(tokenizer)
    value = f"{len(tokenizer.get_vocab())} tokens, {digest(detail)}"
    return Check("tokenizer", value, fix=FIX_TOKENIZER, detail=detail)


def packs_check(name: str, packs: Any, key: str) -> Check:
    """Row count and a hash of the ``cu_seqlens`` column of a packed dataset (whatever its int width)."""
    return Check(name, packs_fingerprint(packs), fix=FIX_DATASET.format(key=key))


def sequence_parallel_checks(
    cfg: Config, packs: Any, *, rank: int, world_size: int, batch_size: int
) -> list[Check]:
    """The split of the ranks into groups, and the packs of this rank's first micro-batch, by group.

    The packs are dealt as the trainer deals them (``PackBatchSampler``, epoch 0); the value names them
    and hashes their ``cu_seqlens``, so a rank with another copy of the data differs as well::

        4 ranks, sequence_parallel_size 2  ->  ranks 0, 1: "group 0: packs [7], cu_seqlens 3f0a..."
                                               ranks 2, 3: "group 1: packs [2], cu_seqlens 91c4..."
    """
    size = cfg.training.sequence_parallel_size
    groups = world_size // size
    split = Check(
        "sequence parallel",
        f"{size} ranks per pack, {groups} group{'s' if groups != 1 else ''}",
        fix=FIX_CONFIG,
    )
    group = rank // size

    def first_packs() -> Check:
        sampler = PackBatchSampler(
            pack_costs(packs),
            packs_per_batch=batch_size,
            num_replicas=world_size,
            rank=rank,
            sequence_parallel_size=size,
            seed=cfg.packing.seed,
        )
        batch = next(iter(sampler))
        indices = [int(index) for index, _ in batch]
        cu_seqlens = [list(packs[index]["cu_seqlens"]) for index in indices]
        value = f"group {group}: packs {indices}, cu_seqlens {digest(cu_seqlens)}"
        return Check("first packs", value, fix=FIX_GROUP, group=group)

    return [split, attempt("first packs", first_packs, FIX_GROUP)]


def env_checks(names: Sequence[str], environ: Mapping[str, str]) -> list[Check]:
    """One row per name or ``PREFIX*`` pattern; values of secret-looking names only as a short hash.

    >>> [c.value for c in env_checks(["HOME", "NCCL_*", "HF_TOKEN"], {"HOME": "/h", "HF_TOKEN": "hf_x"})]
    ['/h', '(none set)', 'sha256:f5618cd8']
    """
    checks = []
    for name in names:
        if "*" in name:
            found = sorted(key for key in environ if fnmatch.fnmatchcase(key, name))
            value = ", ".join(f"{key}={redact(key, environ[key])}" for key in found) or "(none set)"
        else:
            value = redact(name, environ[name]) if name in environ else "(unset)"
        checks.append(Check(f"env {name}", value, fix=FIX_ENV.format(name=name)))
    return checks


def all_reduce_check(device: torch.device) -> Check:
    """Sum each rank's ``rank + 1`` over all ranks: the collective the run depends on, round-tripped."""
    name = "all-reduce"
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return Check(name, "single rank, nothing to reduce")

    def reduce() -> Check:
        world = dist.get_world_size()
        total = torch.tensor([dist.get_rank() + 1.0], dtype=torch.float64, device=device)
        dist.all_reduce(total)
        expected = world * (world + 1) / 2
        if total.item() != expected:
            raise RuntimeError(f"sum {total.item():g}, expected {expected:g}")
        return Check(name, f"ok, {world} ranks", fix=FIX_ALL_REDUCE)

    return attempt(name, reduce, FIX_ALL_REDUCE)


@dataclass(frozen=True)
class Parallelism:
    """How the ranks run one training step: the engine accelerate set up and how the ranks split."""

    engine: str  # "single process", "DDP", "FSDP", "DeepSpeed", or accelerate's name for another
    device: str = "CPU"  # what each rank computes on: "CPU", "GPU", ...
    world_size: int = 1
    nodes: int = 1
    fsdp_version: int | None = None
    sharding: str | None = None  # FSDP: the sharding strategy (FSDP1) or resharding after forward (FSDP2)
    zero_stage: int | None = None  # DeepSpeed ZeRO stage
    offload: str | None = None  # where parameters and optimizer states live when not on the device
    find_unused_parameters: bool | None = None  # DDP: a search for unused parameters every step
    sequence_parallel_size: int = 1  # ranks each pack is split over (longalign's [training] setting)

    @property
    def name(self) -> str:
        """``"DDP"``, ``"FSDP2"``, ``"DeepSpeed ZeRO-3"``: the engine with its version or stage."""
        if self.engine == "FSDP" and self.fsdp_version:
            return f"FSDP{self.fsdp_version}"
        if self.engine == "DeepSpeed" and self.zero_stage is not None:
            return f"DeepSpeed ZeRO-{self.zero_stage}"
        return self.engine

    def __str__(self) -> str:
        """One line, the same on every rank of a sound launch::

        DDP over 2 CPU ranks on 1 node, find_unused_parameters false
        DeepSpeed ZeRO-3 over 16 GPU ranks on 2 nodes, offload params cpu, optimizer cpu; sequence parallel: 2 ranks per pack, 8 groups
        """
        ranks = f"{self.world_size} {self.device} rank{'s' if self.world_size != 1 else ''}"
        nodes = f"{self.nodes} node{'s' if self.nodes != 1 else ''}"
        parts = [f"{self.name} over {ranks} on {nodes}" if self.world_size > 1 else f"{self.name} ({ranks})"]
        if self.sharding:
            parts.append(self.sharding)
        if self.offload:
            parts.append(f"offload {self.offload}")
        if self.find_unused_parameters is not None:
            parts.append(f"find_unused_parameters {str(self.find_unused_parameters).lower()}")
        text = ", ".join(parts)
        if self.sequence_parallel_size > 1:
            groups = self.world_size // self.sequence_parallel_size
            text += (
                f"; sequence parallel: {self.sequence_parallel_size} ranks per pack, "
                f"{groups} group{'s' if groups != 1 else ''}"
            )
        return text


@dataclass(frozen=True)
class Request:
    """An engine the launch asked for, and where it was asked: ``FSDP2`` from ``accelerate config``."""

    engine: str  # "FSDP" or "DeepSpeed"
    name: str  # shown: "FSDP2", "DeepSpeed ZeRO-3", "DeepSpeed"
    source: str  # "accelerate config", "[training] deepspeed", ...
    fsdp_version: int | None = None
    zero_stage: int | None = None


def requested_engines(
    environ: Mapping[str, str], *, deepspeed: Any = None, fsdp: Any = None, zero_stage: int | None = None
) -> list[Request]:
    """The sharding engines a launch asked for: in ``[training]`` (``deepspeed``, ``fsdp``) or the launcher's exports.

    ``accelerate launch`` with an FSDP config exports ``ACCELERATE_USE_FSDP=true`` and ``FSDP_VERSION``;
    with a DeepSpeed one ``ACCELERATE_USE_DEEPSPEED=true`` (and ``ACCELERATE_DEEPSPEED_ZERO_STAGE`` when
    the stage is in the accelerate config; one in a JSON file comes as ``zero_stage``)::

        {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"} -> [Request("FSDP", "FSDP2", "accelerate config", 2)]
    """
    asked = []
    if fsdp:
        asked.append(Request("FSDP", "FSDP", "[training] fsdp"))
    elif environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        version = int(environ.get("FSDP_VERSION", "1"))
        asked.append(Request("FSDP", f"FSDP{version}", "accelerate config", fsdp_version=version))
    stage_text = environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
    stage = int(stage_text) if stage_text else zero_stage
    name = "DeepSpeed" if stage is None else f"DeepSpeed ZeRO-{stage}"
    if deepspeed:
        asked.append(Request("DeepSpeed", name, "[training] deepspeed", zero_stage=stage))
    elif environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        asked.append(Request("DeepSpeed", name, "accelerate config", zero_stage=stage))
    return asked


def unmet_request(running: Parallelism, asked: Sequence[Request]) -> str | None:
    """One line when the launch asked for an engine, version or stage it is not running; else ``None``.

    >>> unmet_request(Parallelism("DDP", world_size=2), [Request("FSDP", "FSDP2", "accelerate config", 2)])
    'asked for FSDP2 (accelerate config), running DDP over 2 CPU ranks: FSDP is not in effect'
    """
    for request in asked:
        if request.engine != running.engine:
            what = f"{request.engine} is not in effect"
        elif request.fsdp_version not in (None, running.fsdp_version):
            what = f"FSDP{request.fsdp_version} is not in effect"
        elif request.zero_stage not in (None, running.zero_stage):
            what = f"ZeRO-{request.zero_stage} is not in effect"
        else:
            continue
        ranks = f"{running.world_size} {running.device} rank{'s' if running.world_size != 1 else ''}"
        return f"asked for {request.name} ({request.source}), running {running.name} over {ranks}: {what}"
    return None


def parallelism_check(running: Parallelism, asked: Sequence[Request] = ()) -> Check:
    """The ``parallelism`` row: what runs (compared across ranks), warning when it is not what was asked."""
    return Check("parallelism", str(running), fix=FIX_PARALLELISM, warning=unmet_request(running, asked))


def parallelism_in_effect(
    accelerator: Any, *, sequence_parallel_size: int = 1, environ: Mapping[str, str] | None = None
) -> Parallelism:
    """Read what an ``accelerate.Accelerator`` runs: its distributed type and the plugin of its engine.

    The number of nodes is the world size over the launcher's ``LOCAL_WORLD_SIZE`` (ranks on this node).
    """
    environ = os.environ if environ is None else environ
    state = accelerator.state
    kind = state.distributed_type.value  # "NO", "MULTI_CPU", "MULTI_GPU", "FSDP", "DEEPSPEED", ...
    world_size = state.num_processes
    device = {"cuda": "GPU"}.get(state.device.type, state.device.type.upper())
    local = int(environ.get("LOCAL_WORLD_SIZE", world_size) or world_size)
    common = {
        "device": device,
        "world_size": world_size,
        "nodes": max(1, world_size // max(1, local)),
        "sequence_parallel_size": sequence_parallel_size,
    }
    if kind == "FSDP":
        plugin = state.fsdp_plugin
        version = plugin.fsdp_version
        if version == 2:
            sharding = f"reshard_after_forward {str(bool(plugin.reshard_after_forward)).lower()}"
        else:
            sharding = getattr(plugin.sharding_strategy, "name", str(plugin.sharding_strategy))
        offload = "params cpu" if _fsdp_offloads(plugin.cpu_offload) else None
        return Parallelism("FSDP", fsdp_version=version, sharding=sharding, offload=offload, **common)
    if kind == "DEEPSPEED":
        plugin = state.deepspeed_plugin
        zero = plugin.deepspeed_config.get("zero_optimization", {})
        places = {
            what: zero.get(f"offload_{key}", {}).get("device", "none")
            for what, key in (("params", "param"), ("optimizer", "optimizer"))
        }
        offload = ", ".join(
            f"{what} {place}" for what, place in places.items() if place not in ("none", None)
        )
        return Parallelism("DeepSpeed", zero_stage=plugin.zero_stage, offload=offload or None, **common)
    if kind == "NO":
        return Parallelism("single process", **common)
    if kind.startswith("MULTI_"):
        handler = getattr(accelerator, "ddp_handler", None)
        find_unused = handler.find_unused_parameters if handler is not None else None
        return Parallelism("DDP", find_unused_parameters=find_unused, **common)
    return Parallelism(kind, **common)


def _fsdp_offloads(policy: Any) -> bool:
    """Whether an FSDP plugin's ``cpu_offload`` puts parameters in CPU memory (FSDP2 policy or FSDP1 flag)."""
    from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy

    return (
        policy is True
        or isinstance(policy, CPUOffloadPolicy)
        or (isinstance(policy, CPUOffload) and policy.offload_params)
    )


def parallelism_row(
    accelerator: Any, args: Any, *, sequence_parallel_size: int = 1, environ: Mapping[str, str] | None = None
) -> Check:
    """The ``parallelism`` row of a run: what ``accelerator`` runs against what the launch and ``args`` asked.

    ``args`` are the run's ``TrainingArguments``; their DeepSpeed plugin, built whether or not DeepSpeed
    ends up in effect, knows the ZeRO stage that was asked for.
    """
    environ = os.environ if environ is None else environ
    running = parallelism_in_effect(
        accelerator, sequence_parallel_size=sequence_parallel_size, environ=environ
    )
    plugin = getattr(args, "deepspeed_plugin", None)
    asked = requested_engines(
        environ,
        deepspeed=args.deepspeed,
        fsdp=args.fsdp,
        zero_stage=plugin.zero_stage if plugin is not None else None,
    )
    return parallelism_check(running, asked)


def device_checks(device: torch.device) -> list[Check]:
    """Host, device and its free memory: shown for every rank, allowed to differ."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        where = f"{device} {torch.cuda.get_device_name(device)}, {total / 2**30:.1f} GiB"
    else:
        free, where = _available_host_memory(), str(device)
    return [
        Check("host", socket.gethostname(), must_agree=False),
        Check("device", f"{where}, {free / 2**30:.1f} GiB free", must_agree=False),
    ]


def rank_checks(
    cfg: Config,
    *,
    load_tokenizer: Callable[[], Any],
    load_packs: Callable[[], Any],
    load_eval_packs: Callable[[], Any] | None,
    device: torch.device,
    dtype: torch.dtype,
    batch_size: int = 1,
    env_names: Sequence[str] = DEFAULT_ENV,
    environ: Mapping[str, str] | None = None,
    parallelism: Callable[[], Check] | None = None,
    overrides_note: Callable[[], str | None] | None = None,
) -> list[Check]:
    """Everything this rank reports. Loaders are called here, so a rank that cannot load still reports.

    ``batch_size`` is the packs per micro-batch, which decides how packs are dealt to groups;
    ``parallelism`` makes the row of what runs (see :func:`parallelism_row`); ``overrides_note`` says what
    ``model.config_overrides`` change in the model's config (``longalign.run.overrides_note``), a row of
    its own when the run has them.
    """
    environ = os.environ if environ is None else environ
    checks = version_checks()
    checks.append(backend_check(device, dtype, cfg.model.attn_backend))
    checks.append(adapter_check(cfg, device))
    if parallelism is not None:
        checks.append(attempt("parallelism", parallelism, FIX_PARALLELISM))
    checks.append(config_check(cfg))
    if cfg.model.model_name_or_path:
        checks.append(attempt("model layout", lambda: layout_check(cfg)))
    if cfg.model.config_overrides and overrides_note is not None:
        checks.append(attempt("config overrides", lambda: Check("config overrides", overrides_note() or "")))
    checks.append(attempt("tokenizer", lambda: tokenizer_check(load_tokenizer()), FIX_TOKENIZER))
    fix = FIX_DATASET.format(key="train_file")
    checks.append(attempt("dataset", lambda: packs_check("dataset", load_packs(), "train_file"), fix))
    if load_eval_packs is not None:
        fix = FIX_DATASET.format(key="eval_file")
        checks.append(
            attempt("eval dataset", lambda: packs_check("eval dataset", load_eval_packs(), "eval_file"), fix)
        )
    if cfg.training.sequence_parallel_size > 1:
        distributed = dist.is_available() and dist.is_initialized()
        checks += sequence_parallel_checks(
            cfg,
            load_packs(),
            rank=dist.get_rank() if distributed else 0,
            world_size=dist.get_world_size() if distributed else 1,
            batch_size=batch_size,
        )
    checks += env_checks(env_names, environ)
    checks.append(all_reduce_check(device))
    checks += device_checks(device)
    return checks


def gather_checks(checks: list[Check]) -> list[list[Check]]:
    """Every rank's checks, on every rank (``all_gather_object``); just ours on a single rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [checks]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, checks)
    return out


def compare(reports: list[list[Check]]) -> PreflightReport:
    """The table of every rank's checks, and one line per problem naming the ranks and the fix.

    ``reports[r]`` is rank r's list. Where ranks disagree, the value most ranks hold (rank 0's on a
    tie) is the reference and the others are named::

        rank 0: torch 2.13.0, rank 1: torch 2.12.1
        -> "torch: rank 1 differs from rank 0 (2.12.1 vs 2.13.0). Fix: install the same package versions ..."
    """
    names = list(dict.fromkeys(check.name for report in reports for check in report))
    by_rank = [{check.name: check for check in report} for report in reports]
    missing = Check("", "(not reported)")
    rows, problems, warnings = [], [], []
    for name in names:
        checks = [ranks.get(name, missing) for ranks in by_rank]
        groups: dict[str, list[int]] = {}
        for rank, check in enumerate(checks):
            groups.setdefault(_shown_value(check), []).append(rank)
        must_agree = any(check.must_agree for check in checks)
        failed = [rank for rank, check in enumerate(checks) if check.error]
        fix = next((check.fix for check in checks if check.fix), "")
        # Checks with a group are compared within each group; others across all ranks.
        scopes: dict[int | None, dict[str, list[int]]] = {}
        for rank, check in enumerate(checks):
            scopes.setdefault(check.group, {}).setdefault(_shown_value(check), []).append(rank)
        split = [scope for scope in scopes.values() if len(scope) > 1]
        if failed:
            status = "FAILED"
            where = f" on {_ranks(failed, word=True)}" if len(reports) > 1 else ""
            problems.append(f"{name}: failed{where}: {checks[failed[0]].error}. Fix: {fix}")
        elif split and must_agree:
            status = "DIFFERS"
            problems += [_disagreement(name, scope, checks, fix) for scope in split]
        else:
            status = "ok" if must_agree else "info"
        warned: dict[str, list[int]] = {}
        for rank, check in enumerate(checks):
            if check.warning:
                warned.setdefault(check.warning, []).append(rank)
        for warning, ranks in warned.items():
            where = f" ({_ranks(ranks, word=True)})" if len(ranks) < len(reports) else ""
            warnings.append(f"{name}: {warning}{where}")
        if warned and status == "ok":
            status = "warning"
        for i, (value, ranks) in enumerate(groups.items()):
            shown_ranks = "all" if len(groups) == 1 and len(reports) > 1 else _ranks(ranks)
            rows.append((name if i == 0 else "", status if i == 0 else "", shown_ranks, value))
    widths = [max(len(row[i]) for row in [("check", "status", "ranks", "")] + rows) for i in range(3)]
    header = f"preflight: {len(reports)} rank{'s' if len(reports) > 1 else ''}"
    lines = [header, _row(("check", "status", "ranks", "value"), widths)]
    lines += [_row(row, widths) for row in rows]
    return PreflightReport("\n".join(lines), problems, warnings)


def run_preflight(cfg: Config, **kwargs: Any) -> PreflightReport:
    """Collect this rank's checks (see :func:`rank_checks` for the arguments), gather and compare them."""
    return compare(gather_checks(rank_checks(cfg, **kwargs)))


def compute_dtype(model_dtype: torch.dtype, *, bf16: bool, fp16: bool) -> torch.dtype:
    """The dtype attention sees: mixed precision's autocast type, else the model's own."""
    return torch.bfloat16 if bf16 else torch.float16 if fp16 else model_dtype


def check_trainer(
    trainer: Any,
    cfg: Config,
    env_names: Sequence[str] = DEFAULT_ENV,
    overrides_note: Callable[[], str | None] | None = None,
) -> PreflightReport:
    """The preflight of a built ``LongAlignTrainer``: its tokenizer, packs, device, precision and engine
    (``overrides_note``: see :func:`rank_checks`)."""
    args = trainer.args
    return run_preflight(
        cfg,
        load_tokenizer=lambda: trainer.processing_class,
        load_packs=lambda: trainer.train_dataset,
        load_eval_packs=(lambda: trainer.eval_dataset) if trainer.eval_dataset is not None else None,
        device=args.device,
        dtype=compute_dtype(trainer.model.dtype, bf16=args.bf16, fp16=args.fp16),
        batch_size=args.per_device_train_batch_size,
        env_names=env_names,
        parallelism=lambda: parallelism_row(
            trainer.accelerator, args, sequence_parallel_size=cfg.training.sequence_parallel_size
        ),
        overrides_note=overrides_note,
    )


def _disagreement(name: str, groups: dict[str, list[int]], checks: list[Check], fix: str) -> str:
    reference = max(groups, key=lambda value: (len(groups[value]), 0 in groups[value]))
    odd = sorted(rank for value, ranks in groups.items() if value != reference for rank in ranks)
    ref_ranks = groups[reference]
    others = f"rank {ref_ranks[0]}" if len(ref_ranks) == 1 else f"the other {len(ref_ranks)} ranks"
    verb = "differs" if len(odd) == 1 else "differ"
    sample = checks[odd[0]]
    base = checks[ref_ranks[0]]
    what = f"{_shown_value(sample)} vs {reference}"
    if sample.detail is not None and base.detail is not None:
        keys = sorted(
            k for k in sample.detail.keys() | base.detail.keys() if sample.detail.get(k) != base.detail.get(k)
        )
        what = ", ".join(
            f"{k} {sample.detail.get(k, '(absent)')} vs {base.detail.get(k, '(absent)')}" for k in keys[:5]
        )
    return f"{name}: {_ranks(odd, word=True)} {verb} from {others} ({what}). Fix: {fix}"


def _shown_value(check: Check) -> str:
    return f"ERROR {check.error}" if check.error else check.value


def _ranks(ranks: list[int], word: bool = False) -> str:
    """``[0, 1, 2, 5] -> "0-2,5"``; with ``word``, ``"ranks 0-2,5"`` or ``"rank 5"``."""
    spans: list[list[int]] = []
    for rank in sorted(ranks):
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}" if word else text


def _row(cells: tuple[str, str, str, str], widths: list[int]) -> str:
    return (
        "  ".join(cell.ljust(width) for cell, width in zip(cells[:3], widths, strict=True)) + "  " + cells[3]
    )


def _available_host_memory() -> int:
    """MemAvailable on Linux (what can be allocated without swapping), else free pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

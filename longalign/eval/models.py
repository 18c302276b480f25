"""Model access for every eval task: a prompt in token ids, a local transformers model or a served one, replies.

    tokenizer = eval_tokenizer("out/run")                     # the run's own tokenizer, chat template required
    prompt = chat_frame(tokenizer).prompt("Hi")
        -> Prompt(input_ids=[bos, <header> user ..., 'Hi', <eot>, <header> assistant ...], messages=[...])
    model = load_model("out/run")                             # run dir, checkpoint, or a [lora] adapter dir
    LocalGenerator(model, tokenizer, max_new_tokens=32).generate([prompt])  -> [Reply(text='Hello', error=None)]
    ServedGenerator(ChatClient(settings), max_new_tokens=32).generate([prompt]) -> [Reply(...)]

A local model generates from ``Prompt.input_ids`` exactly (its KV cache on, the training patch off); a
served model gets ``Prompt.messages`` and applies its own template.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
from tqdm import tqdm

from longalign import checkpoints
from longalign.answers import StoredCalls
from longalign.chat_template import open_tokenizer
from longalign.chatglm_layout import NATIVE
from longalign.errors import ConfigError, LongAlignError, ModelError, PathError
from longalign.serving import CallFailure, ChatClient

_SLOT = "\u2063LONGALIGN-EVAL-CONTENT\u2063"  # stands for the user's text while the template is rendered
T = TypeVar("T")


@dataclass(frozen=True)
class Prompt:
    """One model input: the rendered chat in token ids, and the same chat as messages for a server."""

    input_ids: list[int] | None  # chat template applied, generation prompt included; None: text only
    messages: list[dict[str, str]]  # [{"role": "user", "content": ...}] for an OpenAI-compatible server
    text: str | None = None  # the rendered chat as text, for a raw completion request (/v1/completions)


@dataclass(frozen=True)
class Reply:
    """What a model answered; ``error`` says why a served request gave no answer (then ``text`` is "")."""

    text: str
    error: str | None = None


class Generator(Protocol):
    """Anything that answers prompts in their order: ``LocalGenerator``, ``ServedGenerator``, a test's fake."""

    def generate(self, prompts: Sequence[Prompt], *, progress: str | None = None) -> list[Reply]: ...


def eval_tokenizer(name: str, *, chat_template: Path | None = None, trust_remote_code: bool = False):
    """The tokenizer that measures lengths and renders prompts; a one-line error when it has no chat template."""
    tokenizer = open_tokenizer(name, trust_remote_code=trust_remote_code)
    if chat_template is not None:
        if not chat_template.is_file():
            raise PathError(f"{chat_template}: chat template file not found")
        tokenizer.chat_template = chat_template.read_text(encoding="utf-8")
    if not tokenizer.chat_template:
        raise ModelError(f"{name}: the tokenizer has no chat template; pass --chat-template FILE")
    return tokenizer


@dataclass(frozen=True)
class ChatFrame:
    """The chat template's text around one user message, and the tokenizer that encodes the whole chat.

    A prompt is the rendered chat encoded in one pass, as pre-tokenize encodes a training chat
    (``longalign.labels.encode_text``), never pieces encoded apart and joined::

        frame = chat_frame(tokenizer)              # Llama 3: before '<|begin_of_text|>...user<|end_header_id|>\\n\\n'
        frame.prompt("Hi")                         # after '<|eot_id|><|start_header_id|>assistant<|end_header_id|>\\n\\n'
        -> Prompt(input_ids=[<|begin_of_text|>, ..., 'Hi', <|eot_id|>, ..., '\\n\\n'], messages=[user: 'Hi'])
        frame.prompt("Hi", answer_prefix=" Answer:")   # the assistant's turn begins with ' Answer:'
    """

    tokenizer: Any
    before: str  # the template's text before the user's text (earlier turns included)
    after: str  # after it, the generation prompt included
    control: frozenset[int]  # the special tokens (message text that spells one is read as text)
    history: tuple[dict[str, str], ...] = ()  # the turns before the user's message

    def encode(self, content: str, *, answer_prefix: str = "") -> tuple[list[int], list[tuple[int, int]]]:
        """The token ids of the chat and each token's character span in ``before + content + after + prefix``."""
        from longalign.labels import encode_text

        text = self.before + content + self.after + answer_prefix
        start = len(self.before)
        return encode_text(self.tokenizer, text, [(start, start + len(content))], self.control)

    def prompt(self, content: str, *, answer_prefix: str = "") -> Prompt:
        """The one-turn chat of ``content``; ``answer_prefix`` follows the generation prompt (local models)."""
        ids, _ = self.encode(content, answer_prefix=answer_prefix)
        return Prompt(input_ids=ids, messages=[*self.history, {"role": "user", "content": content}])


def chat_frame(tokenizer, history: Sequence[dict[str, str]] = ()) -> ChatFrame:
    """The ``ChatFrame`` of the tokenizer's chat template, after the turns of ``history`` (a worked example);
    one line when the template rewrites the user's text."""
    from longalign.chat_template import control_ids

    text = tokenizer.apply_chat_template(
        [*history, {"role": "user", "content": _SLOT}], tokenize=False, add_generation_prompt=True
    )
    if text.count(_SLOT) != 1:
        raise ModelError("the chat template does not write the user's message once, as given")
    before, after = text.split(_SLOT)
    return ChatFrame(tokenizer, before, after, control_ids(tokenizer), tuple(history))


def fit_length(make: Callable[[int], T], tokens: Callable[[T], int], target: int, guess: int) -> T | None:
    """``make(n)`` for the ``n`` whose result is ``target`` tokens long, from ``guess`` on; else the longest
    one under ``target`` that was tried, or None.

    ``n`` counts the tokens of the part that grows (a haystack); encoding the whole text merges a few tokens
    at its edges, so the count is off by a little and each try steps by what is missing::

        fit_length(lambda n: "x" * n, len, 10, 7)  -> 'xxxxxxxxxx'   (tries 7, then 10)
    """
    best, best_tokens = None, -1
    under, over = 0, None  # the largest n found short of target, the smallest found past it
    n, last, scale = guess, None, 1
    for _ in range(_FIT_TRIES):
        n = max(n, 1)
        result = make(n)
        count = tokens(result)
        if count == target:
            return result
        if count < target:
            under = max(under, n)
            if count > best_tokens:
                best, best_tokens = result, count
        else:
            over = n if over is None else min(over, n)
        if over is not None and over - under <= 1:
            break
        scale = 2 * scale if count == last else 1  # whole units (documents) move only after a larger step
        last = count
        n += (target - count) * scale
        if over is not None and not under < n < over:
            n = (under + over) // 2
    return best


_FIT_TRIES = 12  # two tries are the rule; the rest step past a merge that skips the exact count


def text_prompt(text: str) -> Prompt:
    """A one-turn chat for a server, which applies its own template: no tokenizer here, so no token ids.

    text_prompt("Write a poem.") -> Prompt(input_ids=None, messages=[{'role': 'user', 'content': 'Write a poem.'}])
    """
    return Prompt(input_ids=None, messages=[{"role": "user", "content": text}])


def _is_adapter(path: Path) -> bool:
    return (path / "adapter_config.json").is_file()


def default_tokenizer(model: str) -> str:
    """Where ``--model``'s tokenizer is: the directory itself, or an adapter's base when the adapter has none."""
    path = Path(model)
    if _is_adapter(path) and not (path / "tokenizer_config.json").is_file():
        return _adapter_base(path)
    return model


def _adapter_base(adapter_dir: Path) -> str:
    config = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    base = config.get("base_model_name_or_path")
    if not base:
        raise ModelError(f"{adapter_dir}: its adapter_config.json names no base model")
    if Path(base).is_absolute() and not Path(base).is_dir():
        raise PathError(f"{adapter_dir}: its base model {base} is not there (moved?)")
    return base


def load_model(
    name: str,
    *,
    dtype: str = "auto",
    device: torch.device | str = "cpu",
    packed: bool = False,
    attn_backend: str = "auto",
    trust_remote_code: bool = False,
) -> torch.nn.Module:
    """The model at ``name`` in eval mode on ``device``: a run's output or checkpoint, a hub id, or an adapter.

    Checkpoints load as training loads them (``longalign.checkpoints``: a ChatGLM-layout GLM-4 becomes
    ``GlmForCausalLM``; the saved config carries the run's ``config_overrides``). A ``[lora]`` adapter
    directory loads its base (as ``adapter_config.json`` names it, with the overrides the run noted next to
    the adapter) with the adapter merged in. ``packed=True`` patches the model for packed rows
    (``longalign.patch``) for teacher-forced scoring; otherwise it attends with sdpa and its KV cache,
    for generation.
    """
    path = Path(name)
    if (name.startswith((".", "/", "~")) or path.exists()) and not path.is_dir():
        raise PathError(f"{name}: no model directory there")
    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    adapter = path.is_dir() and _is_adapter(path)
    source = _adapter_base(path) if adapter else name
    try:
        config = checkpoints.adapter_base_config(path, source) if adapter else None  # the run's overrides
        model = checkpoints.load_model(
            source,
            config=config,
            dtype=torch_dtype,
            trust_remote_code=trust_remote_code,
            attn_implementation="sdpa",
        )
    except LongAlignError:
        raise
    except (OSError, ValueError) as err:
        message = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ModelError(f"{source}: cannot load a model ({message})") from None
    if adapter:
        model = _merged(model, path, source)
    if packed:
        import longalign.patch

        model = longalign.patch.apply(model, backend=attn_backend)
    else:
        model.config.use_cache = True  # a training run saves its config with the cache off
    return model.to(device).eval()


def _merged(model: torch.nn.Module, adapter_dir: Path, base: str) -> torch.nn.Module:
    """``model`` with the adapter of ``adapter_dir`` folded in; one saved on ChatGLM names is renamed first."""
    import peft

    with tempfile.TemporaryDirectory() as tmp:
        adapter = str(adapter_dir)
        if checkpoints.is_chatglm_adapter(adapter_dir):  # peft loads it onto GlmForCausalLM's names
            for file in ("adapter_model.safetensors", "adapter_config.json"):
                shutil.copyfile(adapter_dir / file, Path(tmp) / file)
            config = checkpoints.find_checkpoint(base).config
            checkpoints.rewrite_adapter(Path(tmp), config, to=NATIVE)
            adapter = tmp
        return peft.PeftModel.from_pretrained(model, adapter).merge_and_unload()


def context_limit(model: torch.nn.Module) -> int | None:
    """The longest sequence the model's positions cover (``max_position_embeddings``), if it says."""
    return getattr(model.config, "max_position_embeddings", None)


def check_fits(lengths: Sequence[int], limit: int | None, *, new_tokens: int | Sequence[int] = 0) -> None:
    """Refuse prompts that, with ``new_tokens`` to generate (one number, or one per prompt), run past the
    model's ``limit``; one line."""
    if limit is None or not lengths:
        return
    budgets = [new_tokens] * len(lengths) if isinstance(new_tokens, int) else list(new_tokens)
    length, budget = max(zip(lengths, budgets, strict=True), key=lambda pair: pair[0] + pair[1])
    if length + budget > limit:
        raise ConfigError(
            f"a prompt of {length} tokens + {budget} new tokens is over the model's limit of {limit} "
            "(max_position_embeddings); use shorter lengths or --max-length"
        )


def length_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices grouped into batches of similar length, longest first (little padding, the peak memory early).

    >>> length_batches([5, 100, 7, 90], 2)
    [[1, 3], [2, 0]]
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


class LocalGenerator:
    """Replies from a transformers model, batched by length with left padding; greedy unless ``temperature > 0``.

    LocalGenerator(model, tokenizer, max_new_tokens=64, batch_size=4).generate(prompts, progress="needle")
    -> [Reply(text='The number is 1234567.'), ...]          # one per prompt, in their order
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        batch_size: int = 1,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.batch_size = batch_size
        self.seed = seed
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else tokenizer.eos_token_id

    def generate(self, prompts: Sequence[Prompt], *, progress: str | None = None) -> list[Reply]:
        """One reply per prompt, in the prompts' order."""
        replies: list[Reply | None] = [None] * len(prompts)
        batches = length_batches([len(p.input_ids) for p in prompts], self.batch_size)
        torch.manual_seed(self.seed)
        with tqdm(total=len(prompts), desc=progress, disable=progress is None) as bar:
            for batch in batches:
                texts = self._generate_batch([prompts[i].input_ids for i in batch])
                for i, text in zip(batch, texts, strict=True):
                    replies[i] = Reply(text)
                bar.update(len(batch))
        return replies

    @torch.inference_mode()
    def _generate_batch(self, rows: list[list[int]]) -> list[str]:
        device = next(self.model.parameters()).device
        width = max(len(row) for row in rows)
        ids = torch.tensor([[self.pad_id] * (width - len(row)) + row for row in rows], device=device)
        mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in rows], device=device)
        sampling = (
            {"do_sample": True, "temperature": self.temperature, "top_p": 1.0, "top_k": None}
            if self.temperature > 0
            else {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        )
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=self.max_new_tokens,
            pad_token_id=self.pad_id,
            eos_token_id=self.tokenizer.eos_token_id,
            use_cache=True,
            **sampling,
        )
        return self.tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)


class ServedGenerator:
    """Replies from an OpenAI-compatible server: ``Prompt.messages`` sent ``concurrency`` at a time
    (``endpoint="chat"``), or ``Prompt.text``, the chat rendered here, as a raw completion request
    (``endpoint="completions"``, ``/v1/completions``: the server adds nothing but its tokenizer's own
    special tokens).

    ``client`` is a ``ChatClient`` or the ``StoredCalls`` over one (answers kept in the output, asked once).
    A request that fails after its retries (a 5xx that lasts, a prompt the server refuses as too long)
    is a ``Reply`` with ``error`` set; the other prompts go on.
    """

    def __init__(
        self,
        client: ChatClient | StoredCalls,
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        seed: int = 0,
        endpoint: str = "chat",
    ) -> None:
        if endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint: expected 'chat' or 'completions', got {endpoint!r}")
        self.client = client
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.seed = seed
        self.endpoint = endpoint

    def generate(self, prompts: Sequence[Prompt], *, progress: str | None = None) -> list[Reply]:
        """One reply per prompt, in the prompts' order."""
        sampling = {"max_tokens": self.max_new_tokens, "temperature": self.temperature, "seed": self.seed}
        if self.endpoint == "completions":
            if any(p.text is None for p in prompts):
                raise ValueError("endpoint 'completions': every prompt needs its rendered text (Prompt.text)")
            requests = [{"prompt": p.text, **sampling} for p in prompts]
        else:
            requests = [{"messages": p.messages, **sampling} for p in prompts]
        return [
            Reply("", error=r.error) if isinstance(r, CallFailure) else Reply(r.text)
            for r in self.client.complete_many(requests, progress=progress)
        ]

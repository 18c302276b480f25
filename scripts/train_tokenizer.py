"""Train the small shipped tokenizer, ``data/tokenizer/``, on the sample chats.

    python scripts/train_tokenizer.py            # reads data/sample.jsonl, writes data/tokenizer/

A byte-level BPE (every string encodes, no unknown tokens) with a 4096-token vocabulary, trained with
the ``tokenizers`` library on the message texts of ``data/sample.jsonl`` and saved in Hugging Face format,
so ``transformers.AutoTokenizer.from_pretrained("data/tokenizer")`` loads it offline as a fast tokenizer.

It is shaped like a Llama 3 Instruct tokenizer, so the pipeline meets the same conventions as with a real
model: the special tokens come last in the vocabulary (ids 4088-4095, none of them 0), bos is
``<|begin_of_text|>`` and is prepended by ``tokenizer(text)``, eos is ``<|eot_id|>`` (the token that ends
an assistant turn), padding uses ``<|finetune_right_pad_id|>``, and the chat template is
``data/chat_templates/llama3.jinja``, which has no ``{% generation %}`` markers, like most official
templates. ``<|im_start|>`` and ``<|im_end|>`` are special tokens too, so that
``data/chat_templates/chatml.jinja`` can be swapped in.

Training is deterministic: the same sample file gives the same ``tokenizer.json``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

VOCAB_SIZE = 4096
BOS = "<|begin_of_text|>"
END_OF_TEXT = "<|end_of_text|>"
EOT = "<|eot_id|>"
PAD = "<|finetune_right_pad_id|>"
# In id order; they take the last ids of the vocabulary.
SPECIAL_TOKENS = (
    BOS,
    END_OF_TEXT,
    "<|start_header_id|>",
    "<|end_header_id|>",
    EOT,
    PAD,
    "<|im_start|>",
    "<|im_end|>",
)
MODEL_MAX_LENGTH = 131072


def message_texts(path: Path) -> Iterator[str]:
    """Every message role and content of a chat JSONL file, in file order.

    The roles are included because chat templates spell them out between special tokens.
    """
    with path.open(encoding="utf-8") as f:
        for line in f:
            for message in json.loads(line)["messages"]:
                yield message["role"]
                yield message["content"]


def train(sample: Path, *, vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """A byte-level BPE of ``vocab_size`` tokens, the last ``len(SPECIAL_TOKENS)`` of them special."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(message_texts(sample), trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(
            f"trained vocabulary has {tokenizer.get_vocab_size()} tokens, expected {vocab_size}: "
            f"{sample} is too small to learn enough merges"
        )
    # Offsets must stay exact (no trimming) so characters map back to tokens for assistant masks.
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A",
                pair=f"{BOS} $A {BOS}:1 $B:1",
                special_tokens=[(BOS, tokenizer.token_to_id(BOS))],
            ),
        ]
    )
    return tokenizer


def save(tokenizer: Tokenizer, output: Path, chat_template: str) -> None:
    """Save ``tokenizer`` in Hugging Face format to ``output``, replacing it only once complete."""
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOT,
        pad_token=PAD,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (BOS, EOT, PAD)],
        chat_template=chat_template,
        model_max_length=MODEL_MAX_LENGTH,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    try:
        hf_tokenizer.save_pretrained(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    staging.chmod(0o755)  # mkdtemp creates the directory private; the tokenizer is meant to be shared
    if output.exists():
        shutil.rmtree(output)
    staging.rename(output)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--input", type=Path, default=Path("data/sample.jsonl"))
    parser.add_argument("--output", type=Path, default=Path("data/tokenizer"))
    parser.add_argument("--chat-template", type=Path, default=Path("data/chat_templates/llama3.jinja"))
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args()

    tokenizer = train(args.input, vocab_size=args.vocab_size)
    save(tokenizer, args.output, args.chat_template.read_text(encoding="utf-8"))
    specials = ", ".join(f"{t}={tokenizer.token_to_id(t)}" for t in SPECIAL_TOKENS)
    print(f"wrote {args.output}: vocabulary {tokenizer.get_vocab_size()}; special tokens {specials}")


if __name__ == "__main__":
    main()

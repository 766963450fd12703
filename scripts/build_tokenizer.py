"""Build the character-level tokenizer shipped with beam-rl (`beam_rl/tasks/tokenizer/`).

Run offline once; the output is committed as package data:
    python scripts/build_tokenizer.py
It writes `tokenizer.json` (HF `tokenizers`, WordLevel over single characters) and
`tokenizer_config.json` (PreTrainedTokenizerFast), which transformers and vLLM load normally.
The vocabulary (85 entries: digits and operators, then letters and punctuation for the math suite)
fits every Beam preset (beam-tiny has 512 ids).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
CHARS = list("0123456789") + ["+", "-", "*", "=", " "]  # the arithmetic task's ids 4-18: never reorder
TEXT_CHARS = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") + list("\n.,?!:;'\"$()/%")
"""The math suite's word problems and worked solutions; appended, so arithmetic checkpoints keep their ids."""
OUT = Path(__file__).resolve().parents[1] / "beam_rl" / "tasks" / "tokenizer"


def build() -> Tokenizer:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS + TEXT_CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()  # join without spaces
    tok.add_special_tokens(SPECIALS)
    return tok


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    tok = build()
    tok.save(str(OUT / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>",
        "add_bos_token": False, "add_eos_token": False, "model_max_length": 2048, "clean_up_tokenization_spaces": False,
    }
    (OUT / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    print(f"wrote {OUT} ({tok.get_vocab_size()} tokens)")


if __name__ == "__main__":
    main()

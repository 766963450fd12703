"""A character-level test tokenizer covering all of beam-tiny's 512 ids (eval / server tests):
specials, printable ASCII and newline, then placeholder tokens `<tN>` so every id decodes."""

from __future__ import annotations

import json
import string
from pathlib import Path

SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]


def write_tokenizer(path, vocab_size: int = 512) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]  # printable ASCII, space, newline
    tokens = SPECIALS + chars
    tokens += [f"<t{i}>" for i in range(len(tokens), vocab_size)]
    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "unk_token": "<unk>", "add_bos_token": False, "add_eos_token": False, "model_max_length": 512,
        "clean_up_tokenization_spaces": False}))
    return path

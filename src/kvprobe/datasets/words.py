"""A small word-level tokenizer for tiny and toy models.

Words, single punctuation characters and newlines are tokens; spaces are dropped, so offsets
map every token back to exact characters of the prompt (spans align exactly). Unknown words
map to ``[UNK]``. The vocabulary is given, usually :func:`kvprobe.datasets.vocabulary`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

# One token: a newline, a word (letters, digits, _ - and inner dots/colons are split off), or one
# punctuation mark. Spaces and tabs are dropped.
TOKEN_PATTERN = r"\n|[A-Za-z0-9_]+|[^\sA-Za-z0-9_]"
SPECIALS = ["[PAD]", "[UNK]", "[BOS]", "[EOS]"]


def words(text: str) -> list[str]:
    """Split text the way the word-level tokenizer does (for building vocabularies)."""
    return re.findall(TOKEN_PATTERN, text)


def build_word_tokenizer(vocab: Iterable[str]) -> PreTrainedTokenizerFast:
    """A fast HF tokenizer over ``vocab`` (specials first, then sorted words; deterministic)."""
    entries = SPECIALS + sorted(set(vocab) - set(SPECIALS))
    table = {tok: i for i, tok in enumerate(entries)}
    backend = Tokenizer(models.WordLevel(vocab=table, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(TOKEN_PATTERN), behavior="removed", invert=True)
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="[PAD]",
        unk_token="[UNK]",
        bos_token="[BOS]",
        eos_token="[EOS]",
    )
    tok.add_bos_token = False
    return tok

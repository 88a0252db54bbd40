"""Helpers for the data tests: a tiny byte-level BPE trained here on real text, saved both as a
tokenizer.json and as GPT-2 style vocab.json + merges.txt (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

EOS = "<|endoftext|>"


def train_bpe(texts: list[str], vocab_size: int = 400):
    """A byte-level BPE (GPT-2's pre-tokenizer and decoder) trained on `texts`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def save_tokenizer_json(texts: list[str], folder: Path, vocab_size: int = 400) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tokenizer.json"
    train_bpe(texts, vocab_size).save(str(path))
    return path


def save_vocab_merges(texts: list[str], folder: Path, vocab_size: int = 400) -> Path:
    """GPT-2's file pair (vocab.json, merges.txt) of a ByteLevelBPETokenizer trained here."""
    from tokenizers import ByteLevelBPETokenizer

    folder.mkdir(parents=True, exist_ok=True)
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab_size, special_tokens=[EOS],
                            show_progress=False)
    bpe.save_model(str(folder))
    return folder


def corpus_texts(corpus: Path) -> list[str]:
    return [p.read_text(errors="replace") for p in sorted(corpus.rglob("*")) if p.is_file()]

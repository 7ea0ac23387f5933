"""A thin wrapper over sentencepiece: load a trained model, encode, decode, the special ids; train one.

Training choices (``train_sentencepiece``), made so the small arithmetic task is learnable and text
survives a round trip exactly (decode(encode(s)) == s for every string without a literal U+2581,
the character sentencepiece itself uses for a space):
  - BPE with ``split_digits``: every digit is its own token, so "123" is 1, 2, 3 and carrying is a
    per-digit pattern the model can learn, instead of a few hundred opaque multi-digit pieces.
  - The ten digits and the whitespace marker are required characters: they are pieces even when
    the corpus lacks one of them.
  - ``byte_fallback``: any character not in the vocabulary is encoded as its UTF-8 bytes (256
    pieces), never as <unk>, so a sampled response always decodes to the text it was.
  - Identity normalization, no dummy prefix and no whitespace collapsing: the tokenizer never
    rewrites text, and encode(a) + encode(b) is how the model sees a prompt followed by its answer.
  - Fixed ids: <pad> 0, <unk> 1, <s> (BOS) 2, </s> (EOS) 3.
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import sentencepiece as spm

from megacispo.data import atomic_write_bytes

MODEL_FILENAME = "tokenizer.model"

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
# The whitespace marker sentencepiece writes in place of " " inside pieces.
WHITESPACE_MARKER = "\u2581"
REQUIRED_CHARS = WHITESPACE_MARKER + "0123456789"


class Tokenizer:
    """A loaded sentencepiece model. Never adds BOS/EOS unless asked to."""

    def __init__(self, processor: spm.SentencePieceProcessor, path: Path):
        self._processor = processor
        self.path = path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load ``path``: a .model file, or a directory holding ``tokenizer.model``."""
        model_path = Path(path)
        if model_path.is_dir():
            model_path = model_path / MODEL_FILENAME
        if not model_path.is_file():
            raise FileNotFoundError(
                f"tokenizer model {str(model_path)!r} does not exist; train one with "
                "`python tools/train_tokenizer.py --input corpus.txt --vocab-size 512 --out DIR` "
                f"and pass DIR/{MODEL_FILENAME}"
            )
        processor = spm.SentencePieceProcessor()
        try:
            processor.Load(str(model_path))
        except (RuntimeError, OSError) as error:
            raise ValueError(
                f"tokenizer model {str(model_path)!r} is not a valid sentencepiece model ({error}); "
                "retrain it with tools/train_tokenizer.py"
            ) from error
        for name, special_id in (("pad", processor.pad_id()), ("bos", processor.bos_id()), ("eos", processor.eos_id())):
            if special_id < 0:
                raise ValueError(
                    f"tokenizer model {str(model_path)!r} defines no {name} token ({name}_id = -1); "
                    "retrain it with tools/train_tokenizer.py, which defines pad, bos and eos"
                )
        return cls(processor, model_path)

    @property
    def vocab_size(self) -> int:
        """Number of pieces; every id is in [0, vocab_size). The model's vocabulary may be larger."""
        return self._processor.get_piece_size()

    @property
    def pad_id(self) -> int:
        return self._processor.pad_id()

    @property
    def unk_id(self) -> int:
        return self._processor.unk_id()

    @property
    def bos_id(self) -> int:
        return self._processor.bos_id()

    @property
    def eos_id(self) -> int:
        return self._processor.eos_id()

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The ids that end a response: EOS."""
        return (self.eos_id,)

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"encode takes a str, got {type(text).__name__}; decode ids with decode()")
        return self._processor.EncodeAsIds(text, add_bos=add_bos, add_eos=add_eos)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``. pad, bos and eos decode to nothing.

        An id outside [0, vocab_size) decodes as <unk> (" \u2047 "): a model whose embedding is
        padded past the tokenizer can sample one, and the text must show it rather than drop it
        (dropping "1<junk>9" to "19" would hand out reward for a malformed response).
        """
        vocab_size = self.vocab_size
        ids = [token_id if 0 <= token_id < vocab_size else self.unk_id for token_id in map(int, ids)]
        return self._processor.DecodeIds(ids)

    def id_to_piece(self, token_id: int) -> str:
        return self._processor.IdToPiece(token_id)


def _corpus_lines(input_paths: Sequence[Path]) -> Iterator[str]:
    for path in input_paths:
        with open(path, encoding="utf-8") as corpus:
            for line in corpus:
                yield line.rstrip("\n")


def _check_corpus(input_paths: Sequence[Path]) -> None:
    if not input_paths:
        raise ValueError("input_paths is empty; pass at least one text file to train the tokenizer on")
    for path in input_paths:
        if not path.is_file():
            raise ValueError(f"tokenizer corpus {str(path)!r} does not exist or is not a file; fix the --input path")
    if not any(line.strip() for line in _corpus_lines(input_paths)):
        raise ValueError(f"tokenizer corpus {[str(p) for p in input_paths]} holds no text; pass a non-empty corpus")


def _train_model_bytes(lines: Iterable[str], vocab_size: int, exact_vocab_size: bool) -> bytes:
    model = io.BytesIO()
    # sentence_iterator + model_writer instead of file paths: sentencepiece stores the input paths
    # and model prefix in the model, so two trainings on the same text would differ in bytes.
    # num_threads is stored too, and one thread trains a small corpus in well under a second.
    spm.SentencePieceTrainer.Train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=vocab_size,
        hard_vocab_limit=exact_vocab_size,
        model_type="bpe",
        split_digits=True,
        byte_fallback=True,
        required_chars=REQUIRED_CHARS,
        character_coverage=1.0,
        normalization_rule_name="identity",
        add_dummy_prefix=False,
        remove_extra_whitespaces=False,
        pad_id=PAD_ID,
        unk_id=UNK_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        num_threads=1,
        minloglevel=2,
    )
    return model.getvalue()


def _training_error(error: RuntimeError, vocab_size: int) -> ValueError:
    """sentencepiece's check failures, restated as what to pass instead."""
    message = str(error)
    too_small = re.search(r"smaller than required_chars\. \d+ vs (\d+)", message)
    if too_small:
        needed = too_small.group(1)
        return ValueError(
            f"vocab_size={vocab_size} is too small: the corpus' characters, the 256 byte-fallback pieces "
            f"and the 4 special tokens need {needed}; pass --vocab-size {needed} or more"
        )
    too_large = re.search(r"Vocabulary size too high.*<= (\d+)", message)
    if too_large:
        limit = too_large.group(1)
        return ValueError(
            f"vocab_size={vocab_size} is larger than this corpus supports (at most {limit} pieces); "
            f"pass --vocab-size {limit} or less, add text to the corpus, or drop --exact-vocab-size "
            "to accept a smaller vocabulary"
        )
    return ValueError(f"sentencepiece training failed with vocab_size={vocab_size}: {message}")


def train_sentencepiece(
    input_paths: Sequence[str | os.PathLike],
    vocab_size: int,
    out_dir: str | os.PathLike,
    exact_vocab_size: bool = False,
) -> Path:
    """Train a BPE model on the text files and write ``out_dir/tokenizer.model``; return its path.

    ``vocab_size`` is an upper bound unless ``exact_vocab_size``: a small corpus (the arithmetic
    task has 13 distinct characters) cannot fill 512 pieces, and the model only needs its embedding
    table to be at least as large as the tokenizer. The output is identical bytes for identical text.
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size} must be positive; pass e.g. --vocab-size 512")
    paths = [Path(path) for path in input_paths]
    _check_corpus(paths)
    try:
        model_bytes = _train_model_bytes(_corpus_lines(paths), vocab_size, exact_vocab_size)
    except RuntimeError as error:
        raise _training_error(error, vocab_size) from error
    out_path = Path(out_dir) / MODEL_FILENAME
    atomic_write_bytes(out_path, model_bytes)
    return out_path

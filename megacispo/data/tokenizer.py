"""The run's tokenizer: a sentencepiece model (trained here) or a Hugging Face tokenizer directory,
behind one interface (``Tokenizer``): encode, decode, the special ids, the ids that end a response,
the chat template, and writing its files next to an exported model.

``Tokenizer.load(path)`` picks the kind: a directory holding tokenizer.json or tokenizer_config.json
(or one of those files) is a Hugging Face tokenizer, loaded offline with transformers; any other path
is a sentencepiece ``.model`` file, or a directory holding ``tokenizer.model``.

Sentencepiece training choices (``train_sentencepiece``), made so the small arithmetic task is learnable and text
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

import abc
import io
import os
import re
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import sentencepiece as spm

from megacispo.files import atomic_save_pretrained, atomic_write_bytes

MODEL_FILENAME = "tokenizer.model"
# Either file marks a directory as a Hugging Face tokenizer.
HF_FILENAMES = ("tokenizer.json", "tokenizer_config.json")
# What an id outside the vocabulary decodes to, for both kinds: sentencepiece's <unk> surface.
UNKNOWN_TEXT = " \u2047 "

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
# The whitespace marker sentencepiece writes in place of " " inside pieces.
WHITESPACE_MARKER = "\u2581"
REQUIRED_CHARS = WHITESPACE_MARKER + "0123456789"


class Tokenizer(abc.ABC):
    """What SFT, rollout and export need of a tokenizer. ``encode`` never adds special tokens."""

    path: Path
    """The file or directory it was loaded from."""

    @staticmethod
    def load(path: str | os.PathLike) -> "Tokenizer":
        """Load ``path``: a Hugging Face tokenizer directory (tokenizer.json / tokenizer_config.json),
        a sentencepiece .model file, or a directory holding ``tokenizer.model``."""
        path = Path(path)
        if path.is_file() and path.name in HF_FILENAMES:
            path = path.parent
        if path.is_dir() and any((path / name).is_file() for name in HF_FILENAMES):
            return HFTokenizer.from_directory(path)
        return SentencePieceTokenizer.from_model_file(path)

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Every id the tokenizer makes is in [0, vocab_size); the model's vocabulary may be larger."""

    @property
    @abc.abstractmethod
    def pad_id(self) -> int: ...

    @property
    @abc.abstractmethod
    def bos_id(self) -> int | None:
        """None for a tokenizer without BOS: its prompts start with their own first token."""

    @property
    @abc.abstractmethod
    def eos_id(self) -> int: ...

    @property
    @abc.abstractmethod
    def stop_ids(self) -> tuple[int, ...]:
        """The ids that end a response; the first is EOS."""

    @property
    @abc.abstractmethod
    def has_chat_template(self) -> bool: ...

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]: ...

    def single_token_id(self, text: str) -> int:
        """The id of ``text``, which must encode to exactly one token."""
        ids = self.encode(text)
        if len(ids) != 1:
            raise ValueError(f"{text!r} encodes to {len(ids)} tokens {ids} with {self.path}, not one")
        return ids[0]

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` without special tokens; an id outside [0, vocab_size) decodes to UNKNOWN_TEXT.

        A model whose embedding is padded past the tokenizer can sample such an id, and the text must
        show it rather than drop it (dropping "1<junk>9" to "19" would hand out reward for a
        malformed response).
        """

    @abc.abstractmethod
    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool,
                            tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """The ids of ``messages`` ({"role", "content"} dicts) rendered by the chat template, with the
        JSON schemas of ``tools`` where the template renders them."""

    @abc.abstractmethod
    def save_files(self, directory: str | os.PathLike) -> list[Path]:
        """Write the files that load this tokenizer again into ``directory`` (each atomically); return them."""


class SentencePieceTokenizer(Tokenizer):
    """A loaded sentencepiece model. Never adds BOS/EOS unless asked to; has no chat template."""

    def __init__(self, processor: spm.SentencePieceProcessor, path: Path):
        self._processor = processor
        self.path = path

    @classmethod
    def from_model_file(cls, path: str | os.PathLike) -> "SentencePieceTokenizer":
        """Load ``path``: a .model file, or a directory holding ``tokenizer.model``."""
        model_path = Path(path)
        if model_path.is_dir():
            model_path = model_path / MODEL_FILENAME
        if not model_path.is_file():
            hf_hint = f" (nor is {str(path)!r} a Hugging Face tokenizer directory with tokenizer.json)" \
                if Path(path).is_dir() else ""
            raise FileNotFoundError(
                f"tokenizer model {str(model_path)!r} does not exist{hf_hint}; train one with "
                "`python tools/train_tokenizer.py --input corpus.txt --vocab-size 512 --out DIR` "
                f"and pass DIR/{MODEL_FILENAME}, or pass a Hugging Face tokenizer directory"
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

    @property
    def has_chat_template(self) -> bool:
        return False

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"encode takes a str, got {type(text).__name__}; decode ids with decode()")
        return self._processor.EncodeAsIds(text, add_bos=add_bos, add_eos=add_eos)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``. pad, bos and eos decode to nothing; an id outside [0, vocab_size) decodes
        as <unk> (" \u2047 ", UNKNOWN_TEXT)."""
        vocab_size = self.vocab_size
        ids = [token_id if 0 <= token_id < vocab_size else self.unk_id for token_id in map(int, ids)]
        return self._processor.DecodeIds(ids)

    def id_to_piece(self, token_id: int) -> str:
        return self._processor.IdToPiece(token_id)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool,
                            tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        raise ValueError(
            f"the sentencepiece tokenizer {str(self.path)!r} has no chat template; set data.chat_template: false, "
            "or set data.tokenizer to a Hugging Face tokenizer directory whose tokenizer_config.json defines one"
        )

    def save_files(self, directory: str | os.PathLike) -> list[Path]:
        """Copy the model to ``directory/tokenizer.model``."""
        out_path = Path(directory) / MODEL_FILENAME
        atomic_write_bytes(out_path, self.path.read_bytes())
        return [out_path]


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer directory, loaded offline with ``transformers.AutoTokenizer``.

    - ``vocab_size`` is ``len(tokenizer)``: the base vocabulary and the added tokens.
    - ``pad_id`` is EOS when the tokenizer defines no pad token (see ``pad_id``).
    - ``stop_ids`` are EOS and, with a chat template, the template's end-of-turn token (see
      ``end_of_turn_id``).
    """

    def __init__(self, hf_tokenizer: Any, path: Path):
        self._hf = hf_tokenizer
        self.path = path
        # Fixed at load: len() of a transformers tokenizer counts the added tokens again on each call.
        self._vocab_size = len(hf_tokenizer)
        self._special_ids = frozenset(hf_tokenizer.all_special_ids) | {
            token_id for token_id, token in hf_tokenizer.added_tokens_decoder.items() if token.special
        }
        end_of_turn = self.end_of_turn_id()
        self._stop_ids = (self.eos_id,) + ((end_of_turn,) if end_of_turn not in (None, self.eos_id) else ())

    @classmethod
    def from_directory(cls, directory: Path) -> "HFTokenizer":
        from transformers import AutoTokenizer

        try:
            hf_tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        # transformers and tokenizers raise JSON, key, value and OS errors (and more) for a damaged
        # directory; each means the same to the user: these files do not make a tokenizer.
        except Exception as error:
            raise ValueError(
                f"Hugging Face tokenizer directory {str(directory)!r} does not load "
                f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); save it again with "
                "tokenizer.save_pretrained(DIR), or pass a sentencepiece tokenizer.model"
            ) from error
        if hf_tokenizer.eos_token_id is None:
            raise ValueError(
                f"Hugging Face tokenizer {str(directory)!r} defines no eos_token; set \"eos_token\" in its "
                "tokenizer_config.json to the token that ends a response"
            )
        return cls(hf_tokenizer, directory)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def pad_id(self) -> int:
        # Many chat tokenizers define no pad token. Padding is masked out of attention and loss, so
        # any id in the vocabulary serves; EOS always is one, and adding a token would grow the
        # vocabulary past the model's embedding.
        pad = self._hf.pad_token_id
        return self.eos_id if pad is None else pad

    @property
    def bos_id(self) -> int | None:
        return self._hf.bos_token_id

    @property
    def eos_id(self) -> int:
        return self._hf.eos_token_id

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return self._stop_ids

    @property
    def has_chat_template(self) -> bool:
        return bool(self._hf.chat_template)

    def end_of_turn_id(self) -> int | None:
        """The special token that closes an assistant turn in the chat template, None without a template.

        Rule: render a probe conversation (a user message, then an assistant message "1") with and
        without the generation prompt; the end of turn is the first special token after the prompt's
        ids (after the assistant's text), e.g. <|im_end|> for ChatML, <|eot_id|> for Llama 3, or EOS
        for templates that end a turn with it. A template that closes turns with plain text, or whose
        full conversation does not start with the rendered prompt, has none: EOS alone stops.
        """
        if not self.has_chat_template:
            return None
        probe = [{"role": "user", "content": "1"}]
        prompt_ids = self.apply_chat_template(probe, add_generation_prompt=True)
        answered = probe + [{"role": "assistant", "content": "1"}]
        full_ids = self.apply_chat_template(answered, add_generation_prompt=False)
        if full_ids[: len(prompt_ids)] != prompt_ids:
            return None
        return next((token_id for token_id in full_ids[len(prompt_ids):] if token_id in self._special_ids), None)

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"encode takes a str, got {type(text).__name__}; decode ids with decode()")
        return self._hf.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` without special tokens; each id outside [0, vocab_size) shows as UNKNOWN_TEXT."""
        pieces, run = [], []
        for token_id in map(int, ids):
            if 0 <= token_id < self._vocab_size:
                run.append(token_id)
            else:
                pieces += [self._hf.decode(run, skip_special_tokens=True), UNKNOWN_TEXT]
                run = []
        pieces.append(self._hf.decode(run, skip_special_tokens=True))
        return "".join(pieces)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool,
                            tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        from jinja2 import TemplateError

        if not self.has_chat_template:
            raise ValueError(
                f"Hugging Face tokenizer {str(self.path)!r} has no chat template; set data.chat_template: false, "
                "or add a \"chat_template\" to its tokenizer_config.json"
            )
        try:
            ids = self._hf.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                               tools=None if tools is None else list(tools), tokenize=True,
                                               return_dict=False)
        except TemplateError as error:
            raise ValueError(f"the chat template of {str(self.path)!r} fails on these messages: {error}") from error
        return [int(token_id) for token_id in ids]

    def save_files(self, directory: str | os.PathLike) -> list[Path]:
        """``save_pretrained`` into ``directory``: tokenizer.json, tokenizer_config.json and the chat template."""
        return atomic_save_pretrained(self._hf, directory)


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


def _train_model_bytes(lines: Iterable[str], vocab_size: int, exact_vocab_size: bool, symbols: Sequence[str]) -> bytes:
    model = io.BytesIO()
    # sentence_iterator + model_writer instead of file paths: sentencepiece stores the input paths
    # and model prefix in the model, so two trainings on the same text would differ in bytes.
    # num_threads is stored too, and one thread trains a small corpus in well under a second.
    spm.SentencePieceTrainer.Train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=vocab_size,
        hard_vocab_limit=exact_vocab_size,
        user_defined_symbols=list(symbols),
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
    symbols: Sequence[str] = (),
) -> Path:
    """Train a BPE model on the text files and write ``out_dir/tokenizer.model``; return its path.

    ``vocab_size`` is an upper bound unless ``exact_vocab_size``: a small corpus (the arithmetic
    task has 13 distinct characters) cannot fill 512 pieces, and the model only needs its embedding
    table to be at least as large as the tokenizer. The output is identical bytes for identical text.
    ``symbols``: texts that are always one token each (a tool call's tags, env.stop_tokens).
    """
    if vocab_size < 1:
        raise ValueError(f"vocab_size={vocab_size} must be positive; pass e.g. --vocab-size 512")
    paths = [Path(path) for path in input_paths]
    _check_corpus(paths)
    try:
        model_bytes = _train_model_bytes(_corpus_lines(paths), vocab_size, exact_vocab_size, symbols)
    except RuntimeError as error:
        raise _training_error(error, vocab_size) from error
    out_path = Path(out_dir) / MODEL_FILENAME
    atomic_write_bytes(out_path, model_bytes)
    return out_path

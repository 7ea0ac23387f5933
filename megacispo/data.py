"""Prompt data: JSONL loading with line-accurate errors, SFT examples, and a resumable prompt sampler.

One format serves RL prompts and SFT pairs: one JSON object per line,

    {"prompt": "12+7=", "answer": "19", ...}

Fields other than prompt and answer are kept in ``PromptRecord.extra`` and reach the reward
function. Every line is checked when the file is loaded, before any work starts.

Token layout shared by SFT and rollout (``encode_prompt``, ``build_sft_example``):

    prompt ids   = [BOS] + encode(prompt)
    response ids = encode(answer) + [EOS]        (the SFT target; rollout samples its own)

Loaded with a ``PromptLimit``, each prompt is tokenized once, as its line is read, and a record that
would make more tokens than the limit raises, is skipped or loses the start of its prompt
(``data.overlong_prompts``): a prompt longer than the model's context would otherwise grow the
rollout's memory without bound.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence

import torch

REQUIRED_FIELDS = ("prompt", "answer")
OVERLONG_PROMPTS = ("error", "skip", "truncate_left")


@dataclass(frozen=True)
class PromptRecord:
    """One prompt with its reference answer; ``extra`` holds the line's other fields."""

    prompt: str
    answer: str
    extra: dict[str, Any] = field(default_factory=dict)
    prompt_ids: tuple[int, ...] = field(default=(), repr=False)
    """[BOS] + the prompt's tokens as a PromptLimit left them; empty for a record loaded without one."""

    def to_json(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "answer": self.answer, **self.extra}


def _parse_line(text: str, path: Path, line_number: int) -> PromptRecord:
    where = f"{path}:{line_number}"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{where}: invalid JSON ({error.msg} at column {error.colno}); each line must be one JSON object "
            'like {"prompt": "12+7=", "answer": "19"}'
        ) from error
    if not isinstance(value, dict):
        raise ValueError(
            f"{where}: expected a JSON object, got {type(value).__name__}; "
            'write each record as {"prompt": ..., "answer": ...}'
        )
    for name in REQUIRED_FIELDS:
        if name not in value:
            raise ValueError(f"{where}: missing field {name!r}; every record needs string fields 'prompt' and 'answer'")
        if not isinstance(value[name], str):
            raise ValueError(
                f"{where}: field {name!r} must be a string, got {type(value[name]).__name__} {value[name]!r}; "
                f"quote it, e.g. {json.dumps(str(value[name]))}"
            )
    extra = {key: item for key, item in value.items() if key not in REQUIRED_FIELDS}
    return PromptRecord(prompt=value["prompt"], answer=value["answer"], extra=extra)


@dataclass
class PromptLimit:
    """Tokenizes each record's prompt once and holds the tokens the record makes to ``max_tokens``."""

    tokenizer: TokenizerLike
    max_tokens: int
    """The most tokens a record may make: [BOS] + prompt (+ answer + EOS with ``with_answer``)."""
    bound: str
    """The limit as an error names it, e.g. "data.max_prompt_tokens = 4080"."""
    overlong: str = "error"
    """data.overlong_prompts: error, skip, or truncate_left (drop prompt tokens after BOS until it fits)."""
    with_answer: bool = False
    """Count the answer and EOS too: an SFT pair must fit whole."""
    num_skipped: int = 0
    """Records dropped so far by overlong = skip."""
    num_truncated: int = 0
    """Records shortened so far by overlong = truncate_left."""

    def fit(self, record: PromptRecord, where: str) -> PromptRecord | None:
        """``record`` with its prompt ids, None when it is skipped; raises when it cannot be made to fit."""
        prompt_ids = encode_prompt(self.tokenizer, record.prompt)
        num_answer_tokens = len(self.tokenizer.encode(record.answer)) + 1 if self.with_answer else 0
        excess = len(prompt_ids) + num_answer_tokens - self.max_tokens
        if excess > 0 and self.overlong == "skip":
            self.num_skipped += 1
            return None
        if excess > 0 and self.overlong == "truncate_left" and excess < len(prompt_ids):
            self.num_truncated += 1
            prompt_ids = prompt_ids[:1] + prompt_ids[1 + excess:]
        elif excess > 0:
            raise ValueError(self._overlong_error(where, excess + self.max_tokens, num_answer_tokens))
        return replace(record, prompt_ids=tuple(prompt_ids))

    def _overlong_error(self, where: str, num_tokens: int, num_answer_tokens: int) -> str:
        what = "pair ([BOS] + prompt + answer + EOS)" if self.with_answer else "prompt ([BOS] + prompt)"
        if self.overlong == "truncate_left":
            return (f"{where}: the {what} is {num_tokens} tokens, more than {self.bound}, and its answer alone "
                    f"({num_answer_tokens} tokens with EOS) leaves no room for the prompt; shorten the answer or "
                    "set data.overlong_prompts to skip")
        return (f"{where}: the {what} is {num_tokens} tokens, more than {self.bound}; shorten it, or set "
                "data.overlong_prompts to skip or truncate_left")


def load_prompts(path: str | os.PathLike, limit: PromptLimit | None = None) -> list[PromptRecord]:
    """Read a prompts JSONL file (RL prompts, or SFT pairs: the target of each is its answer and EOS).
    Blank lines are skipped; any bad line raises ValueError (path:line). With ``limit``, each record
    is tokenized and fitted to it as its line is read."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompt file {str(path)!r} does not exist or is not a file; fix the path")
    records = []
    with open(path, "rb") as lines:
        for line_number, raw_line in enumerate(lines, start=1):
            try:
                text = raw_line.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"{path}:{line_number}: not UTF-8 ({error.reason}); save the file as UTF-8") from error
            if not text.strip():
                continue
            record = _parse_line(text, path, line_number)
            if limit is not None:
                record = limit.fit(record, f"{path}:{line_number}")
            if record is not None:
                records.append(record)
    if not records and limit is not None and limit.num_skipped:
        raise ValueError(
            f"{path}: all {limit.num_skipped} records are longer than {limit.bound} and data.overlong_prompts = "
            "skip left none; shorten them, or set data.overlong_prompts to truncate_left"
        )
    if not records:
        raise ValueError(
            f"{path}: no records (the file is empty or blank); "
            'write one JSON object per line like {"prompt": "12+7=", "answer": "19"}'
        )
    return records


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write to a temporary file beside ``path``, then rename: readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp_name = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    # os.open with 0o666 applies the umask, as open() would (mkstemp would leave the file 0600).
    file_descriptor = os.open(temp_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(file_descriptor, "wb") as temp_file:
            temp_file.write(data)
            temp_file.flush()
            os.fsync(temp_file.fileno())
        os.replace(temp_name, path)
    except BaseException:
        os.unlink(temp_name)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def format_jsonl(records: Sequence[PromptRecord]) -> str:
    return "".join(json.dumps(record.to_json(), ensure_ascii=False) + "\n" for record in records)


# ---------------------------------------------------------------------------------------------
# Tokens: prompts and SFT examples
# ---------------------------------------------------------------------------------------------


class TokenizerLike(Protocol):
    bos_id: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...


def encode_prompt(tokenizer: TokenizerLike, prompt: str) -> list[int]:
    """The ids the policy is conditioned on: BOS, then the prompt. SFT and rollout both use this."""
    return [tokenizer.bos_id] + tokenizer.encode(prompt)


def prompt_token_ids(tokenizer: TokenizerLike, record: PromptRecord) -> list[int]:
    """The prompt ids of ``record``: those its PromptLimit stored, or [BOS] + prompt for a record made in code."""
    return list(record.prompt_ids) or encode_prompt(tokenizer, record.prompt)


@dataclass(frozen=True)
class SFTExample:
    """One prompt + target sequence for next-token prediction."""

    token_ids: list[int]
    """[BOS] + prompt + answer + [EOS]."""
    num_prompt_tokens: int
    """Length of the [BOS] + prompt prefix; the loss covers the tokens after it."""


def build_sft_example(tokenizer: TokenizerLike, record: PromptRecord, max_length: int | None = None) -> SFTExample:
    """Tokenize ``record``; a sequence longer than ``max_length`` raises instead of being truncated."""
    prompt_ids = prompt_token_ids(tokenizer, record)
    token_ids = prompt_ids + tokenizer.encode(record.answer) + [tokenizer.eos_id]
    if max_length is not None and len(token_ids) > max_length:
        raise ValueError(
            f"SFT example {record.prompt!r} -> {record.answer!r} is {len(token_ids)} tokens, more than "
            f"max_length={max_length}; raise the sequence length or drop long examples"
        )
    return SFTExample(token_ids=token_ids, num_prompt_tokens=len(prompt_ids))


@dataclass(frozen=True)
class SFTBatch:
    """Right-padded next-token batch; all tensors are [batch, max_len - 1] (labels shifted by one)."""

    input_ids: torch.Tensor
    """int64: tokens 0 .. T-2 of each sequence, pad_id after its end."""
    labels: torch.Tensor
    """int64: tokens 1 .. T-1, the next token at each position; pad_id after the end."""
    loss_mask: torch.Tensor
    """float32: 1 where the label is an answer token or the EOS, 0 on prompt labels and padding."""
    padding_mask: torch.Tensor
    """bool: True where input_ids holds padding."""

    def to(self, device: torch.device) -> SFTBatch:
        return SFTBatch(*(getattr(self, name).to(device) for name in self.__dataclass_fields__))


def collate_sft(examples: Sequence[SFTExample], pad_id: int) -> SFTBatch:
    if not examples:
        raise ValueError("collate_sft got no examples; pass at least one SFTExample")
    max_len = max(len(example.token_ids) for example in examples)
    # Filled row by row on the host; the whole batch moves to the run's device once (SFTBatch.to).
    tokens = torch.full((len(examples), max_len), pad_id, dtype=torch.int64, device="cpu")
    # Mask over positions of ``tokens``: 1 on the answer and EOS; shifted with the labels below.
    target_mask = torch.zeros((len(examples), max_len), dtype=torch.float32, device="cpu")
    for row, example in enumerate(examples):
        length = len(example.token_ids)
        tokens[row, :length] = torch.tensor(example.token_ids, dtype=torch.int64, device="cpu")
        target_mask[row, example.num_prompt_tokens : length] = 1.0
    lengths = torch.tensor([len(example.token_ids) for example in examples], device="cpu")
    return SFTBatch(
        input_ids=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=target_mask[:, 1:],
        padding_mask=right_padding_mask(lengths, max_len - 1),
    )


def right_padding_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[n, width] bool, True at the padding of sequences of ``lengths`` [n] right-padded to ``width``
    (the model's ``padding_mask``)."""
    return torch.arange(width, device=lengths.device) >= lengths[:, None]


# ---------------------------------------------------------------------------------------------
# Resumable sampler
# ---------------------------------------------------------------------------------------------


def _records_fingerprint(records: Sequence[PromptRecord]) -> str:
    digest = hashlib.sha256()
    for record in records:
        digest.update(json.dumps([record.prompt, record.answer], ensure_ascii=False).encode("utf-8"))
    return digest.hexdigest()[:16]


class PromptSampler:
    """Batches of prompts, epoch after epoch, each epoch a permutation fixed by (seed, epoch).

    Each epoch visits every record exactly once; a batch that reaches the end of an epoch is
    completed from the next one. ``state_dict`` is the position (epoch, index into that epoch's
    permutation), so a resumed run draws exactly the batches the uninterrupted run would have,
    whatever batch sizes were asked for (dynamic sampling asks for varying numbers of prompts).
    """

    def __init__(self, records: Sequence[PromptRecord], seed: int):
        if not records:
            raise ValueError("PromptSampler got no records; load a non-empty prompt file")
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed={seed!r} must be a non-negative integer")
        self._records = list(records)
        self._seed = seed
        self._fingerprint = _records_fingerprint(self._records)
        self._epoch = 0
        self._position = 0
        self._order = self._epoch_order(0)

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def position(self) -> int:
        return self._position

    def _epoch_order(self, epoch: int) -> list[int]:
        # A string seed goes through SHA-512 in random.Random: the stream is stable across Python
        # versions, and (seed, epoch) pairs never collide the way seed + epoch would.
        order = list(range(len(self._records)))
        random.Random(f"megacispo.PromptSampler:{self._seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self, batch_size: int) -> list[PromptRecord]:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        batch = []
        while len(batch) < batch_size:
            if self._position == len(self._order):
                self._epoch += 1
                self._position = 0
                self._order = self._epoch_order(self._epoch)
            take = min(batch_size - len(batch), len(self._order) - self._position)
            batch.extend(self._records[i] for i in self._order[self._position : self._position + take])
            self._position += take
        return batch

    def batches(self, batch_size: int) -> Iterator[list[PromptRecord]]:
        """An endless stream of ``next_batch(batch_size)``."""
        while True:
            yield self.next_batch(batch_size)

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self._seed,
            "epoch": self._epoch,
            "position": self._position,
            "num_records": len(self._records),
            "fingerprint": self._fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; it must come from a sampler over the same records and seed."""
        expected = {"seed": self._seed, "num_records": len(self._records), "fingerprint": self._fingerprint}
        for key, value in expected.items():
            if state.get(key) != value:
                raise ValueError(
                    f"sampler state has {key}={state.get(key)!r} but this sampler has {key}={value!r}; "
                    "resume with the prompt file and seed the checkpoint was trained with"
                )
        epoch, position = state.get("epoch"), state.get("position")
        valid_epoch = isinstance(epoch, int) and epoch >= 0
        if not (valid_epoch and isinstance(position, int) and 0 <= position <= len(self._records)):
            raise ValueError(
                f"sampler state has epoch={epoch!r}, position={position!r}; expected epoch >= 0 and "
                f"0 <= position <= {len(self._records)}: the checkpoint is corrupt"
            )
        self._epoch = epoch
        self._position = position
        self._order = self._epoch_order(epoch)

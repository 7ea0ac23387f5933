"""Prompt data: JSONL and Parquet loading with row-accurate errors, SFT examples, and a resumable
prompt sampler.

One layout serves RL prompts and SFT pairs: one record per JSONL line or Parquet row,

    {"prompt": "12+7=", "answer": "19", ...}

``data.prompt_key`` and ``data.answer_key`` name the two fields, with dots for nested ones (verl's
Parquet sets keep the answer in ``reward_model.ground_truth``). The prompt is a string, or, with
``data.chat_template``, a list of {"role", "content"} messages; the answer is a string (a number is
taken as its text). The other top-level fields are kept in ``PromptRecord.extra`` and reach the
reward function; a field ``env`` is refused (a record cannot choose its environment: env.name does).
Every record is checked when the file is loaded, before any work starts.

Token layout shared by SFT and rollout (``encode_prompt``, ``encode_target``, ``build_sft_example``):

    without the chat template:
        prompt ids   = [BOS] + encode(prompt)            (no BOS when the tokenizer has none)
        target ids   = encode(answer) + [EOS]
    with data.chat_template (a string prompt is one user message):
        prompt ids   = template(messages, add_generation_prompt=True)
        target ids   = what template(messages + [assistant answer]) adds after the prompt ids,
                       through its first stop id (the end-of-turn token)

The target is the SFT loss's; rollout samples its own response after the prompt ids.

Loaded with a ``PromptLimit``, each prompt is tokenized once, as its record is read, and a record that
would make more tokens than the limit raises, is skipped or loses the start of its prompt
(``data.overlong_prompts``): a prompt longer than the model's context would otherwise grow the
rollout's memory without bound.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence, Union

import torch

from megacispo.data.padding import right_padding_mask

DATA_SUFFIXES = (".jsonl", ".parquet")
PARQUET_BATCH_ROWS = 1024
"""Rows per record batch read from a Parquet file: memory holds one batch, never the whole table."""

Messages = list[dict[str, str]]
TURNS_FIELD = "turns"
"""An SFT record's multi-turn demonstration: the messages after its prompt, the model's as "assistant"."""
ENV_FIELD = "env"
"""Refused in a record: it reads as choosing the record's environment, which a record cannot (env.name
serves every sample of a run), and ignored it would train the samples against another environment."""
Prompt = Union[str, Messages]


@dataclass(frozen=True)
class PromptRecord:
    """One prompt with its reference answer; ``extra`` holds the record's other top-level fields."""

    prompt: Prompt
    """A string, or a list of {"role", "content"} chat messages (data.chat_template only)."""
    answer: str
    extra: dict[str, Any] = field(default_factory=dict)
    prompt_ids: tuple[int, ...] = field(default=(), repr=False)
    """The prompt's ids (see the module docstring) as a PromptLimit left them; empty for a record
    loaded without one."""
    target_ids: tuple[int, ...] = field(default=(), repr=False)
    """The SFT target's ids, stored by a PromptLimit that counts the answer; empty otherwise."""
    target_mask: tuple[bool, ...] = field(default=(), repr=False)
    """A multi-turn target's (the "turns" field's): True at the ids the model writes, False at the
    replies between its turns; empty: the model writes every target id."""

    def to_json(self) -> dict[str, Any]:
        return {"prompt": self.prompt, "answer": self.answer, **self.extra}


@dataclass(frozen=True)
class RecordFields:
    """Where a record's prompt and answer are, and whether a prompt may be a list of chat messages."""

    prompt_key: str = "prompt"
    answer_key: str = "answer"
    chat_template: bool = False

    def __post_init__(self) -> None:
        for name in ("prompt_key", "answer_key"):
            key = getattr(self, name)
            if not isinstance(key, str) or not all(key.split(".")):
                raise ValueError(
                    f"data.{name} = {key!r} is not a field name; name a top-level field (e.g. 'prompt'), "
                    "with dots for a nested one (e.g. 'reward_model.ground_truth')"
                )

    def fix(self) -> str:
        """The usual fix for a missing field, as an error states it."""
        if (self.prompt_key, self.answer_key) == ("prompt", "answer"):
            return "every record needs string fields 'prompt' and 'answer'"
        return (f"every record needs a prompt at data.prompt_key = {self.prompt_key!r} and an answer at "
                f"data.answer_key = {self.answer_key!r}; set the keys to the fields the file uses")


def _field(row: Mapping[str, Any], key: str, where: str, fields: RecordFields) -> Any:
    """The value at the dotted ``key`` of ``row``."""
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            raise ValueError(f"{where}: missing field {key!r}; {fields.fix()}")
        value = value[part]
    return value


def _check_messages(messages: list[Any], where: str, key: str) -> Messages:
    if not messages:
        raise ValueError(f"{where}: field {key!r} is an empty list of messages; give at least one user message")
    for index, message in enumerate(messages):
        valid = isinstance(message, Mapping) and all(isinstance(message.get(name), str) for name in ("role", "content"))
        if not valid:
            raise ValueError(
                f"{where}: field {key!r}, message {index}: expected {{\"role\": str, \"content\": str}}, got "
                f"{message!r}; write each message as {{\"role\": \"user\", \"content\": \"...\"}}"
            )
    return [dict(message) for message in messages]


def _prompt(value: Any, where: str, fields: RecordFields) -> Prompt:
    key = fields.prompt_key
    if isinstance(value, str):
        return value
    if isinstance(value, list) and not fields.chat_template:
        raise ValueError(
            f"{where}: field {key!r} is a list of chat messages, which only data.chat_template: true renders; "
            "set it (with a tokenizer that has a chat template), or make each prompt a string"
        )
    if isinstance(value, list):
        return _check_messages(value, where, key)
    expected = "a string or a list of {\"role\", \"content\"} messages" if fields.chat_template else "a string"
    raise ValueError(
        f"{where}: field {key!r} must be {expected}, got {type(value).__name__} {value!r}; "
        f"quote it, e.g. {json.dumps(str(value))}"
    )


def _answer(value: Any, where: str, key: str) -> str:
    # Math sets often store integer answers; their text is the answer. A bool is a mistake, not 1 or 0.
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, str):
        raise ValueError(
            f"{where}: field {key!r} must be a string (or a number), got {type(value).__name__} {value!r}; "
            f"quote it, e.g. {json.dumps(str(value))}"
        )
    return value


def _parse_row(row: Mapping[str, Any], where: str, fields: RecordFields) -> PromptRecord:
    if ENV_FIELD in row:
        raise ValueError(
            f"{where}: field {ENV_FIELD!r} = {row[ENV_FIELD]!r:.80}: a record cannot choose its environment, env.name "
            "chooses the one every sample of the run talks to (a built-in name or module:Class, megacispo.envs); "
            "drop the field, or rename it if your reward reads it"
        )
    prompt = _prompt(_field(row, fields.prompt_key, where, fields), where, fields)
    answer = _answer(_field(row, fields.answer_key, where, fields), where, fields.answer_key)
    # A nested key leaves its top-level field in extra: reward_model also holds the reward's style.
    extra = {key: item for key, item in row.items() if key not in (fields.prompt_key, fields.answer_key)}
    return PromptRecord(prompt=prompt, answer=answer, extra=extra)


def _jsonl_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(path:line, object) for each non-blank line."""
    with open(path, "rb") as lines:
        for line_number, raw_line in enumerate(lines, start=1):
            where = f"{path}:{line_number}"
            try:
                text = raw_line.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(f"{where}: not UTF-8 ({error.reason}); save the file as UTF-8") from error
            if not text.strip():
                continue
            try:
                value = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{where}: invalid JSON ({error.msg} at column {error.colno}); each line must be one JSON "
                    'object like {"prompt": "12+7=", "answer": "19"}'
                ) from error
            if not isinstance(value, dict):
                raise ValueError(
                    f"{where}: expected a JSON object, got {type(value).__name__}; "
                    'write each record as {"prompt": ..., "answer": ...}'
                )
            yield where, value


def _parquet_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """("path: row N (0-based)", row) for each row, read one record batch at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    index = 0
    try:
        parquet_file = pq.ParquetFile(path)
        for batch in parquet_file.iter_batches(batch_size=PARQUET_BATCH_ROWS):
            # to_pylist gives plain Python: structs as dicts, lists as lists, no numpy arrays.
            for row in batch.to_pylist():
                yield f"{path}: row {index} (0-based)", row
                index += 1
    except (pa.ArrowException, OSError) as error:
        at_row = f" at row {index} (0-based)" if index else ""
        raise ValueError(
            f"{path}: not a readable Parquet file{at_row} ({error}); write it with "
            "pyarrow.parquet.write_table or pandas.DataFrame.to_parquet, or convert it to .jsonl"
        ) from error


def _rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    if not path.is_file():
        raise ValueError(f"prompt file {str(path)!r} does not exist or is not a file; fix the path")
    suffix = path.suffix.lower()
    if suffix not in DATA_SUFFIXES:
        raise ValueError(
            f"prompt file {str(path)!r} has the suffix {path.suffix!r}; use .jsonl (one JSON object per line) "
            "or .parquet"
        )
    return _parquet_rows(path) if suffix == ".parquet" else _jsonl_rows(path)


@dataclass
class PromptLimit:
    """Tokenizes each record's prompt once and holds the tokens the record makes to ``max_tokens``."""

    tokenizer: TokenizerLike
    max_tokens: int
    """The most tokens a record may make: the prompt ids (+ the target ids with ``with_answer``)."""
    bound: str
    """The limit as an error names it, e.g. "data.max_prompt_tokens = 4080"."""
    overlong: str = "error"
    """data.overlong_prompts: error, skip, or truncate_left (drop prompt tokens after BOS until it fits)."""
    with_answer: bool = False
    """Count (and store) the SFT target too: an SFT pair must fit whole."""
    num_skipped: int = 0
    """Records dropped so far by overlong = skip."""
    num_truncated: int = 0
    """Records shortened so far by overlong = truncate_left."""
    render_turns: Callable[[Messages], tuple[list[int], list[bool]]] | None = None
    """Renders an SFT record's "turns" (a multi-turn demonstration: ReplyRenderer.turn_ids); None: no record has them."""

    def fit(self, record: PromptRecord, where: str, chat_template: bool = False) -> PromptRecord | None:
        """``record`` with its prompt ids (and target ids), None when it is skipped; raises when it
        cannot be made to fit."""
        target_mask: list[bool] = []
        try:
            prompt_ids = encode_prompt(self.tokenizer, record.prompt, chat_template)
            if self.with_answer and TURNS_FIELD in record.extra:
                target_ids, target_mask = self._turns(record.extra[TURNS_FIELD])
            else:
                target_ids = encode_target(self.tokenizer, record, chat_template) if self.with_answer else []
        except ValueError as error:
            raise ValueError(f"{where}: {error}") from None
        excess = len(prompt_ids) + len(target_ids) - self.max_tokens
        if excess > 0 and self.overlong == "skip":
            self.num_skipped += 1
            return None
        if excess > 0 and self.overlong == "truncate_left" and excess < len(prompt_ids):
            self.num_truncated += 1
            kept = 1 if prompt_ids[0] == self.tokenizer.bos_id else 0  # the BOS stays first
            prompt_ids = prompt_ids[:kept] + prompt_ids[kept + excess:]
        elif excess > 0:
            raise ValueError(self._overlong_error(where, excess + self.max_tokens, len(target_ids), chat_template))
        return replace(record, prompt_ids=tuple(prompt_ids), target_ids=tuple(target_ids), target_mask=tuple(target_mask))

    def _turns(self, turns: Any) -> tuple[list[int], list[bool]]:
        if self.render_turns is None:
            raise ValueError(f"field {TURNS_FIELD!r} (a multi-turn demonstration) needs env.name set, whose "
                             "replies it renders; set env.name or drop the field")
        if not isinstance(turns, list) or not turns:
            raise ValueError(f"field {TURNS_FIELD!r} must be a non-empty list of {{\"role\", \"content\"}} messages")
        messages = _check_messages(turns, "the record", TURNS_FIELD)
        roles = {message["role"] for message in messages} - {"assistant", "tool", "user", "system"}
        if roles or messages[-1]["role"] != "assistant":
            raise ValueError(f"field {TURNS_FIELD!r}: roles are assistant, tool, user or system, and the last turn is "
                             f"the model's (assistant); got roles {[m['role'] for m in messages]}")
        return self.render_turns(messages)

    def _overlong_error(self, where: str, num_tokens: int, num_answer_tokens: int, chat_template: bool) -> str:
        if chat_template:
            what = ("pair (prompt and answer in the chat template)" if self.with_answer
                    else "prompt (in the chat template, with the generation prompt)")
            answer_end = "its end-of-turn token"
        else:
            bos = "" if self.tokenizer.bos_id is None else "[BOS] + "
            what = f"pair ({bos}prompt + answer + EOS)" if self.with_answer else f"prompt ({bos}prompt)"
            answer_end = "EOS"
        if self.overlong == "truncate_left":
            return (f"{where}: the {what} is {num_tokens} tokens, more than {self.bound}, and its answer alone "
                    f"({num_answer_tokens} tokens with {answer_end}) leaves no room for the prompt; shorten the "
                    "answer or set data.overlong_prompts to skip")
        return (f"{where}: the {what} is {num_tokens} tokens, more than {self.bound}; shorten it, or set "
                "data.overlong_prompts to skip or truncate_left")


def load_prompts(path: str | os.PathLike, limit: PromptLimit | None = None,
                 fields: RecordFields = RecordFields()) -> list[PromptRecord]:
    """Read a .jsonl or .parquet file of RL prompts or SFT pairs, the record's fields where ``fields``
    says. Blank JSONL lines are skipped; any bad record raises ValueError naming the file, the line
    (JSONL) or 0-based row (Parquet) and the field. With ``limit``, each record is tokenized and
    fitted to it as it is read."""
    path = Path(path)
    records = []
    for where, row in _rows(path):
        record = _parse_row(row, where, fields)
        if limit is not None:
            record = limit.fit(record, where, fields.chat_template)
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


def format_jsonl(records: Sequence[PromptRecord]) -> str:
    return "".join(json.dumps(record.to_json(), ensure_ascii=False) + "\n" for record in records)


# ---------------------------------------------------------------------------------------------
# Tokens: prompts and SFT examples
# ---------------------------------------------------------------------------------------------


class TokenizerLike(Protocol):
    bos_id: int | None
    eos_id: int
    pad_id: int
    stop_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool,
                            tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]: ...


def chat_messages(prompt: Prompt) -> Messages:
    """The messages of ``prompt``: a string is one user message."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def encode_prompt(tokenizer: TokenizerLike, prompt: Prompt, chat_template: bool = False) -> list[int]:
    """The ids the policy is conditioned on (the module docstring's layout). SFT and rollout both use this."""
    if chat_template:
        return tokenizer.apply_chat_template(chat_messages(prompt), add_generation_prompt=True)
    if not isinstance(prompt, str):
        raise ValueError("the prompt is a list of chat messages, which only data.chat_template: true renders; "
                         "set it, or make the prompt a string")
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    return bos + tokenizer.encode(prompt)


def encode_target(tokenizer: TokenizerLike, record: PromptRecord, chat_template: bool = False) -> list[int]:
    """The ids SFT teaches after the prompt ids: the answer and EOS, or with the chat template the
    assistant turn through its first stop id (not the newline a template may put after it)."""
    if not chat_template:
        return tokenizer.encode(record.answer) + [tokenizer.eos_id]
    messages = chat_messages(record.prompt)
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    full_ids = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": record.answer}],
                                             add_generation_prompt=False)
    if full_ids[: len(prompt_ids)] != prompt_ids:
        raise ValueError(
            "the chat template renders the conversation with the answer so that it does not start with the "
            "rendered prompt (with the generation prompt), so the answer's tokens cannot be told apart; use a "
            "template whose assistant turn extends the generation prompt, or set data.chat_template: false"
        )
    response = full_ids[len(prompt_ids):]
    end = next((index for index, token_id in enumerate(response) if token_id in tokenizer.stop_ids), None)
    if end is None:
        raise ValueError(
            f"the chat template's assistant turn holds none of the tokenizer's stop ids {list(tokenizer.stop_ids)}, "
            "so a sampled response would never end; use a template that closes the turn with EOS or an "
            "end-of-turn special token"
        )
    return response[: end + 1]


def prompt_token_ids(tokenizer: TokenizerLike, record: PromptRecord, chat_template: bool = False) -> list[int]:
    """The prompt ids of ``record``: those its PromptLimit stored, or ``encode_prompt``'s for a record made in code."""
    return list(record.prompt_ids) or encode_prompt(tokenizer, record.prompt, chat_template)


@dataclass(frozen=True)
class SFTExample:
    """One prompt + target sequence for next-token prediction."""

    token_ids: list[int]
    """The prompt ids, then the target ids (the module docstring's layout)."""
    num_prompt_tokens: int
    """Length of the prompt ids; the loss covers the tokens after them."""
    target_mask: tuple[bool, ...] = ()
    """A multi-turn target's ids the model writes (PromptRecord.target_mask); empty: all of them."""


def build_sft_example(tokenizer: TokenizerLike, record: PromptRecord, max_length: int | None = None,
                      chat_template: bool = False) -> SFTExample:
    """Tokenize ``record`` (reusing the ids its PromptLimit stored); a sequence longer than
    ``max_length`` raises instead of being truncated."""
    prompt_ids = prompt_token_ids(tokenizer, record, chat_template)
    token_ids = prompt_ids + (list(record.target_ids) or encode_target(tokenizer, record, chat_template))
    if max_length is not None and len(token_ids) > max_length:
        raise ValueError(
            f"SFT example {record.prompt!r} -> {record.answer!r} is {len(token_ids)} tokens, more than "
            f"max_length={max_length}; raise the sequence length or drop long examples"
        )
    return SFTExample(token_ids=token_ids, num_prompt_tokens=len(prompt_ids), target_mask=record.target_mask)


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
        written = example.target_mask or (True,) * (length - example.num_prompt_tokens)
        target_mask[row, example.num_prompt_tokens : length] = torch.tensor(written, dtype=torch.float32, device="cpu")
    lengths = torch.tensor([len(example.token_ids) for example in examples], device="cpu")
    return SFTBatch(
        input_ids=tokens[:, :-1], labels=tokens[:, 1:], loss_mask=target_mask[:, 1:],
        padding_mask=right_padding_mask(lengths, max_len - 1),
    )


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
        self.check_state(state)
        self._epoch = state["epoch"]
        self._position = state["position"]
        self._order = self._epoch_order(self._epoch)

    def check_state(self, state: dict[str, Any]) -> None:
        """ValueError unless ``state`` is a position of a sampler over these records with this seed."""
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

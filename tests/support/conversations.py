"""What the multi-turn rollout tests share (megacispo's engine: tests/multiprocess/test_multi_turn.py; vLLM:
tests/vllm/test_vllm_multi_turn.py): a tokenizer of one id per character, the stop ids that end a turn, and an
environment whose replies differ by sample and turn, late for some samples."""

from __future__ import annotations

import time

from megacispo.data.prompts import PromptRecord
from megacispo.envs.base import EnvStep

EOS, PAD = 2, 0
# A turn ends at any of these ids (a tiny random model samples one within a few tokens).
STOPS = tuple(range(3, 43))


class CharTokenizer:
    """Text <-> ids one character each: enough of a tokenizer for the replies' ids."""

    bos_id, eos_id, pad_id = 1, EOS, PAD
    stop_ids = (EOS, *STOPS)

    def encode(self, text: str) -> list[int]:
        return [100 + ord(c) % 300 for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(i) for i in ids)


class CountingEnv:
    """Replies "x" * (2 + sample % 4 + turn) as a tool message, late by ``delay_s`` for odd samples; done at turn 3."""

    def __init__(self, delay_s: float = 0.0):
        self.delay_s, self.turn, self.sample = delay_s, 0, 0

    def reset(self, record: PromptRecord):
        self.sample = int(record.answer)
        return None

    def step(self, assistant_message: str) -> EnvStep:
        self.turn += 1
        if self.sample % 2:
            time.sleep(self.delay_s)
        if self.turn == 3:
            return EnvStep(reward=1.0, done=True, metrics={"calls": 1})
        return EnvStep(messages=[{"role": "tool", "content": "x" * (2 + self.sample % 4 + self.turn)}], reward=0.5,
                       metrics={"calls": 1})

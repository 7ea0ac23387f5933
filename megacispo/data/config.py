"""The data section (``data:``): where prompts and the tokenizer come from, and how long a prompt may be."""

from __future__ import annotations

from dataclasses import dataclass

from megacispo.fields import Range, check_ranges, ranged

# data.overlong_prompts' choices: what loading does with a prompt (or SFT pair) over its limit.
OVERLONG_PROMPTS = ("error", "skip", "truncate_left")


@dataclass(kw_only=True)
class DataConfig:
    """Where prompts and the tokenizer come from, and how long a prompt may be."""

    train_prompts: str = ""
    """.jsonl or .parquet file of RL prompts: a prompt, an answer; the other fields go to the reward."""
    test_prompts: str = ""
    """.jsonl or .parquet file of held-out prompts for evaluation (empty: no evaluation)."""
    sft_pairs: str = ""
    """.jsonl or .parquet file of prompt/answer pairs for the supervised warm start (megacispo.sft)."""
    prompt_key: str = "prompt"
    """The field holding the prompt (a string, or a list of {"role", "content"} messages); dots for nested fields."""
    answer_key: str = "answer"
    """The field holding the reference answer; dots for nested fields (e.g. reward_model.ground_truth)."""
    tokenizer: str = ""
    """A sentencepiece .model file (tools/train_tokenizer.py writes one) or a Hugging Face tokenizer directory."""
    chat_template: bool = False
    """Render prompts (and SFT answers, as the assistant turn) through the tokenizer's chat template."""
    max_prompt_tokens: int = ranged(0, Range(0, note="0: what the model's context leaves after rollout.max_new_tokens"))
    """Longest RL prompt, in tokens with BOS (0: model.max_position_embeddings - rollout.max_new_tokens)."""
    overlong_prompts: str = "error"
    """A longer prompt, or an SFT pair over the context: error, skip, or truncate_left (keep BOS and the end)."""

    def check(self) -> None:
        check_ranges(self, "data")
        if self.overlong_prompts not in OVERLONG_PROMPTS:
            raise ValueError(f"data.overlong_prompts = {self.overlong_prompts!r}: use {', '.join(OVERLONG_PROMPTS)}")

"""An RL Trainer built in a test's process, on a made-up tokenizer: what tests of the trainer's own
passes (old log-probs, updates) need without a data file or a sentencepiece model."""

from __future__ import annotations


class CharTokenizer:
    """Enough of megacispo.data.tokenizer.Tokenizer for the Trainer, without training a sentencepiece model."""

    pad_id, bos_id, eos_id = 0, 1, 2
    stop_ids = (2,)
    vocab_size = 503

    def encode(self, text: str) -> list[int]:
        return [3 + ord(character) % 500 for character in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i - 3) for i in ids if i >= 3)


def build_trainer(config, total_steps: int = 4, peak_lr: float = 1e-3):
    """The Trainer of ``config`` on this process's ranks (torch.distributed initialized here), with four
    arithmetic prompts (two held out) and no logging."""
    from megacispo.data.prompts import PromptRecord
    from megacispo.metrics.logger import MetricsLogger
    from megacispo.parallel.layout import init_distributed
    from megacispo.rl.trainer import Trainer
    from megacispo.training.engine import Engine

    init_distributed(config.parallel, config.train.seed)
    engine = Engine(config, total_steps=total_steps, peak_lr=peak_lr)
    records = [PromptRecord(prompt=f"{i}+{i}=", answer=str(2 * i)) for i in range(4)]
    return Trainer(config, engine, CharTokenizer(), records, records[:2],
                   MetricsLogger(config.train.run_dir, enabled=False))

"""The evaluation section (``eval:``): greedy accuracy, and pass@k / mean@k over sampled responses."""

from __future__ import annotations

from dataclasses import dataclass

from megacispo.fields import POSITIVE, Range, check_ranges, ranged


@dataclass(kw_only=True)
class EvalConfig:
    """Held-out evaluation: greedy accuracy, and pass@k / mean@k over sampled responses."""

    greedy: bool = True
    """Report the greedy accuracy (eval/accuracy)."""
    num_samples: int = ranged(0, Range(0, note="0: greedy only"))
    """k: responses sampled per test prompt for pass@k and mean@k (0: greedy only)."""
    temperature: float = ranged(1.0, POSITIVE)
    """Sampling temperature of the k responses."""
    top_p: float = ranged(1.0, Range(0, 1, low_open=True))
    """Nucleus sampling of the k responses."""

    def check(self) -> None:
        check_ranges(self, "eval")

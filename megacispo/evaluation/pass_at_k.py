"""pass@k by the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on
Code"), and the k the evaluation reports."""

from __future__ import annotations

import math


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """The probability that at least one of k responses drawn without replacement from ``num_samples``,
    ``num_correct`` of them correct, is correct: 1 - C(n - c, k) / C(n, k). Computed as
    1 - prod_{i = n - c + 1}^{n} (1 - k / i), which takes no large binomial coefficients."""
    if not 0 <= num_correct <= num_samples or not 1 <= k <= num_samples:
        raise ValueError(
            f"pass_at_k(num_samples = {num_samples}, num_correct = {num_correct}, k = {k}): it needs "
            f"0 <= num_correct <= num_samples and 1 <= k <= num_samples."
        )
    if num_samples - num_correct < k:
        return 1.0  # every k-subset holds a correct response
    return 1.0 - math.prod(1.0 - k / i for i in range(num_samples - num_correct + 1, num_samples + 1))


def pass_at_k_values(num_samples: int) -> list[int]:
    """The k reported for n samples: 1, 2, 4, ... up to n, and n itself."""
    powers = [2 ** i for i in range(num_samples.bit_length()) if 2 ** i <= num_samples]
    return powers if powers[-1] == num_samples else powers + [num_samples]

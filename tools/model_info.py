"""Print a model size's configuration and parameter counts.

    python tools/model_info.py --model minimax-m1
"""

from __future__ import annotations

import argparse
import dataclasses

from megacispo.models.config import MODEL_SIZES, model_config, parameter_breakdown, parameter_counts


def human(count: int) -> str:
    """456.1B, 29.7M, 1.1K: one decimal in the largest unit that keeps the number >= 1."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f}{unit}"
    return str(count)


def describe(name: str) -> str:
    config = model_config(name)
    total, activated = parameter_counts(config)
    lines = [f"model {name}"]
    lines += [f"  {field.name:<26} {getattr(config, field.name)}" for field in dataclasses.fields(config)]
    lines.append("parameters")
    for component, count in parameter_breakdown(config).items():
        lines.append(f"  {component:<26} {count:>16,}  {human(count):>7}")
    lines.append(f"  {'total':<26} {total:>16,}  {human(total):>7}")
    lines.append(f"  {'activated':<26} {activated:>16,}  {human(activated):>7}  (top-{config.moe_router_topk} "
                 f"experts per layer; no embedding, no LM head)")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="minimax-m1", choices=sorted(MODEL_SIZES))
    print(describe(parser.parse_args().model))


if __name__ == "__main__":
    main()

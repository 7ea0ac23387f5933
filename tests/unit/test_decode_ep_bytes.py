"""The EP bytes of a decode step at MiniMax-M1's layout (benchmarks/decode_ops.py's table,
``ep_bytes_per_step``): the lean step's scheme sends each expert-TP rank's share of the rows over EP, 1 / 8
of what gathering and scattering all of them moves there at M1's expert TP 8, and no more than an
all-to-all with the fixed shapes a decode step needs could move. tests/multiprocess/test_ep_decode.py
checks that the step's collectives move what the table counts."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import decode_ops  # noqa: E402

ALL_GATHER = "all-gather + reduce-scatter of b rows"
LEAN = "shares over expert TP (the lean step)"


def test_m1s_layout_is_read_from_its_config():
    assert decode_ops.m1_decode_layout() == {
        "hidden_size": 6144, "slots": 32, "ep_size": 32, "expert_tp_size": 8, "topk": 2, "num_experts": 32,
        "moe_layers": 80, "element_size": 2,
    }


def test_lean_step_moves_an_eighth_of_the_all_gathers_ep_bytes_at_m1s_layout():
    table = decode_ops.ep_bytes_per_step(**decode_ops.m1_decode_layout())
    over_ep = {scheme: ep_bytes for scheme, (ep_bytes, _) in table.items()}
    # 31 other EP ranks x 32 rows x 6144 x 2 bytes, sent and received, gathered and scattered, 80 layers.
    assert over_ep[ALL_GATHER] == 4 * 31 * 32 * 6144 * 2 * 80 == 3_900_702_720
    assert over_ep[LEAN] * 8 == over_ep[ALL_GATHER]
    assert all(over_ep[LEAN] <= bytes_moved for bytes_moved in over_ep.values()), over_ep


def test_an_all_to_all_with_fixed_shapes_never_moves_fewer_bytes_than_the_all_gather():
    """Whatever the layout: its buffer to each EP rank holds all b rows (or more, a row per pair)."""
    for ep_size, expert_tp_size, topk, num_experts, slots in [(2, 1, 1, 64, 1), (8, 2, 2, 64, 16), (32, 8, 8, 32, 5)]:
        table = decode_ops.ep_bytes_per_step(64, slots, ep_size, expert_tp_size, topk, num_experts, 3, 2)
        for scheme in [name for name in table if name.startswith("all-to-all")]:
            assert table[scheme][0] >= table[ALL_GATHER][0], (scheme, ep_size, topk, num_experts)

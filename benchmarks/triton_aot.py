"""Every Triton kernel of the project compiled ahead of time for sm_90 (H100, H800, H200) and sm_80
(A100) at MiniMax-M1's and MiniMax-M2's shapes, on any machine: no GPU takes part
(megacispo.testing.triton_aot says how). One row per kernel variant and architecture: the constants
Triton compiled it with, warps and pipeline stages, registers per thread, spilled bytes (ptxas's
log), stack, shared memory (static and dynamic) and the theoretical occupancy against the bound the
kernel's design needs; a row fails on a compile error, a spill, more than 255 registers, shared
memory over the architecture's limit, a grid over CUDA's or an occupancy under its bound. CI holds
every row to those bounds (tests/unit/test_triton_aot.py). Exit status 1 if a row failed.

    .venv/bin/python benchmarks/triton_aot.py            print the table
    .venv/bin/python benchmarks/triton_aot.py --write    and write it into docs/reports/benchmarks.md
"""

from __future__ import annotations

import argparse
import sys
import time

from megacispo.testing import triton_aot


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help=f"write the table into {triton_aot.DOCS}")
    args = parser.parse_args()
    started = time.perf_counter()
    rows = triton_aot.check()
    section = triton_aot.docs_section(rows)
    print(section)
    print(f"\n{len(rows)} rows, {sum(not row.passed for row in rows)} failed, {time.perf_counter() - started:.0f} s",
          file=sys.stderr)
    if args.write:
        triton_aot.DOCS.write_text(triton_aot.docs_with_section(triton_aot.DOCS.read_text(), section))
    return 0 if all(row.passed for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

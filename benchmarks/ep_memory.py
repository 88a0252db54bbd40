"""Pipelined all-to-all memory per reuse strategy and chunk count; see moescale/bench/ep_memory.py.

Same as `moescale bench ep-memory [options]`; writes benchmarks/results/ep_memory_<hardware>.json.
"""

import sys

from moescale.bench.ep_memory import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

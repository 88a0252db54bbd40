"""KV-cached generation with disk-tier experts within a memory bound: bytes per token at the
device vs the minimum, tokens/s vs the disk's rate; see moescale/bench/generate.py.

Same as `moescale bench generate [options]`; writes benchmarks/results/generate_<hardware>.json.
"""

import sys

from moescale.bench.generate import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Host-tier offloading vs all-resident step time; see moescale/bench/offload.py.

Same as `moescale bench offload [options]` (once registered in moescale/bench/cli.py);
writes benchmarks/results/offload_<hardware>.json.
"""

import sys

from moescale.bench.offload import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Pipelined expert parallelism with host-tier experts vs the unpipelined offloaded path; see
moescale/bench/ep_offload.py.

Same as `moescale bench ep-offload [options]`; writes benchmarks/results/ep_offload_<hardware>.json.
"""

import sys

from moescale.bench.ep_offload import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

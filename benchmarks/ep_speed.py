"""Pipelined all-to-all speed, the tuner's pick and the overlap efficiency; see moescale/bench/ep_speed.py.

Same as `moescale bench ep-speed [options]`; writes benchmarks/results/ep_speed_<hardware>.json.
"""

import sys

from moescale.bench.ep_speed import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

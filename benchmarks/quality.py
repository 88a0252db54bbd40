"""MoE vs dense at equal active parameters and equal training time; see moescale/bench/quality.py.

Same as `moescale bench quality [options]`; writes benchmarks/results/quality_<hardware>.json.
"""

import sys

from moescale.bench.quality import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The offloading planner's predicted host-tier step times vs measured, three CPU configs;
see moescale/bench/plan_check.py. Same as `moescale bench plan-check` (once registered);
writes benchmarks/results/plan_check_<hardware>.json.
"""

import sys

from moescale.bench.plan_check import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

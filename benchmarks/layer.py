"""One MoE layer vs its GEMM floor, HF Mixtral and DeepSpeed-MoE; see moescale/bench/layer.py.

Same as `moescale bench layer [options]`; writes benchmarks/results/layer_<hardware>.json.
"""

import sys

from moescale.bench.layer import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

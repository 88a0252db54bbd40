"""Per-rank peak RSS of sharded expert checkpoints on the disk tier (2 expert-parallel ranks,
1.5 GiB of checkpoint state), against the consolidated gather; see
moescale/bench/expert_shards.py.

Same as `moescale bench expert-shards [options]`; writes
benchmarks/results/expert_shards_<hardware>.json.
"""

import sys

from moescale.bench.expert_shards import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

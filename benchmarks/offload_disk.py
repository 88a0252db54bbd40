"""Training beyond RAM on the disk tier (>= 8 GB of expert state, 1 GiB host cache), peak RSS
of the training process; see moescale/bench/offload_disk.py.

Same as `moescale bench offload-disk [options]` (once registered in moescale/bench/cli.py);
writes benchmarks/results/offload_disk_<hardware>.json.
"""

import sys

from moescale.bench.offload_disk import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

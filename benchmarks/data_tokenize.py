"""Tokenizing a text folder into the token cache: throughput and peak memory; see
moescale/bench/data_tokenize.py.

Same as `moescale bench data [options]`; writes benchmarks/results/data_tokenize_<hardware>.json.
"""

import sys

from moescale.bench.data_tokenize import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

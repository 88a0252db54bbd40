"""moescale.sizes.fmt_bytes, the one formatter of byte counts: the strings `moescale plan`, the
run summary and the errors print (unchanged from the planner's formatter it replaced), the exact
form of budget and free-space errors, and that what it prints parses back (`parse_size`) to the
count within the rounding of its one decimal."""

from __future__ import annotations

import random

import pytest

from moescale.sizes import fmt_bytes, parse_size


@pytest.mark.parametrize("n, text", [
    (0, "0 B"), (1, "1 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"),
    (64 << 20, "64.0 MiB"), (2**20 - 1, "1024.0 KiB"), (1.5 * 2**30, "1.5 GiB"),
    (2**40, "1.0 TiB"), (5 * 2**50, "5120.0 TiB"), (-2048, "-2.0 KiB"), (511.7, "511 B"),
])
def test_binary_units_one_decimal(n, text):
    assert fmt_bytes(n) == text


def test_exact_gives_the_count_and_the_unit_where_that_rounds_it():
    assert fmt_bytes(512, exact=True) == "512 bytes"
    assert fmt_bytes(64 << 20, exact=True) == "67108864 bytes (64.0 MiB)"
    assert fmt_bytes(3 * 2**30 + 7, exact=True) == "3221225479 bytes (3.0 GiB)"


def test_what_it_prints_parses_back_within_its_rounding():
    rng = random.Random(0)
    for _ in range(500):
        n = int(rng.random() * 2 ** rng.randrange(0, 45)) + 1
        text = fmt_bytes(n)
        value, unit = text.split()
        step = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}[unit]
        assert abs(parse_size(value + unit, "x") - n) <= 0.05 * step + 1, (n, text)

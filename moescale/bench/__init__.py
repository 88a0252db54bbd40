"""Benchmarks behind `moescale bench NAME`: each answers one question, prints a table and
writes JSON with the hardware in the file name, under runs/bench/<time>/ unless --out names a
path (benchmarks/results/ holds the recorded ones: measure.result_path).

Benchmarks are not tests: they assert nothing and never run in the test suite.
"""

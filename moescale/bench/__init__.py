"""Benchmarks behind `moescale bench NAME`: each answers one question, prints a table and
writes JSON under benchmarks/results/ with the hardware in the file name.

Benchmarks are not tests: they assert nothing and never run in the test suite.
"""

"""The seam's room: the expert Protocol every container speaks (protocol.py), the routing
plan (one stable argsort), the local gather/combine dispatcher, and the host index math that
every exchange shares (index.py; chunk_layout.py: the pipelined all-to-all's chunk cuts;
placed_layout.py: dynamic placement's row layout). Imports nothing of moescale and never
communicates: the collectives are moescale.parallel's.
"""

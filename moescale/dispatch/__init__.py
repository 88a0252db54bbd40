"""The seam's room: the expert Protocol every container speaks (protocol.py), the routing
plan (one stable argsort) and the local gather/combine dispatcher. Imports nothing of moescale.
"""

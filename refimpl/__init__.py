"""refimpl: hybrid-parallel (data x spatial x model) training of 3D CNNs, written by hand.

- ``refimpl.functional``: per-process math, forward and backward of every op (NCDHW).
- ``refimpl.nn``: layers that own parameters and call functional (+ parallel when partitioned).
- ``refimpl.parallel``: process grid, index math, halo exchange, collectives, redistribution.
"""
__version__ = "0.1.0"

"""How torch finds hpccomm: :mod:`~hpccomm._torch.plugin` (entry points, the
``mpi://`` rendezvous), at the top of the map.  Importing this package imports
nothing of torch.

torch's own symbols, version by version, are :mod:`hpccomm._compat`'s (at the
bottom).
"""

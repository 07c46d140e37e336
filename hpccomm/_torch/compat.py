"""``hpccomm._compat`` under its former name, for ``hpccomm.bench`` (which
imports it here) until the bench imports :mod:`hpccomm._compat`; nothing in
the library imports this module."""
from .._compat import group_of, py_backend, register_backend  # noqa: F401 - the names hpccomm.bench uses

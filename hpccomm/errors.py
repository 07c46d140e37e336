"""Exceptions raised by hpccomm.

Every error about an op carries the op's name, its sequence number on its
group, the group, and this process's rank and size, so a message read in one
rank's log says where it came from.
"""
from __future__ import annotations


class HpccommError(RuntimeError):
    """Base class of every error hpccomm raises."""


class ConfigError(HpccommError, ValueError):
    """A malformed ``HPCCOMM_*`` environment variable."""


class InitError(HpccommError):
    """Initialisation failed or disagrees with the launcher."""


class OpError(HpccommError):
    """An op was called with arguments it cannot accept.

    Raised before any communication; the user's tensors are unchanged.
    """

    def __init__(self, op: str, where: str, what: str, fix: str = "") -> None:
        self.op = op
        self.where = where
        self.what = what
        msg = f"hpccomm {op} ({where}): {what}"
        if fix:
            msg += f". {fix}"
        super().__init__(msg)


class OpValueError(OpError, ValueError):
    """Bad sizes, ranks or list lengths."""


class OpTypeError(OpError, TypeError):
    """Unsupported dtype, ReduceOp, device or tensor layout."""

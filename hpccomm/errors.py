"""Exceptions raised by hpccomm.

Every error about an op carries the op's name, its sequence number on its
group, the group, and this process's rank and size, so a message read in one
rank's log says where it came from.  All of them pickle (they may cross a
process boundary: multiprocessing, torch elastic's error files).
"""
from __future__ import annotations


class HpccommError(RuntimeError):
    """Base class of every error hpccomm raises."""


class ConfigError(HpccommError, ValueError):
    """A malformed ``HPCCOMM_*`` environment variable; ``variable`` names it."""

    def __init__(self, message: str, variable: str = "") -> None:
        self.variable = variable
        super().__init__(message)

    def __reduce__(self):
        return type(self), (str(self), self.variable)


class InitError(HpccommError):
    """Initialisation failed or disagrees with the launcher."""


def _part(text: str) -> str:
    """One clause of a message: no surrounding spaces, no final period (the
    joins add their own punctuation)."""
    text = " ".join(text.split())
    return text[:-1] if text.endswith(".") and not text.endswith("..") else text


class OpError(HpccommError):
    """An op was called with arguments it cannot accept.

    Raised before any communication; the user's tensors are unchanged.  The
    message is ``hpccomm <op> (<where>): <what>. <fix>``; the parts are kept
    as attributes ``op``, ``where``, ``what`` and ``fix``.

    Example::

        OpValueError("broadcast", group.where(), "src 5 is not a rank of this group of size 4",
                     "Pass a group rank in 0..size-1")
    """

    def __init__(self, op: str, where: str, what: str, fix: str = "") -> None:
        self.op = op
        self.where = where
        self.what = _part(what)
        self.fix = _part(fix)
        msg = f"hpccomm {op} ({where}): {self.what}"
        if self.fix:
            msg += f". {self.fix}"
        super().__init__(msg)

    def __reduce__(self):
        return type(self), (self.op, self.where, self.what, self.fix)


class OpValueError(OpError, ValueError):
    """Bad sizes, ranks or list lengths."""


class OpTypeError(OpError, TypeError):
    """Unsupported dtype, ReduceOp, device or tensor layout."""

"""The tensors among an op's arguments, for the GPU transports."""
from __future__ import annotations

import torch


def tensors_in(args):
    """Every tensor among an op's arguments (nested lists and tuples), in order."""
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from tensors_in(a)


def translate(result, stand_ins: dict):
    """``result`` (an op's outputs) with each stand-in tensor replaced by the
    user's (``stand_ins``: ``id(stand-in) -> user tensor``): a Work's future
    holds the user's tensors, not a transport's copies."""
    if isinstance(result, torch.Tensor):
        return stand_ins.get(id(result), result)
    if isinstance(result, (list, tuple)):
        return type(result)(translate(r, stand_ins) for r in result)
    return result

"""Gradient compression for allreduce, as Horovod's ``hvd.Compression``."""
from __future__ import annotations

import torch


class Compressor:
    """What a compression algorithm provides: ``compress(tensor) -> (tensor, ctx)``
    and ``decompress(tensor, ctx) -> tensor``.

    Example::

        class Bf16(hvd.compression.Compressor):
            @staticmethod
            def compress(t):
                return (t.to(torch.bfloat16), t.dtype) if t.is_floating_point() else (t, None)
            @staticmethod
            def decompress(t, ctx):
                return t if ctx is None else t.to(ctx)
    """

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression (the default): the tensor is sent as it is.

    Example::

        opt = hvd.DistributedOptimizer(opt, compression=hvd.Compression.none)
    """

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16 and come back in their own
    dtype; other tensors are sent unchanged.

    Example::

        avg = hvd.allreduce(t, compression=hvd.Compression.fp16)   # float32 in, float32 out
    """

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        if ctx is not None and ctx.is_floating_point and tensor.dtype != ctx:
            return tensor.to(ctx)
        return tensor


class Compression:
    """The compression algorithms: ``Compression.none`` (default) and ``Compression.fp16``.

    Example::

        compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    """

    none = NoneCompressor
    fp16 = FP16Compressor

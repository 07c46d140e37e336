"""The op core: how an op runs, whatever adapter torch called.

- :mod:`~hpccomm._core.op_path`: the one path every op takes (check, plan, run
  in its form, Work);
- :mod:`~hpccomm._core.work`: the Work objects torch receives and the pending
  operations behind them;
- :mod:`~hpccomm._core.comm_thread`: the one background thread that calls MPI,
  and the thread rule;
- :mod:`~hpccomm._core.group`: a process group's MPI side (communicators, ranks);
- :mod:`~hpccomm._core.state`: what is running and who failed (the one owner of
  op numbers, op records, failure records and the store keys);
- :mod:`~hpccomm._core.failures`: a lost rank detected (fault tolerance);
- :mod:`~hpccomm._core.watchdog`, :mod:`~hpccomm._core.signals`,
  :mod:`~hpccomm._core.gloo_exit`: timeouts, SIGTERM, exit;
- :mod:`~hpccomm._core.debug_mode`, :mod:`~hpccomm._core.trace`: debug mode and
  the timeline.
"""

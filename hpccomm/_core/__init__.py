"""The op core, below op translation and the GPU transports: what an op in
flight is and how it runs, whatever adapter torch called.

- :mod:`~hpccomm._core.plan`: the plan, what one call of an op needs;
- :mod:`~hpccomm._core.execute`: a plan run blocking (numbered, recorded,
  compared in debug mode, traced);
- :mod:`~hpccomm._core.record`: the op record, one per op that does not
  complete in its call (queued or posted), and its states;
- :mod:`~hpccomm._core.work`: the Work torch receives;
- :mod:`~hpccomm._core.comm_thread`: the one background thread that calls MPI,
  and the thread rule;
- :mod:`~hpccomm._core.state`: what is running and who failed (the one owner of
  op numbers, of the one in-flight record type every form registers with the
  watchdog, ``InFlight``, of failure records and the store keys);
- :mod:`~hpccomm._core.group`: a process group's MPI side (communicators, ranks);
- :mod:`~hpccomm._core.failures`: the failure policy, what an MPI error, a
  refusal, a timeout and a dead rank do (raise, announce, end the job);
  :mod:`~hpccomm._core.ulfm`: what MPI says and does about a dead rank
  (fault tolerance);
- :mod:`~hpccomm._core.watchdog`, :mod:`~hpccomm._core.signals`,
  :mod:`~hpccomm._core.shutdown`, :mod:`~hpccomm._core.gloo_exit`: timeouts,
  SIGTERM, the exit;
- :mod:`~hpccomm._core.debug_mode`, :mod:`~hpccomm._core.trace`: debug mode and
  the timeline.

The op path that runs every torch call through them is
:mod:`hpccomm._ops.op_path`, above.
"""

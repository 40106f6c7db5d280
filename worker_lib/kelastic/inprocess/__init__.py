"""In-process restart: re-run the training function in the same process after a fault.

::

    from kelastic.inprocess import CallWrapper, Wrapper

    @Wrapper(health_check=check)
    def train(call_wrapper: CallWrapper | None = None) -> None:
        dist.init_process_group("gloo")          # inside: every iteration makes its own
        for step in range(start, steps):
            train_step()
            call_wrapper.ping()                  # progress (soft timeout)
            with call_wrapper.atomic():          # never interrupted by an abort
                save_checkpoint()

Semantics from NVIDIA's in-process restart (``nvidia_resiliency_ext.inprocess``): a fault on any
rank (an exception, no progress for ``soft_timeout`` seconds) ends the current
*iteration* on every rank, which aborts (process groups torn down, :class:`RestartAbort`
raised in the function), finalizes, checks its health, passes a termination barrier and
calls the function again with the next iteration's env. The coordination is the node's
kelastic sidecar's (``kelastic_sidecar.inprocess``) over ``inprocess.sock``
(:mod:`kelastic.inprocess_messages`); with ``$KELASTIC_INPROCESS`` unset the wrapper
just calls the function once. A fault the sidecar does not restart in-process (budget
spent, failed health check, lost sidecar) ends the process with the fault's exception,
and the process-restart path takes over.

Modules: :mod:`~kelastic.inprocess.wrapper` (``Wrapper``), :mod:`~kelastic.inprocess.call`
(``CallWrapper``, what a session reads of its ``Wrapper``),
:mod:`~kelastic.inprocess.session` (the protocol's worker half),
:mod:`~kelastic.inprocess.monitor` (reader thread, soft timeout),
:mod:`~kelastic.inprocess.interrupt` (asynchronous abort, ``atomic``),
:mod:`~kelastic.inprocess.abort` (process-group teardown),
:mod:`~kelastic.inprocess.client` (the socket), :mod:`~kelastic.inprocess.inject`
(``KELASTIC_INJECT_RAISE``). Stdlib only; torch is used only once the training code
imported it.
"""

from kelastic.inprocess.errors import GiveUpError, InjectedFault, RestartAbort
from kelastic.inprocess.wrapper import CallWrapper, Hook, Wrapper

__all__ = ["CallWrapper", "GiveUpError", "Hook", "InjectedFault", "RestartAbort", "Wrapper"]

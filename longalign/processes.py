"""How a stage's process meets signals: SIGTERM ends it cleanly, and the children it forks end with it.

Inside :func:`sigterm_as_exit` (every stage's staging block runs in one) SIGTERM raises
:class:`Terminated` (exit status 143), so ``finally`` blocks remove half-written outputs::

    with sigterm_as_exit():
        tokenize(...)            # SIGTERM here -> Terminated -> staging removed -> exit 143

Children forked meanwhile (datasets' ``num_proc`` workers) get the default SIGTERM back and, on Linux,
a SIGTERM when the stage's process ends. Nothing is installed at import: the fork hook is registered
the first time a stage starts.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class Terminated(SystemExit):
    """SIGTERM while a stage runs: the process exits with status 143 once ``finally`` blocks cleaned up."""


_stage_pid: int | None = None  # the process whose stage turned SIGTERM into ``Terminated``
_fork_hook_installed = False
_PR_SET_PDEATHSIG = 1  # prctl option (Linux): a signal for this process when its parent ends


def _leave_on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated(128 + signum)


def _in_forked_child() -> None:
    """A child forked during a stage (datasets' pool workers, its queue manager) ends on SIGTERM as usual,
    and ends with the stage's process.

    A Python handler runs only when the child's main thread gets back to the interpreter. Workers idle
    in the pool's queue lock were seen never to (after about one ``--strict`` error in ten with
    ``num_proc`` 2), and the pool's ``terminate`` waited for them forever. So a forked child gets the
    default back at fork, before any signal can come. On Linux it also asks for SIGTERM when its parent
    ends: after a ``kill -9`` of the stage, its workers would otherwise wait for work forever.
    """
    if signal.getsignal(signal.SIGTERM) is not _leave_on_sigterm:
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if sys.platform == "linux":
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != _stage_pid:  # the parent ended before the request was in place
            os.kill(os.getpid(), signal.SIGTERM)


def _terminated(err: BaseException) -> Terminated | None:
    """The ``Terminated`` that ``err`` was raised while handling, if any (a library may replace it)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, Terminated):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


@contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """While the block runs, SIGTERM raises ``Terminated`` (status 143) so that ``finally`` blocks clean up.

    Code that turns it into another error while cleaning up (datasets' process pool does) still ends
    in ``Terminated``: a stopped stage exits with 143, not with that error's traceback.
    """
    global _stage_pid, _fork_hook_installed
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if not _fork_hook_installed:  # once per process; the hook does nothing outside a stage
        os.register_at_fork(after_in_child=_in_forked_child)
        _fork_hook_installed = True
    previous = signal.signal(signal.SIGTERM, _leave_on_sigterm)
    outer, _stage_pid = _stage_pid, os.getpid()
    try:
        yield
    except Exception as err:
        stop = _terminated(err)
        if stop is None:
            raise
        raise stop from None
    finally:
        signal.signal(signal.SIGTERM, previous)
        _stage_pid = outer

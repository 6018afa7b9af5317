"""``EpisodeRunner``: environment steps off the decode path, each with a deadline.

``submit(fn, *args)`` runs ``fn`` on a worker thread and returns a future that holds its result, its exception, or
an ``EpisodeError`` once ``timeout_s`` passes (a step that never returns cannot be stopped from Python: its thread
stays busy, the trajectory does not wait for it). ``coroutine(coro)`` runs an environment's coroutine (verl's
interactions are async) on one event loop thread and waits for it (the deadline plus ``GRACE_S``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from verl.envs.base import EpisodeError


class EpisodeRunner:
    GRACE_S = 5.0

    def __init__(self, timeout_s: float = 60.0, threads: int = 32):
        self.timeout_s = timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="verl-env")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any, what: str = "environment step") -> concurrent.futures.Future:
        outer: concurrent.futures.Future = concurrent.futures.Future()

        def expire() -> None:
            if not outer.done():
                outer.set_exception(EpisodeError(f"{what} did not answer within {self.timeout_s:g} s "
                                                 "(rollout.multi_turn.env_timeout_s)"))

        timer = threading.Timer(self.timeout_s, expire)
        timer.daemon = True

        def settle(inner: concurrent.futures.Future) -> None:
            timer.cancel()
            if outer.done():
                return
            error = inner.exception()
            with contextlib.suppress(concurrent.futures.InvalidStateError):  # the timer won the race
                if error is not None:
                    outer.set_exception(error)
                else:
                    outer.set_result(inner.result())

        timer.start()
        self._pool.submit(fn, *args).add_done_callback(settle)
        return outer

    def coroutine(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run ``coro`` on the runner's event loop thread; its result (or its exception), within the deadline."""
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="verl-env-loop", daemon=True).start()
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        # Past the deadline ``submit``'s timer has already failed the step with its message; this only frees the
        # thread (and cancels the coroutine) a little later, so the two never race for the reason.
        try:
            return future.result(self.timeout_s + self.GRACE_S)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise EpisodeError(f"an environment coroutine did not finish within {self.timeout_s:g} s") from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._loop is not None:
            loop = self._loop

            def stop() -> None:  # coroutines still pending (a hung interaction's) are cancelled, not left to warn
                for task in asyncio.all_tasks(loop):
                    task.cancel()
                loop.call_soon(loop.stop)  # after the cancelled tasks' last step

            loop.call_soon_threadsafe(stop)

"""``Work``: the handle that ``async_op=True`` collectives and ``isend``/``irecv`` return."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from rpcdist.futures import Future

__all__ = ["Work"]


class Work:
    """An operation in progress, as ``torch.distributed.Work``.

    ``wait()`` blocks a plain thread (bounded by the group's timeout), ``await work`` suspends
    a coroutine, ``get_future()`` gives the rpcdist Future of its result.
    """

    def __init__(self, future: Future[Any], timeout: float, what: str) -> None:
        self._future = future
        self._timeout = timeout
        self._what = what

    def wait(self, timeout: float | None = None) -> bool:
        """Block until done; raises the operation's error, or TimeoutError after ``timeout``
        seconds (default: the process group's timeout)."""
        limit = self._timeout if timeout is None else timeout
        # The operation enforces the group timeout itself, with an error naming the rank it
        # waited for; the grace lets that error, not this generic one, reach the caller.
        grace = 5.0 if timeout is None else 0.0
        try:
            self._future.wait(limit + grace if limit and limit > 0 else None)
        except TimeoutError as exc:
            if self._future.done():
                raise
            raise TimeoutError(f"{self._what} did not complete within {limit:g} s") from exc
        return True

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and self._future.exception() is None

    def exception(self) -> BaseException | None:
        return self._future.exception() if self._future.done() else None

    def get_future(self) -> Future[Any]:
        return self._future

    def result(self) -> Any:
        """The operation's output (e.g. the source rank of ``irecv``) once complete."""
        return self._future.wait()

    def __await__(self) -> Generator[Any, None, Any]:
        return self._future.__await__()

    def __repr__(self) -> str:
        return f"<Work {self._what} {'done' if self.is_completed() else 'pending'}>"

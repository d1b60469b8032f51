"""The engine loop: the one thread that owns a `ServingEngine`, bridged to asyncio.

The api.py contract says every engine method is called from one thread. HTTP handlers
never touch the engine; they post commands (add / abort / call) to the engine thread and
receive `TokenEvent`s through per-request asyncio queues (`loop.call_soon_threadsafe`).
The thread drains commands, runs `engine.step()` while the engine has work and sleeps on
an event otherwise. Any exception on the engine thread stops it: every waiting handler
gets `EngineDead` (the server answers 503).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
from typing import TYPE_CHECKING, Any, Callable, Sequence

from research.serving.api import EngineMetrics, Request, TokenEvent

if TYPE_CHECKING:
    from research.serving.engine import ServingEngine

IDLE_WAIT_S = 0.05


class EngineDead(RuntimeError):
    """The engine thread stopped after an exception; the server answers 503."""


class EngineLoop:
    """The one thread that calls the engine; handlers talk to it through `submit`/`abort`."""

    def __init__(self, engine: ServingEngine, *, idle_wait_s: float = IDLE_WAIT_S):
        self.engine = engine
        self._idle_wait_s = idle_wait_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._subscribers: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._metrics = EngineMetrics()
        self.error: BaseException | None = None
        self.steps = 0
        self._thread = threading.Thread(target=self._run, name="servax-engine", daemon=True)

    # -- called from handlers (any thread)
    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def metrics(self) -> EngineMetrics:
        with self._lock:
            return dataclasses.replace(self._metrics)

    def submit(self, request: Request, events: asyncio.Queue,
               loop: asyncio.AbstractEventLoop) -> concurrent.futures.Future:
        """Queue `request` for the engine; the future resolves once the engine accepted it
        (or raises QueueFullError / RequestError / EngineDead). Its TokenEvents are put on
        `events` in `loop`."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            fut.set_exception(EngineDead(f"engine stopped: {self.error!r}"))
            return fut
        with self._lock:
            if request.request_id in self._subscribers:
                raise ValueError(f"duplicate request_id {request.request_id!r}")
            self._subscribers[request.request_id] = (loop, events)
        self._commands.put(("add", request, fut))
        self._wake.set()
        if not self.alive:  # died between the check above and the put: nobody will answer
            self._fail_future(fut)
        return fut

    def _fail_future(self, fut: concurrent.futures.Future) -> None:
        try:
            fut.set_exception(EngineDead(f"engine stopped: {self.error!r}"))
        except concurrent.futures.InvalidStateError:
            pass

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._subscribers.pop(request_id, None)
        self._commands.put(("abort", request_id, None))
        self._wake.set()

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run `fn(engine)` on the engine thread (e.g. a consistent read for tests)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", fn, fut))
        self._wake.set()
        return fut

    # -- the engine thread
    def _run(self) -> None:
        try:
            self._refresh_metrics()
            while not self._stop.is_set():
                self._drain_commands()
                if self.engine.has_work():
                    events = self.engine.step()
                    self.steps += 1
                    self._dispatch(events)
                    self._refresh_metrics()
                else:
                    self._refresh_metrics()
                    self._wake.wait(self._idle_wait_s)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - reported to every waiting handler
            self.error = e
            logging.getLogger("servax.server").exception("engine thread stopped")
            self._fail_all(e)

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, payload, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    self.engine.add_request(payload)
                except Exception as e:  # noqa: BLE001 - this request fails, not the engine
                    # (add_request changes nothing before it accepts: QueueFullError -> 429,
                    # RequestError -> 400, anything else -> 500 for this request only)
                    with self._lock:
                        self._subscribers.pop(payload.request_id, None)
                    fut.set_exception(e)
                else:
                    fut.set_result(None)
            elif kind == "abort":
                self.engine.abort(payload)
            elif kind == "call":
                try:
                    fut.set_result(payload(self.engine))
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)

    def _dispatch(self, events: Sequence[TokenEvent]) -> None:
        with self._lock:
            for ev in events:
                sub = self._subscribers.get(ev.request_id)
                if sub is None:
                    continue  # aborted by its client; the engine has been told
                loop, q = sub
                if ev.finish_reason is not None:
                    del self._subscribers[ev.request_id]
                try:
                    loop.call_soon_threadsafe(q.put_nowait, ev)
                except RuntimeError:  # the handler's event loop is closed
                    pass

    def _refresh_metrics(self) -> None:
        m = self.engine.metrics()
        with self._lock:
            self._metrics = m

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            subs, self._subscribers = self._subscribers, {}
        while True:
            try:
                kind, _, fut = self._commands.get_nowait()
            except queue.Empty:
                break
            if fut is not None:
                self._fail_future(fut)
        for loop, q in subs.values():
            try:
                loop.call_soon_threadsafe(q.put_nowait, EngineDead(repr(error)))
            except RuntimeError:
                pass

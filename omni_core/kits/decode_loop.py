"""Continuous batching for autoregressive stages: every live request decodes in one step call.

A stage serves many requests at once, one asyncio task each. An autoregressive model (an LLM, a
speech-codec decoder) is fastest when one forward call advances all of them by a token.
:class:`DecodeLoop` sits between the two: each request *joins* the loop with its own state,
reads its outputs as they come, and *leaves* when it is done or aborted; the loop calls your
``step(rows)`` once per iteration with every request that can advance::

    from omni_core.kits import DecodeLoop

    class Generator:
        def __init__(self):
            self.model = build_model()
            self.loop = DecodeLoop(self.step, max_batch_size=32, memory_budget=32 * 4096,
                                   max_prefill_tokens=512)

        def step(self, rows):                     # a worker thread, one step at a time
            out = []
            for row in rows:
                if row.prefill is not None:      # (start, end) of the prompt to run this step
                    ...                           # fill row.state's cache for that chunk
                ...
            logits = self.model.decode([row.state for row in rows])     # one batched forward
            for row, logit in zip(rows, logits):
                token = row.state.sample(logit)   # per-row sampling with the row's own RNG
                if token == EOS or row.state.full:
                    row.finish()                  # this output is the row's last
                out.append(token)
            return out                            # one entry per row, in order

        async def __call__(self, payload, ctx):
            state = self.model.new_state(payload)
            async with self.loop.join(state, prompt_tokens=len(payload["ids"]),
                                      memory=len(payload["ids"]) + payload["max_new"]) as seq:
                async for token in seq:           # this request's outputs, in order
                    await ctx.emit({"token": token})
            return {"tokens": state.tokens}

        async def close(self):
            await self.loop.close()

Policy.

- **Join and leave between steps.** ``join`` waits for admission (FIFO: nobody overtakes an
  earlier request) while ``max_batch_size`` rows are live or the row's ``memory`` does not fit
  in ``memory_budget`` next to theirs; a row larger than the whole budget fails at once
  (:class:`SequenceTooLarge`). Leaving (the ``async with`` block ends: finished, failed or
  cancelled) frees the row's place and memory for the next step.
- **One step call per iteration** over every live row that is *ready*: a row whose consumer has
  ``max_pending_outputs`` outputs unread, or (``needs_input=True``) whose next input was not fed
  yet (and whose inputs were not closed), skips the step; the others do not wait for it.
- **Chunked prefill.** A row with ``prompt_tokens`` runs its prompt first; each step gives
  prompts at most ``max_prefill_tokens`` tokens in all (FIFO), so a long prompt is spread over
  several steps and the running decodes advance at every one of them.
- **Errors stay per request.** An exception instance in ``step``'s results fails that row only.
  When ``step`` itself raises for several rows, the loop runs each of them alone to find the
  culprit: rows whose lone step raises fail with their error, the others carry on with their lone
  step's result. ``step`` must therefore leave every row as it found it when it raises.
- **Abort** is the cancellation of the request's task: its row leaves before the next step (a
  step already running in the worker thread finishes first; the row's memory is given back then).

Contract of ``step(rows) -> results``: ``rows`` is a list of :class:`Row` in join order (a row's
``prefill`` chunk, fed ``input``, ``state``); ``results[i]`` is handed to row i's reader, unless
it is :data:`NO_OUTPUT` (nothing for the reader this step, e.g. a prompt chunk that is not the
last). ``step`` may be ``async`` (awaited on the event loop) or plain (run in a worker thread
owned by the loop, so the event loop is never blocked).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs

from ..errors import InvalidInput
from .worker import Worker

StepFn = Callable[[list["Row"]], "Sequence[Any] | Awaitable[Sequence[Any]]"]


class _NoOutput:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NO_OUTPUT"


#: A step's result for a row that has nothing for its reader this step.
NO_OUTPUT: Any = _NoOutput()


class LoopClosed(RuntimeError):
    """The decode loop was closed: the row did not (and will not) finish."""


class SequenceTooLarge(InvalidInput):
    """A row asks for more memory than the loop's whole budget: it could never be admitted (the
    request asks too much: an :class:`~omni_core.errors.InvalidInput`, ``omni serve`` answers 400)."""


class StepError(RuntimeError):
    """The step function broke its contract (for example, returned the wrong number of results)."""


@attrs.define
class DecodeStats:
    """What the loop did so far: ``steps`` called, ``rows`` stepped in all, the ``largest`` step,
    ``prefill_tokens`` run, rows ``admitted``, ``finished``, ``failed``, ``aborted``, steps that
    raised and were run row by row (``isolations``), how many steps had n rows (``sizes``), and the
    seconds spent in step calls (``busy_s``; per-step latency = ``busy_s / steps``)."""

    steps: int = 0
    rows: int = 0
    largest: int = 0
    prefill_tokens: int = 0
    admitted: int = 0
    finished: int = 0
    failed: int = 0
    aborted: int = 0
    isolations: int = 0
    sizes: dict[int, int] = attrs.Factory(dict)
    busy_s: float = 0.0

    def record(self, size: int, prefill: int) -> None:
        self.steps += 1
        self.rows += size
        self.largest = max(self.largest, size)
        self.prefill_tokens += prefill
        self.sizes[size] = self.sizes.get(size, 0) + 1

    @property
    def mean(self) -> float:
        """Mean rows per step (0.0 before the first step)."""
        return self.rows / self.steps if self.steps else 0.0


class Row:
    """One request's place in the loop, as the step function sees it.

    ``state``: what the request joined with (its cache, sampler, ...). ``prefill``: ``(start,
    end)`` of the prompt tokens to run in this step, or None for a decode step. ``input``: the
    value fed for this step (rows joined with ``needs_input=True``), else None. ``steps``: how
    many steps this row completed before this one; ``decoded``: how many of them were decode
    steps. ``prompt_tokens``, ``memory``: as joined.
    """

    __slots__ = ("state", "prompt_tokens", "memory", "needs_input", "prefill", "input", "steps", "decoded",
                 "_prefilled", "_inputs", "_inputs_closed", "_outputs", "_changed", "_finish_requested", "_done", "_error",
                 "_left", "_in_step", "_released", "_seq_no")

    def __init__(self, state: Any, prompt_tokens: int, memory: int, needs_input: bool, seq_no: int):
        self.state = state
        self.prompt_tokens = prompt_tokens
        self.memory = memory
        self.needs_input = needs_input
        self.prefill: tuple[int, int] | None = None
        self.input: Any = None
        self.steps = 0
        self.decoded = 0
        self._prefilled = 0
        self._inputs: deque = deque()
        self._inputs_closed = False
        self._outputs: deque = deque()
        self._changed = asyncio.Event()
        self._finish_requested = False
        self._done = False  # finished: no more steps; outputs may still be unread
        self._error: BaseException | None = None
        self._left = False
        self._in_step = False
        self._released = False
        self._seq_no = seq_no

    def __repr__(self) -> str:
        return (f"Row(#{self._seq_no}, steps={self.steps}, prefilled={self._prefilled}/{self.prompt_tokens}, "
                f"done={self._done})")

    def finish(self) -> None:
        """Called by the step function: this step's output is the row's last."""
        self._finish_requested = True

    @property
    def in_prefill(self) -> bool:
        """The row still has prompt tokens to run."""
        return self._prefilled < self.prompt_tokens

    @property
    def prefill_done(self) -> bool:
        """In a step: this step's chunk ends the prompt (or there was no prompt)."""
        return self.prefill is None or self.prefill[1] >= self.prompt_tokens


class DecodeSequence:
    """A request's handle on its row: ``async with loop.join(...) as seq``, ``async for out in
    seq``, ``seq.feed(value)``, ``seq.finish()``."""

    __slots__ = ("_loop", "_row", "_entered")

    def __init__(self, loop: DecodeLoop, row: Row):
        self._loop = loop
        self._row = row
        self._entered = False

    @property
    def row(self) -> Row:
        return self._row

    @property
    def state(self) -> Any:
        return self._row.state

    @property
    def steps(self) -> int:
        return self._row.steps

    async def __aenter__(self) -> DecodeSequence:
        await self._loop._admit(self._row)
        self._entered = True
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        self._loop._leave(self._row, aborted=exc_type is not None and issubclass(exc_type, asyncio.CancelledError))

    def feed(self, value: Any) -> None:
        """Queue the input of one of the row's next decode steps (rows joined with
        ``needs_input=True`` step only when one is queued)."""
        self._row._inputs.append(value)
        self._loop._poke()

    def close_inputs(self) -> None:
        """No more inputs will be fed: once the queued ones are used, the row steps on with
        ``row.input = None`` (the step function knows what a row without input does)."""
        self._row._inputs_closed = True
        self._loop._poke()

    def finish(self) -> None:
        """Stop stepping this row (its reader decided it is done); outputs already made stay
        readable."""
        row = self._row
        if not row._done:
            row._done = True
            row._changed.set()
            self._loop._poke()

    def __aiter__(self) -> DecodeSequence:
        return self

    async def __anext__(self) -> Any:
        row = self._row
        while not row._outputs:
            if row._error is not None:
                raise row._error
            if row._done:
                raise StopAsyncIteration
            row._changed.clear()
            await row._changed.wait()
        value = row._outputs.popleft()
        self._loop._poke()  # a row held back by unread outputs may be ready again
        return value


class DecodeLoop(Worker):
    """Continuous batching over ``step`` (see the module docstring).

    ``max_batch_size``: most live rows (admitted, not yet left). ``memory_budget``: the most
    ``memory`` (in the caller's unit: bytes, cache tokens ...) live rows may hold together (None:
    no limit). ``max_prefill_tokens``: the most prompt tokens one step runs, over all rows (None:
    each prompt in one step). ``max_pending_outputs``: a row with this many unread outputs skips
    steps until its reader catches up. ``name`` appears in errors and the worker thread's name.
    The loop binds to the event loop of its first ``join`` (and to a new one once that one is
    closed: ``asyncio.run`` again).
    """

    kind = "decode loop"
    closed_error = LoopClosed
    broken_error = StepError

    def __init__(self, step: StepFn, *, max_batch_size: int = 64, memory_budget: int | None = None,
                 max_prefill_tokens: int | None = None, max_pending_outputs: int = 4, name: str | None = None):
        if not callable(step):
            raise TypeError(f"DecodeLoop needs a callable step function, got {type(step).__name__}")
        for label, value, low in (("max_batch_size", max_batch_size, 1), ("max_pending_outputs", max_pending_outputs, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{label} must be an integer of at least {low}, got {value!r}")
        for label, limit in (("memory_budget", memory_budget), ("max_prefill_tokens", max_prefill_tokens)):
            if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
                raise ValueError(f"{label} must be a positive integer or None, got {limit!r}")
        self.stats = DecodeStats()
        super().__init__(step, name=name, thread_name="decode", stats=self.stats)
        self.max_batch_size = max_batch_size
        self.memory_budget = memory_budget
        self.max_prefill_tokens = max_prefill_tokens
        self.max_pending_outputs = max_pending_outputs
        self._live: list[Row] = []
        self._waiting: deque[tuple[Row, asyncio.Future]] = deque()
        self._memory = 0
        self._seq = 0

    @property
    def step(self) -> StepFn:
        """The step function (replaceable: the next step calls the new one)."""
        return self._calls.fn

    @step.setter
    def step(self, step: StepFn) -> None:
        self._calls.fn = step

    def __repr__(self) -> str:
        return (f"DecodeLoop({self.name!r}, live={len(self._live)}, waiting={len(self._waiting)}, "
                f"memory={self._memory}/{self.memory_budget})")

    # -- what a stage calls ---------------------------------------------------------------------

    def join(self, state: Any, *, prompt_tokens: int = 0, memory: int = 0, needs_input: bool = False) -> DecodeSequence:
        """A row for one request: ``async with loop.join(state, ...) as seq`` admits it (waiting
        for room, FIFO) and makes it leave at the block's end. ``prompt_tokens``: prompt tokens
        to prefill before decoding (0: none); ``memory``: what the row holds while live, counted
        against ``memory_budget``; ``needs_input``: decode steps wait for :meth:`DecodeSequence.feed`."""
        for label, value in (("prompt_tokens", prompt_tokens), ("memory", memory)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{label} must be an integer of at least 0, got {value!r}")
        if self.memory_budget is not None and memory > self.memory_budget:
            raise SequenceTooLarge(f"a row of decode loop {self.name!r} needs memory {memory}, more than the "
                                   f"loop's whole memory_budget ({self.memory_budget}); shorten the request or "
                                   "raise the budget")
        self._seq += 1
        return DecodeSequence(self, Row(state, prompt_tokens, memory, needs_input, self._seq))

    @property
    def live(self) -> int:
        """Rows admitted and not yet gone."""
        return len(self._live)

    @property
    def waiting(self) -> int:
        """Rows waiting for admission."""
        return sum(1 for _, f in self._waiting if not f.done())

    @property
    def memory_in_use(self) -> int:
        """The memory of the rows that hold it (live rows, and rows that left while their last step ran)."""
        return self._memory

    # -- admission ------------------------------------------------------------------------------

    def _forget(self) -> None:
        self._live.clear()
        self._waiting.clear()
        self._memory = 0

    def _fits(self, row: Row) -> bool:
        if len(self._live) >= self.max_batch_size:
            return False
        return self.memory_budget is None or self._memory + row.memory <= self.memory_budget

    async def _admit(self, row: Row) -> None:
        self._check_open()
        loop = self._bind()
        if not self._waiting and self._fits(row):
            self._enter(row)
            return
        future = loop.create_future()
        self._waiting.append((row, future))
        try:
            await future
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                self._leave(row, aborted=True)  # admitted just as it was cancelled
            self._admit_waiting()
            raise

    def _enter(self, row: Row) -> None:
        self._live.append(row)
        self._memory += row.memory
        self.stats.admitted += 1
        self._poke()

    def _admit_waiting(self) -> None:
        while self._waiting:
            row, future = self._waiting[0]
            if future.done():
                self._waiting.popleft()
                continue
            if not self._fits(row):
                return
            self._waiting.popleft()
            self._enter(row)
            future.set_result(None)

    def _leave(self, row: Row, *, aborted: bool) -> None:
        if row._left:
            return
        row._left = True
        if aborted and not row._done:
            self.stats.aborted += 1
        row._done = True
        if row in self._live:
            self._live.remove(row)
        if not row._in_step:
            self._release(row)
        self._poke()

    def _release(self, row: Row) -> None:
        if not row._released:
            row._released = True
            self._memory -= row.memory
            row.state = None  # only rows that left are released: drop their model state now
            self._admit_waiting()

    # -- the worker -----------------------------------------------------------------------------

    def _ready(self, row: Row) -> bool:
        if row._done or len(row._outputs) >= self.max_pending_outputs:
            return False
        return row.in_prefill or not row.needs_input or bool(row._inputs) or row._inputs_closed

    def _plan(self) -> list[Row]:
        """This step's rows, with their prefill chunks and inputs set."""
        rows = []
        budget = self.max_prefill_tokens
        for row in self._live:
            if not self._ready(row):
                continue
            row.input = None
            row.prefill = None
            if row.in_prefill:
                start = row._prefilled
                left = row.prompt_tokens - start
                if budget is not None:
                    if budget <= 0:
                        continue
                    left = min(left, budget)
                    budget -= left
                row.prefill = (start, start + left)
            elif row._inputs:
                row.input = row._inputs[0]
            rows.append(row)
        return rows

    async def _turn(self) -> bool:
        rows = self._plan()
        if rows:
            await self._run(rows)
        return bool(rows)

    async def _call(self, rows: list[Row]) -> list[Any]:
        results = list(await self._calls(rows))
        if len(results) != len(rows):
            raise StepError(f"step function of decode loop {self.name!r} returned {len(results)} results for "
                            f"{len(rows)} rows; it must return one result per row, in order")
        return results

    async def _run(self, rows: list[Row]) -> None:
        for row in rows:
            row._in_step = True
            row._finish_requested = False
        prefill = sum(r.prefill[1] - r.prefill[0] for r in rows if r.prefill is not None)
        self.stats.record(len(rows), prefill)
        try:
            try:
                results = await self._call(rows)
            except StepError:
                raise
            except Exception as exc:
                results = await self._isolate(rows, exc)
        except asyncio.CancelledError:
            for row in rows:
                row._in_step = False
            raise
        except Exception as exc:
            results = [exc] * len(rows)
        for row, result in zip(rows, results, strict=True):
            row._in_step = False
            self._deliver(row, result)
            if row._left:
                self._release(row)
        self._handed_out()

    async def _isolate(self, rows: list[Row], exc: Exception) -> list[Any]:
        """``step(rows)`` raised: run each row alone; a lone step that raises fails its row."""
        if len(rows) == 1:
            return [exc]
        self.stats.isolations += 1
        results = []
        for row in rows:
            row._finish_requested = False
            try:
                results.append((await self._call([row]))[0])
            except StepError:
                raise
            except Exception as lone:
                results.append(lone)
        return results

    def _deliver(self, row: Row, result: Any) -> None:
        if row._left or row._done and row._error is not None:
            return
        if isinstance(result, BaseException):
            row._error = result
            row._done = True
            self.stats.failed += 1
            row._changed.set()
            return
        row.steps += 1
        if row.prefill is not None:
            row._prefilled = row.prefill[1]
        else:
            row.decoded += 1
            if row._inputs:
                row._inputs.popleft()
        row.prefill = None
        row.input = None
        if result is not NO_OUTPUT:
            row._outputs.append(result)
        if row._finish_requested and not row._done:
            row._done = True
            self.stats.finished += 1
        row._changed.set()

    def _fail_all(self, exc: BaseException) -> None:
        waiting, self._waiting = self._waiting, deque()
        for _, future in waiting:
            if not future.done():
                future.set_exception(exc)
        for row in list(self._live):
            if not row._done:
                row._error = exc
                row._done = True
                row._changed.set()


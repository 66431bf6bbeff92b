"""Several engines over one model, as one: `Replicas`.

Each replica is an `Engine` with its own slots, caches, prefix store and threads; the model's
parameters and the compiled programs are shared (the replicas have the same shapes, so they reuse
one another's jitted programs). XLA runs one program on one CPU core here, so one engine's decode
segments keep one core busy; two replicas decode on two (benchmarks/serving.py --replicas).

A request goes to the replica whose prefix store holds the most of its prompt's leading chunks,
so that prompts that share a prefix keep reusing it; among equals, to the replica with the fewest
requests in flight, then the lowest. A replica whose queue is full passes the request to the next.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable

import jax

from jaxmtp.engine.engine import Engine, EngineConfig
from jaxmtp.engine.requests import Event, Handle, QueueFull, Request
from jaxmtp.errors import InputError

# snapshot() keys summed over the replicas; current_k is the largest replica's, the dicts are summed per key.
_SUMMED_DICTS = ("rounds_by_k", "segments_by_bucket", "requests_finished")


class Replicas:
    """`replicas` engines over `model`, each with slots // replicas slots (slots must divide) and
    the other options as given (buckets: each replica's). Offers the Engine's serving interface
    (start, submit, generate, snapshot, stop_admitting, shutdown, ...) for the server."""

    def __init__(self, model, *, replicas: int, tokenizer=None, eos_token_id=None,
                 progress: Callable[[str], None] | None = None, config: EngineConfig | None = None, **options):
        config = dataclasses.replace(config or EngineConfig(), **options)
        if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
            raise InputError(f"replicas: expected a whole number >= 1, found {replicas!r}")
        if config.slots % replicas:
            raise InputError(f"replicas: {config.slots} slots do not divide into {replicas} replicas")
        devices = 1 if model.mesh is None else model.mesh.devices.size
        if replicas > 1 and (devices > 1 or jax.process_count() > 1):
            raise InputError(f"replicas: {replicas} replicas need one process on one device, found "
                             f"{jax.process_count()} process(es) and a mesh of {devices} device(s)")
        self._progress = progress or (lambda message: None)
        each = dataclasses.replace(config, slots=config.slots // replicas)
        self.engines = [Engine(model, tokenizer=tokenizer, eos_token_id=eos_token_id, config=each,
                               progress=self._tagged(i, replicas)) for i in range(replicas)]
        first = self.engines[0]
        self.tokenizer, self.max_len, self.slots, self.k_max = first.tokenizer, first.max_len, config.slots, first.k_max
        self._in_flight = [0] * replicas
        self._lock = threading.Lock()

    def _tagged(self, i: int, n: int) -> Callable[[str], None]:
        if n == 1:
            return self._progress
        return lambda message: self._progress(f"replica {i + 1}/{n}: {message}")

    def start(self) -> "Replicas":
        """Starts each replica in turn: the first compiles the programs and measures the round
        costs; the others reuse its programs and take its costs (Engine.start's calibrated_by). -> self."""
        first = self.engines[0].start()
        for engine in self.engines[1:]:
            engine.start(calibrated_by=first)
        return self

    @property
    def failed(self) -> str | None:
        return next((engine.failed for engine in self.engines if engine.failed), None)

    @property
    def idle(self) -> bool:
        return all(engine.idle for engine in self.engines)

    def check(self, request: Request) -> Request:
        return self.engines[0].check(request)

    def submit(self, request: Request, on_event: Callable[[Event], None]) -> Handle:
        """Queues a request on the replica chosen as the module's docstring says; on_event is
        called on that replica's thread."""
        held = [engine.stored_blocks(request.prompt) for engine in self.engines]
        with self._lock:
            order = sorted(range(len(self.engines)), key=lambda i: (-held[i], self._in_flight[i], i))
        full = None
        for i in order:
            with self._lock:
                self._in_flight[i] += 1
            try:
                return self.engines[i].submit(request, self._counted(i, on_event))
            except QueueFull as e:
                full = e
            except BaseException:
                self._done(i)
                raise
            self._done(i)
        raise full

    def _counted(self, i: int, on_event: Callable[[Event], None]) -> Callable[[Event], None]:
        def counted(event: Event):
            if event.finish_reason is not None:
                self._done(i)
            on_event(event)
        return counted

    def _done(self, i: int):
        with self._lock:
            self._in_flight[i] -= 1

    generate = Engine.generate  # submits through self.submit and waits

    def force_k(self, k: int | None):
        for engine in self.engines:
            engine.force_k(k)

    def stop_admitting(self):
        for engine in self.engines:
            engine.stop_admitting()

    def shutdown(self, timeout: float = 30.0):
        """Stops every replica admitting, then shuts each down within what is left of `timeout`."""
        self.stop_admitting()
        deadline = time.monotonic() + timeout
        for engine in self.engines:
            engine.shutdown(timeout=max(0.0, deadline - time.monotonic()))

    def snapshot(self) -> dict:
        """The replicas' snapshots summed (current_k: the largest replica's, None where none has one)."""
        shots = [engine.snapshot() for engine in self.engines]
        total = {}
        for key in shots[0]:
            if key in _SUMMED_DICTS:
                summed = {}
                for shot in shots:
                    for name, count in shot[key].items():
                        summed[name] = summed.get(name, 0) + count
                total[key] = summed
            elif key == "current_k":
                ks = [shot[key] for shot in shots if shot[key] is not None]
                total[key] = max(ks) if ks else None
            else:
                total[key] = sum(shot[key] for shot in shots)
        return total

"""The engine loop in a process of its own (vLLM v1's EngineCore): the child's side.

With `EngineConfig.engine_process` the worker starts this process (see below how) and talks to it over one
duplex pipe (engine_client.py is the worker's side). The child loads the model itself from the same EngineConfig, so
the worker never holds the weights, and its steps no longer share a GIL with the worker's gRPC server, NATS publishing
and etcd lease.

The wire: the worker sends small pickled commands (the dataclasses below); the child applies them between steps, in
order, exactly where AsyncEngine's thread applies its commands, and sends back one `StepOutput` per loop turn: the
command replies, the token events of the commands and the step, the KV events, checkpoint captures and a snapshot of
the engine's state (load figures, counters) that the worker reads instead of the engine. Tensors (restored and
exported KV, media embeddings, checkpoint KV, the KV cache itself on CPU) travel as torch.multiprocessing shared
memory: the pickle carries a file descriptor, never the bytes.

Checkpoints are captured here, in the child: `CheckpointCapture.capture` runs after each step exactly as on the
engine thread (it needs the sequences' progress and block tables, which live here), and its captures ship in the
step's output with their KV copied into the capture ring (capture_ring.py, shared memory both map once); the
worker's `RemoteCapture` queues them for the CheckpointStreamer. Copying from the shared cache in the worker instead
would need the child to hold freed blocks until the worker copied them: a second ordering protocol for no gain, the
gather being the same copy either way.
What the streamer tells the capture (connected, resync, superseded, bytes sent) comes back as commands. A resync of
every request carries an epoch: captures taken before the child saw it are dropped by the worker, as the thread
version's resync clears the queue.

The child is `python -m phalanx.worker.engine_core --fd N` on one end of a socketpair (not multiprocessing's spawn,
which re-runs the parent's __main__ module: a pytest run, the CLI); multiprocessing's Connection frames and pickles
on it, and torch's reductions pass shared tensors' file descriptors over it.

Lifetime: the child exits on `Stop`, on EOF of the pipe (its parent closed it or died), and by SIGKILL when its parent
dies (PR_SET_PDEATHSIG, for a parent that dies while a step runs). It runs in a session of its own: a signal to the
worker's process group reaches the worker alone, whose drain then stops the engine in order. An exception in the
loop is reported (`Died`) and ends the process non-zero; the worker then fails every open stream with EngineDeadError.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, assert_never

from phalanx.common.children import set_parent_death_signal, set_process_name
from phalanx.model.kv_cache import KvEvents
from phalanx.worker.capture_ring import CaptureRing
from phalanx.worker.checkpointing import CheckpointCapture, _Capture
from phalanx.worker.config import EngineConfig
from phalanx.worker.engine import Engine, EngineRequest, ParkPick
from phalanx.worker.engine_frontend import StepRates
from phalanx.worker.faults import Fault, FaultState
from phalanx.worker.sequence import FinishReason, TokenEvent

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
_IDLE_POLL_S = 0.05  # how long an idle loop sleeps between unparking expired KV


# -- commands: worker -> engine process -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Add:
    call_id: int
    request: EngineRequest


@dataclass(frozen=True, slots=True)
class Abort:
    request_id: str
    reason: FinishReason = FinishReason.ABORTED


@dataclass(frozen=True, slots=True)
class HandBack:
    """End every request but canaries and prefix prefills with HANDED_BACK and its snapshot."""


@dataclass(frozen=True, slots=True)
class ListCached:
    call_id: int


@dataclass(frozen=True, slots=True)
class Restore:
    call_id: int
    request: EngineRequest
    kv: torch.Tensor | None
    kv_tokens: int


@dataclass(frozen=True, slots=True)
class Park:
    call_id: int
    request_ids: list[str] | None
    ttl_s: float
    pick: ParkPick | None


@dataclass(frozen=True, slots=True)
class ExportKv:
    call_id: int
    request_id: str
    kv_tokens: int
    from_token: int = 0


@dataclass(frozen=True, slots=True)
class Unpark:
    call_id: int
    request_id: str


@dataclass(frozen=True, slots=True)
class SetBatchScale:
    scale: float


@dataclass(frozen=True, slots=True)
class SetFaults:
    """The worker's injected faults, whole, after every change (the chaos service drives the worker's FaultState)."""

    faults: tuple[Fault, ...]


@dataclass(frozen=True, slots=True)
class CaptureControl:
    """What the CheckpointStreamer told the capture: one of these fields set."""

    connected: bool | None = None
    resync_epoch: int = 0  # > 0: resync every request, and tag later captures with this epoch
    resync_request: str = ""
    superseded: tuple[str, int] | None = None
    sent_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Stop:
    pass


Command = Add | Abort | HandBack | ListCached | Restore | Park | ExportKv | Unpark | SetBatchScale | SetFaults | CaptureControl | Stop


# -- outputs: engine process -> worker --------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RemoteError:
    """An exception a command raised, rebuilt in the worker with its type and fields (a retry_after_s, a subject)."""

    kind: type[BaseException]
    args: tuple[Any, ...]
    fields: dict[str, Any]

    @classmethod
    def of(cls, exc: BaseException) -> RemoteError:
        return cls(type(exc), exc.args, dict(vars(exc)))

    def rebuild(self) -> BaseException:
        exc = self.kind.__new__(self.kind)
        exc.args = self.args
        vars(exc).update(self.fields)
        return exc


@dataclass(frozen=True, slots=True)
class Reply:
    call_id: int
    value: Any = None
    error: RemoteError | None = None


@dataclass(frozen=True, slots=True)
class Admitted:
    """Add's and Restore's value: the request runs; its log starts with `replayed` (a migrated request's tokens)."""

    request_id: str
    canary: bool
    replayed: list[TokenEvent]

    def __reduce__(self) -> tuple[Any, tuple]:
        # A migrated request brings its whole output (1,024 events at 1,024 tokens), pickled by the engine loop between
        # two steps and unpickled under the worker's GIL: as columns, a tenth of the time of the events themselves.
        return _admitted, (self.request_id, self.canary, *_replay_columns(self.replayed))


def _replay_columns(events: list[TokenEvent]) -> tuple[TokenEvent | None, list[int], list[str], list | None, list[TokenEvent]]:
    """Replayed events (Sequence.replayed_events) as (first event, then the rest's token ids, texts and logprobs); any that
    carries more than those goes whole, in the last list."""
    if not events:
        return None, [], [], None, []
    first, rest = events[0], events[1:]
    plain = all(
        e.request_id == first.request_id and e.index == first.index + i and _extras(e) == _NO_EXTRAS for i, e in enumerate(rest, 1)
    )
    if not plain:
        return None, [], [], None, events
    logprobs = [e.logprobs for e in rest] if any(e.logprobs is not None for e in rest) else None
    return first, [e.token_id for e in rest], [e.text for e in rest], logprobs, []


def _extras(e: TokenEvent) -> tuple:
    return (e.finish_reason, e.top_logit, e.top_margin, e.prompt_tokens, e.cached_prompt_tokens, e.seed, e.handoff, e.error,
            e.handoff_kv_tokens, e.prompt_logprobs)


_NO_EXTRAS = _extras(TokenEvent("", 0, "", 0))


def _admitted(
    request_id: str, canary: bool, first: TokenEvent | None, token_ids: list[int], texts: list[str], logprobs: list | None,
    whole: list[TokenEvent],
) -> Admitted:
    replayed = whole
    if first is not None:
        rid, index, lps = first.request_id, first.index, logprobs or [None] * len(token_ids)
        columns = zip(token_ids, texts, lps, strict=True)
        replayed = [first, *(TokenEvent(rid, t, text, index + i, logprobs=lp) for i, (t, text, lp) in enumerate(columns, 1))]
    return Admitted(request_id, canary, replayed)


@dataclass(frozen=True)
class CoreState:
    """The engine state the worker reads, as of the end of a loop turn."""

    queue_depth: int = 0
    running_seqs: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    rates: StepRates = field(default_factory=StepRates)
    preemptions: int = 0
    prefix_hit_tokens: int = 0
    prompt_tokens_total: int = 0
    generated_tokens_total: int = 0
    tokens_computed: int = 0
    canary_tokens_computed: int = 0
    canaries_total: int = 0
    parked: tuple[str, ...] = ()
    batch_scale: float = 1.0
    max_num_seqs: int = 0
    checkpoint_lag_tokens: int = 0
    checkpoints_skipped: int = 0


@dataclass(frozen=True, slots=True)
class Ready:
    """The child loaded its model: the config sized for it, and its KV cache (shared memory on CPU; None on an accelerator)."""

    config: EngineConfig
    cache_data: torch.Tensor | None
    full_shape: tuple[int, ...]
    bytes_per_block: int
    dtype: str
    capture_ring: torch.Tensor | None = None  # shared memory checkpoint KV crosses in (capture_ring.py); CPU only


@dataclass(slots=True)
class StepOutput:
    replies: list[Reply] = field(default_factory=list)
    events: list[TokenEvent] = field(default_factory=list)
    kv_events: list[KvEvents] = field(default_factory=list)
    captures: list[_Capture] = field(default_factory=list)
    capture_epoch: int = 0
    state: CoreState | None = None


@dataclass(frozen=True, slots=True)
class Died:
    """The loop raised: the engine is unusable (the process exits non-zero after this)."""

    error: str


@dataclass(frozen=True, slots=True)
class CoreOptions:
    """What the worker tells the child besides its EngineConfig."""

    parent_pid: int
    # The worker's multiprocessing authkey: torch passes a shared tensor's file descriptor through multiprocessing's
    # resource sharer, which lets in only processes that hold the same key.
    authkey: bytes = b""
    torch_threads: int = 0
    checkpoint_max_pending_bytes: int = 0  # 0: no checkpointing
    checkpoint_interval_tokens: int = 8
    log_level: int = logging.INFO
    # Chaos (WorkerConfig.chaos_crash_on_prompt): the step that first schedules a prompt containing this kills the
    # worker (SIGKILL to the parent; this process follows by its death signal), as on the engine thread. Empty: off.
    crash_on_prompt: str = ""


# -- the child ------------------------------------------------------------------------------------------------------
def main(fd: int) -> None:
    """The engine process's entry point: its config from the pipe on `fd`, load, report Ready, loop until stopped."""
    conn = Connection(fd)
    config, options = conn.recv()
    multiprocessing.current_process().authkey = options.authkey
    set_parent_death_signal(signal.SIGKILL)  # a step that runs on must not outlive the worker either
    if os.getppid() != options.parent_pid:
        os._exit(1)  # the parent died before the signal was set: none comes
    set_process_name("phalanx-engine")
    logging.basicConfig(level=options.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s engine-core %(name)s: %(message)s")
    try:
        core = EngineCore.load(config, conn, options)
    except BaseException as exc:
        log.exception("engine process failed to start")
        _send_quietly(conn, Died(f"engine process failed to start: {exc!r}"))
        os._exit(1)
    try:
        core.run()
    except BaseException as exc:
        log.exception("engine loop died")
        _send_quietly(conn, Died(f"engine loop died: {exc!r}"))
        os._exit(1)
    os._exit(0)  # no atexit work: the shared tensors' owner (the worker) outlives this


def _send_quietly(conn: Connection, message: Any) -> None:
    try:
        conn.send(message)
    except OSError:
        pass  # the worker is gone already


def shared_cache(config: EngineConfig, model: Any) -> Any:
    """The model's KV cache; on CPU in shared memory (untouched until written, as `zeroed`'s) that the worker maps too."""
    import torch

    from phalanx.model.kv_cache import BLOCK_SIZE, KvCacheTensors

    c = model.config
    shape = (c.num_layers, 2, config.num_kv_blocks, BLOCK_SIZE, c.num_kv_heads, c.head_dim)
    if torch.device(config.device).type != "cpu":
        return KvCacheTensors(*shape[:1], shape[2], BLOCK_SIZE, *shape[4:], dtype=model.dtype, device=model.device)
    nbytes = model.dtype.itemsize
    for n in shape:
        nbytes *= n
    return KvCacheTensors.over(_shared(nbytes).view(model.dtype).view(shape))


def _shared(nbytes: int) -> torch.Tensor:
    """`nbytes` of shared memory (uint8), untouched until written."""
    import torch

    return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes))


class EngineCore:
    """The loop: commands, a step, checkpoint capture, KV events, one StepOutput; until Stop or the pipe's EOF."""

    def __init__(self, engine: Engine, conn: Connection, capture: CheckpointCapture | None, ring: CaptureRing | None = None) -> None:
        self.engine = engine
        self.conn = conn
        self.capture = capture
        self.ring = ring
        self.rates = StepRates()
        self.stopping = False
        # Commands read off the pipe by a thread of their own: fault changes and Stop act at once even while a step
        # runs or a HANG holds it (as AsyncEngine's control side does from the event loop); the rest waits for the loop.
        self._commands: queue.SimpleQueue[Command | None] = queue.SimpleQueue()  # None: the pipe's EOF
        self._wake = threading.Event()
        self._capture_epoch = 0
        self._out = StepOutput()
        self._last_state: CoreState | None = None

    @classmethod
    def load(cls, config: EngineConfig, conn: Connection, options: CoreOptions) -> EngineCore:
        import torch


        if torch.device(config.device).type == "cpu":
            torch.set_num_threads(options.torch_threads or config.effective_torch_threads())
        model = config.load_model()
        c = model.config
        config = config.sized_for(c.num_layers, c.num_kv_heads, c.head_dim, model.dtype.itemsize)
        cache = shared_cache(config, model)
        engine = Engine(model, config, faults=FaultState(), cache=cache)
        if options.crash_on_prompt:
            from phalanx.worker.fault_service import arm_prompt_crash

            arm_prompt_crash(engine, options.crash_on_prompt, model.tokenizer.decode, kill=lambda: os.kill(options.parent_pid, signal.SIGKILL))
        capture = ring = None
        if options.checkpoint_max_pending_bytes:
            capture = CheckpointCapture(options.checkpoint_max_pending_bytes, interval_tokens=options.checkpoint_interval_tokens)
        shared = cache.data if cache.data.is_shared() and cache.data.device.type == "cpu" else None
        if capture is not None and shared is not None:  # the budget of unsent KV, its pages touched only as used
            ring = CaptureRing(_shared(options.checkpoint_max_pending_bytes))
        conn.send(Ready(
            engine.config, shared, cache.full_shape, cache.bytes_per_block, str(cache.data.dtype).removeprefix("torch."),
            capture_ring=ring.data if ring is not None else None,
        ))
        log.info("engine process %d serving %s (%d KV blocks)", os.getpid(), c.name, engine.config.num_kv_blocks)
        return cls(engine, conn, capture, ring)

    def run(self) -> None:
        engine = self.engine
        threading.Thread(target=self._read, name="phalanx-engine-commands", daemon=True).start()
        try:
            while not self.stopping:
                if not engine.has_work():
                    self._wake.wait(_IDLE_POLL_S)
                    self._wake.clear()
                applied = self._apply_commands()
                if applied is None:
                    return  # the worker is gone
                if self.stopping:
                    break
                # Admissions and the state they leave go out before a step that may be long, or held by a HANG: the
                # worker's Stats must show a hung engine holding its requests (health's hang signature), as a thread's does.
                # Without commands, the previous turn's output already said all there is: no state to build again.
                if applied:
                    self._send_output()
                if engine.has_work():
                    self._out.events.extend(engine.step())
                    self.rates.record(engine.last_step)
                self._capture_checkpoints()
                self._flush_kv_events()
                self._send_output()
            self._send_output()
        except (BrokenPipeError, ConnectionResetError):
            return  # the worker is gone

    def _read(self) -> None:
        faults = self.engine.faults
        try:
            while True:
                command = self.conn.recv()
                if isinstance(command, SetFaults):
                    faults.replace({f.kind: f for f in command.faults})
                elif isinstance(command, Stop):
                    faults.interrupt()  # a held step must end
                self._commands.put(command)
                self._wake.set()
        except (EOFError, OSError):
            faults.interrupt()
            self._commands.put(None)
            self._wake.set()

    def _apply_commands(self) -> int | None:
        """Applies every command waiting, in order; how many, or None at the pipe's EOF."""
        applied = 0
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return applied
            if command is None:
                return None
            self._apply(command)
            applied += 1
            if self.stopping:
                return applied

    def _apply(self, command: Command) -> None:
        engine, out = self.engine, self._out
        match command:
            case Add(call_id=call_id, request=request):
                try:
                    seq = engine.add_request(request)
                except Exception as exc:  # noqa: BLE001 - reported to that caller only
                    out.replies.append(Reply(call_id, error=RemoteError.of(exc)))
                    return
                out.replies.append(Reply(call_id, Admitted(seq.request_id, request.canary, seq.replayed)))
            case Abort(request_id=request_id, reason=reason):
                if (event := engine.abort(request_id, reason)) is not None:
                    out.events.append(event)
            case HandBack():
                for request_id, seq in list(engine.by_id.items()):
                    if not (seq.canary or seq.prefix_only) and (event := engine.abort(request_id, FinishReason.HANDED_BACK)) is not None:
                        out.events.append(event)
            case ListCached(call_id=call_id):
                self._flush_kv_events()  # the worker applies them before this reply
                out.replies.append(Reply(call_id, engine.cached_blocks()))
            case Restore() | Park() | ExportKv() | Unpark():
                self._call(command)
            case SetBatchScale(scale=scale):
                engine.set_batch_scale(scale)
            case SetFaults():
                pass  # applied by the reader thread
            case CaptureControl():
                self._control_capture(command)
            case Stop():
                self.stopping = True
            case _:
                assert_never(command)

    def _call(self, command: Restore | Park | ExportKv | Unpark) -> None:
        engine, out = self.engine, self._out
        try:
            match command:
                case Restore(request=request, kv=kv, kv_tokens=kv_tokens):
                    seq = engine.restore(request, kv, kv_tokens)
                    value: Any = Admitted(seq.request_id, False, seq.replayed)
                case Park(request_ids=request_ids, ttl_s=ttl_s, pick=pick):
                    value = engine.park(request_ids, ttl_s, pick)
                    out.events.extend(value)
                case ExportKv(request_id=request_id, kv_tokens=kv_tokens, from_token=from_token):
                    value = engine.export_kv(request_id, kv_tokens, from_token)
                case Unpark(request_id=request_id):
                    value = engine.unpark(request_id)
                case _:
                    assert_never(command)
        except Exception as exc:  # noqa: BLE001 - reported to that caller only
            out.replies.append(Reply(command.call_id, error=RemoteError.of(exc)))
            return
        out.replies.append(Reply(command.call_id, value))

    def _control_capture(self, control: CaptureControl) -> None:
        capture = self.capture
        if capture is None:
            return
        if control.connected is not None:
            capture.connected = control.connected
        if control.resync_epoch:
            capture.resync()
            self._capture_epoch = control.resync_epoch
            if self.ring is not None:
                self.ring.reset()
        if control.resync_request:
            capture.resync(control.resync_request)
        if control.superseded is not None:
            capture.superseded(*control.superseded)
        if control.sent_bytes:
            capture.sent(control.sent_bytes)
            if self.ring is not None:
                self.ring.sent(control.sent_bytes)

    def _capture_checkpoints(self) -> None:
        engine = self.engine
        if engine.parked:
            engine.unpark()  # transfers that never came
        if self.capture is None:
            engine.released.clear()
            return
        self.capture.capture(engine)
        captures = self.capture.take()
        if self.ring is not None:
            for item in captures:
                self.ring.place(item)
        if captures:
            self._out.captures.extend(captures)
            self._out.capture_epoch = self._capture_epoch

    def _flush_kv_events(self) -> None:
        events = self.engine.drain_kv_events()
        if events:
            self._out.kv_events.append(events)

    def _state(self) -> CoreState:
        e, capture = self.engine, self.capture
        return CoreState(
            queue_depth=len(e.waiting), running_seqs=len(e.running), free_blocks=e.kv.num_free_blocks, total_blocks=e.kv.num_blocks,
            rates=StepRates(self.rates.step_time_ema_s, self.rates.prefill_rate, self.rates.decode_rate),
            preemptions=e.preemptions, prefix_hit_tokens=e.prefix_hit_tokens, prompt_tokens_total=e.prompt_tokens_total,
            generated_tokens_total=e.generated_tokens_total, tokens_computed=e.tokens_computed,
            canary_tokens_computed=e.canary_tokens_computed, canaries_total=e.canaries_total, parked=tuple(e.parked),
            batch_scale=e.batch_scale, max_num_seqs=e.max_num_seqs,
            checkpoint_lag_tokens=capture.lag_tokens if capture is not None else 0,
            checkpoints_skipped=capture.captures_skipped if capture is not None else 0,
        )

    def _send_output(self) -> None:
        out, state = self._out, self._state()
        if state == self._last_state and not (out.replies or out.events or out.kv_events or out.captures):
            return
        out.state = self._last_state = state
        self._out = StepOutput()
        self.conn.send(out)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="The engine process of a worker (started by the worker, never by hand)")
    parser.add_argument("--fd", type=int, required=True, help="this end of the worker's socketpair")
    fd = parser.parse_args().fd
    from phalanx.worker import engine_core  # the wire's classes as the worker names them, not as __main__'s

    engine_core.main(fd)

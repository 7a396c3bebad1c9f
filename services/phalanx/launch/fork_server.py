"""Worker processes forked from a server that has done their imports: a new worker serves in a tenth of a second.

A `phalanx worker` process spends most of its start importing: a simulated worker 0.56 s of CPU of its 0.64 s from
spawn to registered (a torch one, seconds). On a busy box that is wall time several-fold, and CPU taken from the workers
already serving, at the moment a burst (or a dead worker) needs the new one. The fork server (`phalanx up
--fork-workers`) imports the worker's modules once, then forks a worker per request: the child only parses its command
line and connects.

The process tree stays what the supervisor knows. The supervisor is a child subreaper (PR_SET_CHILD_SUBREAPER); the
server forks an intermediate that forks the worker and exits at once, so the kernel re-parents the worker to the
supervisor before the server answers. The worker is then the supervisor's child like any process it spawned: its
exit status is the supervisor's to collect (`ForkedProcess` is Popen's interface over its PID), and a killed fork
server leaves every worker serving. A worker takes the parent-death signal only once re-parented (the intermediate's
exit would send it otherwise), and exits if the supervisor died meanwhile, as `pdeathsig_preexec` does.

The server runs the program a spawned worker would run, ``python -m MAIN ARGS``: MAIN is the module the caller names
(``--main``), run as ``__main__`` in the forked child, so this module knows nothing of the command line it serves.

The protocol: one JSON line per request on the server's stdin, ``{"args": [...], "env": {...}}`` (the worker's whole
environment); one JSON line per answer on the response pipe, ``{"pid": N}`` or ``{"error": "..."}``, after a first
``{"ready": true}`` once the imports are done. Until then, and while the server is dead, the caller spawns the worker
the ordinary way; a server that took a request and gave no answer fails that start (`ForkServer.spawn`).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from phalanx.common.children import become_subreaper, die_with_parent, pdeathsig_preexec, set_process_name

# What a simulated worker imports before it serves; a torch worker adds the model code (and torch).
SIM_PRELOAD = ("phalanx.cli.main", "phalanx.worker.process", "phalanx.worker.simulated")
TORCH_PRELOAD = (*SIM_PRELOAD, "torch", "phalanx.model")
# A fork takes milliseconds, on a loaded box tens of them; an answer slower than this means a stuck server.
_ANSWER_TIMEOUT_S = 10.0
# The worker waits this long to be re-parented to the supervisor (the intermediate exits right after forking it).
_ADOPTION_TIMEOUT_S = 5.0


class ForkedProcess(subprocess.Popen):
    """A worker the fork server made, adopted by this process: Popen's interface (poll, wait, signals) over its PID.

    It is this process's child (re-parented), so waitpid collects its exit status as Popen's would.
    """

    def __init__(self, pid: int, args: Sequence[str]) -> None:  # not Popen.__init__: that would start a process
        self.pid = pid
        self.args = list(args)
        self.returncode = None
        self.stdin = self.stdout = self.stderr = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # not ours after all (never adopted): nothing to collect, and it is gone to us
                self.returncode = -signal.SIGKILL
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.01)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # a collected PID may be another process's by now
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __del__(self) -> None:
        pass  # Popen's finaliser tracks children it started; this one the supervisor collects itself

    def __repr__(self) -> str:
        return f"<ForkedProcess: pid {self.pid} returncode: {self.returncode}>"


class ForkServer:
    """The supervisor's side: starts the server, asks it for workers, and says when it cannot (then the caller spawns)."""

    def __init__(self, preload: Sequence[str] = SIM_PRELOAD, env: dict[str, str] | None = None, *, main: str) -> None:
        """``main``: the module a worker runs as ``python -m MAIN ARGS``; the forked worker runs it as ``__main__``."""
        self.preload = tuple(preload)
        self.main = main
        self.env = env or {}
        self.process: subprocess.Popen | None = None
        self._answers = -1
        self._pending = b""
        self._ready = False

    def start(self) -> subprocess.Popen:
        """Starts the server (from a long-lived thread: its parent-death signal is that thread's); ready once imported.

        This process becomes a child subreaper, which is what makes the forked workers its children."""
        if not become_subreaper():
            raise OSError("PR_SET_CHILD_SUBREAPER failed: forked workers would not be this process's children")
        self.close()
        answers, write_end = os.pipe()
        os.set_blocking(answers, False)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "phalanx.launch.fork_server", "--supervisor", str(os.getpid()), "--main", self.main,
                 "--answers-fd", str(write_end), *(arg for module in self.preload for arg in ("--preload", module))],
                stdin=subprocess.PIPE,
                env={**os.environ, **self.env},
                pass_fds=(write_end,),
                start_new_session=True,
                preexec_fn=pdeathsig_preexec(),  # noqa: PLW1509 - only prctl
            )
        finally:
            os.close(write_end)
        self._answers, self._pending, self._ready = answers, b"", False
        return self.process

    @property
    def ready(self) -> bool:
        """Running and done importing."""
        if self.process is None or self.process.poll() is not None:
            return False
        if not self._ready:
            line = self._read_line(0.0)
            self._ready = line is not None and json.loads(line).get("ready") is True
        return self._ready

    def spawn(self, args: Sequence[str], env: dict[str, str]) -> ForkedProcess | None:
        """A worker running ``python -m MAIN ARGS`` with exactly ``env``; None if the server made none (not ready, dead, or a
        failed fork): spawn it instead.

        Raises OSError if the server took the request and did not answer: a worker may have been forked that nobody
        knows the PID of, so the caller must not start another under the same id (its parent-death signal still
        stops it with this process). The server is stopped; its supervisor starts another."""
        if not self.ready:
            return None
        assert self.process is not None and self.process.stdin is not None
        try:
            self.process.stdin.write(json.dumps({"args": list(args), "env": env}).encode() + b"\n")
            self.process.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            self.close()  # it died before it read the request: nothing was forked
            return None
        line = self._read_line(_ANSWER_TIMEOUT_S)
        if line is None:
            dead = self.process.poll() is not None
            self.close()
            raise OSError(f"the fork server {'exited' if dead else 'did not answer'} while starting {' '.join(args[:3])}")
        answer = json.loads(line)
        if "pid" not in answer:
            print(f"fork server: {answer.get('error', answer)}; starting the worker by spawn", file=sys.stderr)
            return None
        return ForkedProcess(answer["pid"], [sys.executable, "-m", self.main, *args])

    def close(self) -> None:
        """Stops the server (SIGTERM) if it runs; the workers it forked are not its children and run on."""
        if self.process is not None:
            if self.process.poll() is None:
                self.process.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(5)
                if self.process.poll() is None:
                    self.process.kill()
                    self.process.wait(5)
            if self.process.stdin is not None:
                with contextlib.suppress(OSError):
                    self.process.stdin.close()
        if self._answers >= 0:
            os.close(self._answers)
            self._answers = -1
        self._ready = False

    def _read_line(self, timeout: float) -> bytes | None:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._pending:
            remaining = deadline - time.monotonic()
            readable, _, _ = select.select([self._answers], [], [], max(0.0, remaining))
            if not readable:
                return None
            chunk = os.read(self._answers, 4096)
            if not chunk:
                return None  # the server exited
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line


# --- the server process ---------------------------------------------------------------------------------------------


def _fork_worker(main: str, args: list[str], env: dict[str, str], supervisor: int, answers: int) -> int:
    """The PID of a new worker, re-parented to the supervisor by the time this returns."""
    read_end, write_end = os.pipe()
    intermediate = os.fork()
    if intermediate == 0:
        try:
            os.close(read_end)
            worker = os.fork()
            if worker == 0:
                os.close(write_end)
                _become_worker(main, args, env, supervisor, answers)
            os.write(write_end, str(worker).encode())
        finally:
            os._exit(0)  # the worker is orphaned now: the kernel hands it to the subreaper, the supervisor
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        data = pipe.read()
    os.waitpid(intermediate, 0)
    if not data:
        raise RuntimeError("the intermediate process exited without forking a worker")
    return int(data)


def _become_worker(main: str, args: list[str], env: dict[str, str], supervisor: int, answers: int) -> None:
    """Runs ``python -m MAIN ARGS`` in this forked process as a spawned worker would run; never returns."""
    code = 1
    try:
        os.setsid()  # as start_new_session: a signal to the server's group is not the worker's
        os.close(answers)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)  # stdin was the server's request pipe
        os.close(devnull)
        _retitle(["phalanx", *args])  # before the environment changes: the title's memory is found through it
        deadline = time.monotonic() + _ADOPTION_TIMEOUT_S
        while os.getppid() != supervisor:
            if time.monotonic() > deadline:
                os._exit(1)  # the supervisor died (we went to init), or is no subreaper
            time.sleep(0.001)
        die_with_parent(supervisor)
        os.environ.clear()
        os.environ.update(env)
        sys.argv = ["phalanx", *args]
        try:
            runpy.run_module(main, run_name="__main__", alter_sys=True)  # as `python -m MAIN`: sys.argv[0] becomes its path
            code = 0
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:  # noqa: BLE001 - whatever it is, say it and exit as a crashed process would
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _retitle(argv: list[str]) -> None:
    """Shows ``argv`` (truncated to fit) as this process's command line in ps and /proc, not the fork server's.

    The kernel reads the command line from the memory the original argv strings occupy, just below the first environment
    string; the new title is written there only if that memory holds exactly what /proc says (else nothing is written).
    """
    with contextlib.suppress(OSError, ValueError, AttributeError):
        current = Path("/proc/self/cmdline").read_bytes()
        environ = ctypes.POINTER(ctypes.c_void_p).in_dll(ctypes.CDLL(None), "environ")
        first_env = environ[0] if environ else None
        if not current or not first_env:
            return
        start = first_env - len(current)
        if ctypes.string_at(start, len(current)) != current:
            return
        title = "\0".join(argv).encode()[: len(current) - 1]
        ctypes.memmove(start, title.ljust(len(current), b"\0"), len(current))
        set_process_name(argv[1] if len(argv) > 1 else argv[0])


def serve(supervisor: int, answers: int, preload: Sequence[str], main: str) -> None:
    """Imports ``preload``, says ready, then answers each request with a forked worker's PID."""
    started = time.monotonic()
    set_process_name("phalanx-forks")  # also loads libc's prctl here, not in each forked worker
    for module in preload:
        importlib.import_module(module)
    out = os.fdopen(answers, "wb", buffering=0, closefd=False)
    out.write(b'{"ready": true}\n')
    print(f"fork server (pid {os.getpid()}) ready: imported in {time.monotonic() - started:.1f} s", file=sys.stderr, flush=True)
    for line in sys.stdin.buffer:
        try:
            request = json.loads(line)
            pid = _fork_worker(main, [str(a) for a in request["args"]], {str(k): str(v) for k, v in request["env"].items()}, supervisor, answers)
            answer: dict[str, int | str] = {"pid": pid}
        except Exception as error:  # noqa: BLE001 - answered; the caller spawns the worker instead
            answer = {"error": f"{type(error).__name__}: {error}"}
        out.write(json.dumps(answer).encode() + b"\n")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m phalanx.launch.fork_server", description=__doc__.split("\n", 1)[0])
    parser.add_argument("--supervisor", type=int, required=True, help="the PID the workers are re-parented to")
    parser.add_argument("--main", required=True, help="the module each worker runs, as `python -m MAIN ARGS` would")
    parser.add_argument("--answers-fd", type=int, required=True, help="the pipe the answers go to")
    parser.add_argument("--preload", action="append", default=[], help="a module to import before forking (repeatable)")
    options = parser.parse_args(argv)
    with contextlib.suppress(KeyboardInterrupt, BrokenPipeError):
        serve(options.supervisor, options.answers_fd, options.preload, options.main)


if __name__ == "__main__":
    main()

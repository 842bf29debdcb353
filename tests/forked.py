"""Start `python -m gptrain ...` and the tests' worker scripts without paying Python's imports
each time: a fork of a process that has already imported torch and gptrain ("zygote").

A fresh `python -m gptrain train` spends ~5.5 s on a 2-core AVX2 EPYC importing torch (~3.5 s)
and torch._dynamo (~2 s, pulled in by torch.optim) before its first step; the tests start ~100
such processes. `Popen` and `run` here take the same arguments as subprocess's and return the
same things. A forked child is a real process of its own (pid, signals, exit code or -signal,
its own session with start_new_session, stdout and stderr as pipes, files or /dev/null, its
own cwd and environment); it differs from a fresh interpreter only in having its modules
imported already. tests/test_forked.py proves that: the same output, exit codes and signals as
a fresh process, and a training run whose weights equal a fresh process's bit for bit.

Commands that are not `python [-u] (-m MODULE | -c CODE | SCRIPT) ...` go to subprocess as
they are. An environment that differs from every zygote's in a variable read at import time
(OMP_NUM_THREADS, ATEN_*, HOME, ...) gets a zygote of its own the first time. GPTRAIN_FORK=0
turns all of this off (plain subprocess).

Per command: the client sends argv, env, cwd and its stdio fds to the zygote (a unix socket);
the zygote forks a monitor, which forks the worker and reports its pid, then its exit status.
The worker is a grandchild of the zygote, so it is never a child of pytest: poll/wait read the
monitor's report instead of waitpid.

torch.distributed.run started in a forked child (directly, or by gptrain's own launcher) starts
its workers with the interpreter its documented PYTHON_EXEC variable names; a forked child's is
a small script of its zygote's, `python`, which has the zygote fork the worker and then stands in
for it: the launcher's signals are passed on to the worker, the worker's exit code or signal is
the script's own, and killing the script kills the worker (the monitor watches its caller). So
the launcher sees what a fresh worker would give it, and each worker skips the imports. A command
or environment the zygote cannot run is exec'ed with the real interpreter, unchanged.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import hashlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

# variables read at run time, not while modules import: they may differ between children
# (pip's, for the pip a child may start; inductor's private ones, which a compile in the caller
# sets; cuBLAS's, which deterministic mode sets; the .netrc file W&B reads its key from;
# PYTHONFAULTHANDLER, which the interpreter reads at start and a child applies itself)
RUNTIME = ("GPTRAIN_", "PYTEST_", "WANDB_", "TORCHELASTIC_", "TORCH_NCCL_", "MASTER_", "SLURM_",
           "PIP_", "_TORCHINDUCTOR_")  # fmt: skip
RUNTIME_EXACT = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "PYTHON_EXEC",
                 "NCCL_ASYNC_ERROR_HANDLING", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
                 "PYTHONUNBUFFERED", "TORCH_FR_BUFFER_SIZE", "WAIT_FOR_PORT",
                 "CUBLAS_WORKSPACE_CONFIG", "NETRC", "PYTHONFAULTHANDLER"}  # fmt: skip
PRELOAD = ["numpy", "torch", "torch._dynamo", "torch.distributed", "torch.distributed.run",
           "torch.distributed.checkpoint", "matplotlib", "gptrain.__main__",
           "gptrain.commands.train", "gptrain.commands.prepare", "gptrain.commands.eval",
           "gptrain.commands.sample", "gptrain.commands.export", "gptrain.commands.bench"]  # fmt: skip


# signals a child starts ignoring when its caller ignores them, as a fresh interpreter inherits
# an ignored signal (SIGINT: a background job of a non-interactive shell starts so); also what
# the workers' interpreter passes on (torch's launcher signals the process group it leads)
PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)  # fmt: skip


def _ignored() -> list[int]:
    return [int(s) for s in PASSED_ON if signal.getsignal(s) is signal.SIG_IGN]


def _import_key(env: dict) -> tuple:
    def runtime(k):
        return k in RUNTIME_EXACT or k.startswith(RUNTIME)

    return tuple(sorted((k, v) for k, v in env.items() if not runtime(k)))


def _parse(args) -> list[str] | None:
    """argv after the interpreter when it is a form the zygote runs, else None."""
    args = [os.fspath(a) for a in args]
    if os.environ.get("GPTRAIN_FORK") == "0" or not args or args[0] != sys.executable:
        return None
    rest = args[1:]
    if rest[:1] == ["-u"]:
        rest = rest[1:]
    if rest[:1] in (["-m"], ["-c"]) and len(rest) >= 2 or rest and not rest[0].startswith("-"):
        return args[1:]
    return None


class _Zygote:
    def __init__(self, env: dict):
        self.dir = tempfile.mkdtemp(prefix="gptrain-zygote-")
        self.path = os.path.join(self.dir, "sock")
        cmd = [sys.executable, __file__, "serve", self.path]
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        deadline = time.time() + 300
        while not os.path.exists(self.path + ".ready"):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"zygote did not start (exit {self.proc.poll()})")
            time.sleep(0.05)

    def start(self, argv, env, cwd, fds, new_session) -> socket.socket:
        return _start(self.path, argv, env, cwd, fds, new_session)

    def close(self):
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def _start(path, argv, env, cwd, fds, new_session, tied=False, ignored=None) -> socket.socket:
    """Has the zygote at `path` fork `argv`; its monitor's connection (the pid, then the exit
    status). tied: the worker is SIGKILLed when this caller's end of the connection closes.
    ignored: the signals the worker starts ignoring (default: those this caller ignores)."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(path)
    req = dict(argv=argv, env=env, cwd=os.fspath(cwd or os.getcwd()), session=new_session)
    req.update(tied=tied, ignored=_ignored() if ignored is None else ignored)
    socket.send_fds(conn, [json.dumps(req).encode()], fds)
    return conn


_ZYGOTES: dict[tuple, _Zygote] = {}


def _zygote(env: dict) -> _Zygote:
    key = _import_key(env)
    if key not in _ZYGOTES:
        _ZYGOTES[key] = _Zygote(env)
    return _ZYGOTES[key]


@atexit.register
def _stop_all():
    for z in _ZYGOTES.values():
        z.close()


class Forked:
    """The part of subprocess.Popen the tests use, for a process forked by a zygote."""

    def __init__(self, args, argv, env, cwd, stdout, stderr, text, start_new_session):
        self.args, self.returncode, self.stdin = args, None, None
        env = dict(os.environ if env is None else env)
        fds, self._close_after, parent_ends = [], [], {}
        for name, spec in (("stdin", subprocess.DEVNULL), ("stdout", stdout), ("stderr", stderr)):
            if spec is None:
                fds.append({"stdin": 0, "stdout": 1, "stderr": 2}[name])
            elif spec == subprocess.DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                fds.append(fd), self._close_after.append(fd)
            elif spec == subprocess.PIPE:
                r, w = os.pipe()
                fds.append(w), self._close_after.append(w)
                parent_ends[name] = r
            elif spec == subprocess.STDOUT and name == "stderr":
                fds.append(fds[1])
            else:
                fds.append(spec if isinstance(spec, int) else spec.fileno())
        self._conn = _zygote(env).start(argv, env, cwd, fds, start_new_session)
        for fd in self._close_after:
            os.close(fd)
        for name in ("stdout", "stderr"):
            r = parent_ends.get(name)
            f = None if r is None else open(r, "r" if text else "rb", encoding="utf-8" if text else None)  # fmt: skip
            setattr(self, name, f)
        self.pid = int(self._conn.recv(64))
        self._readers: dict[str, tuple[threading.Thread, list]] = {}

    def poll(self):
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._collect()
        return self.returncode

    def _collect(self):
        msg = self._conn.recv(64)
        self.returncode = int(msg) if msg else -signal.SIGKILL  # monitor gone: treat as killed
        self._conn.close()

    def wait(self, timeout=None):
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._collect()
        return self.returncode

    def communicate(self, input=None, timeout=None):
        assert input is None, "stdin is /dev/null for forked processes"
        deadline = None if timeout is None else time.monotonic() + timeout
        for name in ("stdout", "stderr"):
            f = getattr(self, name)
            if f is not None and name not in self._readers:
                chunks: list = []
                t = threading.Thread(target=lambda f=f, c=chunks: c.append(f.read()), daemon=True)
                t.start()
                self._readers[name] = (t, chunks)
        for t, _ in self._readers.values():
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        out = []
        for name in ("stdout", "stderr"):
            if name in self._readers:
                out.append(self._readers[name][1][0])
                getattr(self, name).close()
            else:
                out.append(None)
        return tuple(out)

    def send_signal(self, sig):
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.wait()


def Popen(args, *, env=None, cwd=None, stdin=None, stdout=None, stderr=None, text=False, start_new_session=False):  # fmt: skip
    """subprocess.Popen for `python ...` commands, forked from a zygote where it can be (its
    stdin is always /dev/null)."""
    argv = _parse(args)
    if argv is None or stdin not in (None, subprocess.DEVNULL):
        return subprocess.Popen(args, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr, text=text, start_new_session=start_new_session)  # fmt: skip
    return Forked(args, argv, env, cwd, stdout, stderr, text, start_new_session)


def run(args, *, env=None, cwd=None, capture_output=False, stdin=None, stdout=None, stderr=None, text=False, timeout=None, check=False, start_new_session=False):  # fmt: skip
    """subprocess.run for `python ...` commands, forked from a zygote where it can be."""
    if capture_output:
        stdout = stderr = subprocess.PIPE
    proc = Popen(args, env=env, cwd=cwd, stdin=stdin, stdout=stdout, stderr=stderr, text=text, start_new_session=start_new_session)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    done = subprocess.CompletedProcess(args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


# --- the workers' interpreter (PYTHON_EXEC in forked children) -------------------------------


def _key_digest(env) -> str:
    return hashlib.sha256(json.dumps(_import_key(env)).encode()).hexdigest()


def _write_interpreter(path: str, digest: str) -> str:
    """The zygote's `python` script (PYTHON_EXEC of its forked children), beside its socket;
    digest: its environment's, before preloading (which sets some variables)."""
    script = os.path.join(os.path.dirname(path), "python")
    here = os.path.dirname(os.path.abspath(__file__))
    with open(script, "w") as f:  # -S: the script needs only the standard library
        f.write(f"#!{sys.executable} -S\nimport sys\nsys.path.insert(0, {here!r})\n")
        f.write(f"import forked\nforked.as_python({path!r}, {digest!r})\n")
    os.chmod(script, 0o755)
    return script


def as_python(path: str, digest: str) -> None:
    """`python ARGS...` as the zygote at `path` runs it: forked, with this process standing in
    for the worker (signals passed on, its exit code or signal returned, killed with it)."""
    args = [sys.executable, *sys.argv[1:]]
    argv = _parse(args)
    if argv is None or _key_digest(os.environ) != digest:
        os.execv(sys.executable, args)  # not the zygote's to run: a fresh interpreter, as asked
    pending, worker = [], []  # signals that came before the worker's pid; its pid

    def pass_on(sig, _frame):
        if not worker:
            pending.append(sig)
            return
        try:
            os.kill(worker[0], sig)
        except ProcessLookupError:  # it has ended; its status is on its way
            pass

    # a signal that lands between Python's last check and a blocking recv would wait for the
    # recv (here: for the worker's end, which it was meant to cause); its byte on the wakeup
    # pipe ends the select instead, and the handler runs right after
    wake_r, wake_w = os.pipe()
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)

    def receive(conn) -> bytes:
        while conn not in select.select([conn, wake_r], [], [])[0]:
            os.read(wake_r, 512)
        return conn.recv(64)

    ignored = _ignored()  # the worker starts ignoring them too; it may handle them later
    for sig in PASSED_ON:
        signal.signal(sig, pass_on)
    conn = _start(path, argv, dict(os.environ), None, [0, 1, 2], True, True, ignored)
    worker.append(int(receive(conn)))
    for sig in pending:
        pass_on(sig, None)
    msg = receive(conn)
    code = int(msg) if msg else -signal.SIGKILL
    if code < 0:  # ended by a signal: end by the same one
        for sig in PASSED_ON:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(code)


# --- the zygote (runs as `python tests/forked.py serve SOCKET`) ------------------------------


def _prime_inspect() -> None:
    """torch's elastic agent names each rendezvous event by `inspect.stack()`, which looks every
    frame's file up among the loaded modules; a file that is no module's (the stdlib's frozen
    runpy, this file once a child's __main__ replaces it) makes each lookup scan all ~1,300
    preloaded modules: ~0.5 s of CPU an agent. One scan here fills inspect's cache, those files
    included, so that a child's lookups are dictionary hits."""
    import inspect

    sys.modules["_forked_zygote"] = sys.modules["__main__"]
    inspect.getmodule(sys._getframe())  # fills inspect.modulesbyfile from every loaded module
    for name, module in list(sys.modules.items()):
        if getattr(getattr(module, "__spec__", None), "origin", None) == "frozen":
            inspect.modulesbyfile[f"<frozen {name}>"] = name


def _serve(path: str) -> None:
    import importlib

    digest = _key_digest(os.environ)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    try:  # gptrain's plots (logs/plot.py): a Figure and the Agg canvas (~0.5-1 s to import)
        import matplotlib.backends.backend_agg  # noqa: F401
        import matplotlib.figure  # noqa: F401
    except ImportError:
        pass
    _prime_inspect()
    # forking a process with Python threads is unsafe; numpy's OpenBLAS starts an OS thread of
    # its own, which it shuts down and restarts around fork (pthread_atfork)
    if threading.active_count() != 1:
        raise SystemExit(f"zygote: preloading started threads {threading.enumerate()}")
    # the preloaded modules live as long as every child: the cyclic collector of a child skips
    # them (a full collection over torch's objects takes ~0.3 s, and would write to every page)
    gc.freeze()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # monitors are reaped by the kernel
    # the workers' interpreter of children whose environment names none of its own
    os.environ["PYTHON_EXEC"] = _write_interpreter(path, digest)
    parent = os.getppid()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(path)
    server.listen(64)
    server.settimeout(1.0)
    open(path + ".ready", "w").close()
    while os.getppid() == parent:  # pytest gone: stop
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        if os.fork() == 0:
            server.close()
            _monitor(conn, json.loads(msg), fds)
        conn.close()
        for fd in fds:
            os.close(fd)


def _monitor(conn, req, fds) -> None:
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    ready_r, ready_w = os.pipe()  # as Popen: the session and stdio are set up when it returns
    pid = os.fork()
    if pid == 0:
        try:
            conn.close()
            os.close(ready_r)
            _child(req, fds, ready_w)  # ends the process itself
        except BaseException:  # a failed set-up (a missing cwd, ...): never back to the loop
            import traceback

            traceback.print_exc()
        finally:
            os._exit(127)
    for fd in (*fds, ready_w):
        os.close(fd)
    try:
        os.read(ready_r, 1)
        try:
            conn.send(str(pid).encode())
            # tied: until the worker ends, killed if its caller ends first (the caller sends
            # nothing: its end is readable once it is closed)
            if req["tied"] and conn in select.select([conn, os.pidfd_open(pid)], [], [])[0]:
                os.kill(pid, signal.SIGKILL)
        except OSError:  # the caller has gone (its end reset: the pid unread)
            if not req["tied"]:
                raise
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        conn.send(str(os.waitstatus_to_exitcode(status)).encode())
    finally:
        os._exit(0)


def _child(req, fds, ready: int) -> None:
    import inspect
    import runpy
    import traceback
    import types

    if req["session"]:
        os.setsid()
    for sig in PASSED_ON:  # as the caller's fresh interpreter would start, not as the zygote
        default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
        signal.signal(sig, signal.SIG_IGN if sig in req["ignored"] else default)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    os.chdir(req["cwd"])
    python = os.environ["PYTHON_EXEC"]
    os.environ.clear()
    os.environ.update(req["env"])
    os.environ.setdefault("PYTHON_EXEC", python)
    if os.environ.get("PYTHONFAULTHANDLER"):  # as a fresh interpreter: on, writing to stderr
        faulthandler.enable()
    else:
        faulthandler.disable()
    os.write(ready, b"1")
    os.close(ready)
    argv = list(req["argv"])
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    if argv[0] == "-u":
        argv, unbuffered = argv[1:], True
    sys.stdout.reconfigure(write_through=unbuffered)
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()
            for name in (argv[1], argv[1] + ".__main__"):  # preloaded: run afresh, as python -m
                sys.modules.pop(name, None)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            inspect.modulesbyfile["<string>"] = "__main__"  # as _prime_inspect: no rescans
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv = argv
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)  # as Python does: end by the signal
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()  # as at interpreter exit: wait for non-daemon threads, then atexit
    atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:
            pass
    os._exit(code & 0xFF)


if __name__ == "__main__" and sys.argv[1:2] == ["serve"]:
    _serve(sys.argv[2])

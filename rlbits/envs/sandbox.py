"""A sandboxed Python tool.

``run_python(code)`` runs ``code`` in a fresh interpreter (``python -I -S``: no site-packages, no ``PYTHON*``
variables) inside an operating-system sandbox and returns a :class:`SandboxResult`; ``python(code)`` is the
same as a tool (it returns text for the model), and ``python_tool(sandbox=...)`` builds that tool for a
chosen sandbox, checking at once that the sandbox works. The ``bwrap`` command line and seccomp filter are
built in ``rlbits.envs._bwrap``.

Two sandboxes (the ``sandbox`` argument; a run config's ``sandbox`` field):

- ``"bwrap"`` (default): the boundary is the operating system, through bubblewrap (``bwrap``, Debian package
  ``bubblewrap``). Where ``bwrap`` is missing or fails its self-test, no tool code runs:
  :class:`SandboxUnavailableError`, saying how to install it.
- ``"unsafe_local"``: no OS isolation. Only the rlimits, a ``nobody`` uid (root parent), ``unshare -n`` (where
  it works), a host temporary work dir (left behind if the parent is killed with kill -9) and the audit hook
  (``sys.addaudithook``: file access outside the work dir and the stdlib, sockets, processes, ``ctypes``),
  which code that gets past Python's own rules defeats. Output also comes through pipes. Chosen explicitly
  only.

What ``"bwrap"`` guarantees (Linux; each item says what enforces it; ``tests/envs/test_sandbox_escape.py`` tries
each):

- **The boundary does not depend on the code's good will.** Everything below is set up by ``bwrap`` and the
  kernel before the user code runs; the audit hook inside (see ``unsafe_local``) is defence in depth only.
- **Files.** A new mount namespace holding only, read-only: ``/usr/lib*`` and ``/lib*`` (shared libraries),
  the interpreter's prefix (its standard library), a minimal ``/dev`` (``null``, ``zero``, ``urandom``, ...;
  read-only apart from the devices), ``/etc/ld.so.cache`` and an empty read-only root. No ``/proc``,
  ``/sys``, no other ``/etc``, ``/home``, ``/root`` (beyond the interpreter's prefix), ``/run``, host
  ``/tmp``, repository, run directory or shell. The only writable place is the call's own work dir ``/sandbox`` (``/tmp`` links to
  it): a fresh tmpfs that exists only in that namespace, gone when the call ends or its parent dies (nothing
  is left on the host).
- **Disk.** The work dir is a tmpfs of ``max_disk_bytes`` (``bwrap --size``): the total a call can write,
  across all files. ``RLIMIT_FSIZE`` caps each file at ``max_file_bytes``, ``RLIMIT_NOFILE`` its open files.
- **Output.** stdout and stderr are pipes the parent owns; it keeps at most ``max_output_chars`` characters of
  each (draining the rest, up to the wall-clock limit), and never reads a path the child could replace.
- **Time.** ``RLIMIT_CPU`` (SIGXCPU, then SIGKILL at the hard limit) and a wall-clock deadline on the parent's
  read loop and wait: past it the parent kills ``bwrap``, which takes the whole PID namespace with it.
- **Memory.** ``RLIMIT_AS``: an allocation beyond ``memory_mb`` fails with ``MemoryError``.
- **Processes.** A new PID namespace (the child sees no host process, so it can signal or ptrace none).
  ``RLIMIT_NPROC = 0``: ``fork``/``clone``/threads fail with EAGAIN (the kernel applies this limit to a
  non-root uid: under a root parent the child becomes ``nobody``, 65534, before any user code runs; it keeps
  no capability, and ``no_new_privs`` is set). ``--die-with-parent`` and the PID namespace: the child dies
  with the parent, also on kill -9.
- **Network.** A new network namespace with only its own loopback: no connection to anything outside, the
  host's 127.0.0.1 and abstract unix sockets included. New IPC and UTS namespaces too.
- **Environment.** Empty (``--clearenv``, and ``bwrap`` itself is started with an empty environment, so no
  process in the sandbox holds the parent's variables).
- **Kernel surface** (when ``libseccomp`` is installed, Debian ``libseccomp2``): a seccomp filter refuses
  ``unshare``, ``setns``, ``mount`` and the other mount calls, ``ptrace``, ``process_vm_*``, ``keyctl``,
  ``bpf``, ``perf_event_open``, ``userfaultfd``, module and kexec calls, and ``clone`` with namespace flags
  (``clone3`` gets ENOSYS). Without a user namespace of its own (a root parent) this is what stops the child
  from making a new user and mount namespace (and a tmpfs outside the disk bound). ``SandboxResult.seccomp``
  says whether the filter was in place.

What it does not guarantee: the kernel is shared (a kernel exploit escapes any namespace sandbox); CPU time
beyond ``cpu_seconds`` and memory are per call, not per machine (many parallel calls add up; no cgroup); the
read-only view still shows the system's shared libraries and the interpreter's prefix (public files);
``max_disk_bytes`` of tmpfs is memory, not disk. Run untrusted code at scale in a VM.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

from rlbits.envs._bwrap import bwrap_argv, seccomp_program

NOBODY = 65534
SANDBOXES = ("bwrap", "unsafe_local")
INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap; Fedora: dnf install bubblewrap), or set "
    "sandbox: unsafe_local to run tool code without OS isolation (not a security boundary)"
)

# ``unsafe_local`` under root: imported before privileges drop, because the interpreter may live where
# ``nobody`` cannot read (e.g. a pyenv under /root). ``socket`` is preloaded so that the audit hook and the
# namespace, not a missing module, are what stop it. (Under bwrap the prefix is bound readable.)
PRELOAD = (
    "math cmath fractions decimal statistics random itertools functools operator collections heapq bisect re "
    "string json datetime calendar copy enum dataclasses typing numbers textwrap unicodedata array struct "
    "hashlib base64 time io socket encodings.idna"
).split()

# The child's first code: drop privileges, set limits, read the user code from stdin, install the audit hook,
# run the code as a fresh ``__main__`` module. A string (``-c``): nothing outside the stdlib is imported.
_BOOTSTRAP = r"""
import sys, os, resource, json
cfg = json.loads(sys.argv[1])
_m = None
for _m in cfg["preload"]:
    try:
        __import__(_m)
    except Exception:
        pass
if cfg["uid"] is not None:
    os.setgroups([])
    os.setgid(cfg["gid"])
    os.setuid(cfg["uid"])
_cpu = cfg["cpu"]
resource.setrlimit(resource.RLIMIT_CPU, (_cpu, _cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (cfg["mem"], cfg["mem"]))
resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))
resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["fsize"], cfg["fsize"]))
resource.setrlimit(resource.RLIMIT_NOFILE, (cfg["nofile"], cfg["nofile"]))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if hasattr(resource, "RLIMIT_MSGQUEUE"):
    resource.setrlimit(resource.RLIMIT_MSGQUEUE, (0, 0))
_code = sys.stdin.buffer.read().decode("utf-8", errors="replace")
_null = os.open(os.devnull, os.O_RDONLY)
os.dup2(_null, 0)
os.close(_null)


def _install_hook(readable_extra):
    root = os.path.realpath(os.getcwd())
    readable = tuple(os.path.realpath(p) for p in sys.path if p) + readable_extra
    W = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    deny = frozenset(
        "os.system os.exec os.posix_spawn os.spawn os.fork os.forkpty subprocess.Popen ctypes.dlopen "
        "ctypes.dlsym ctypes.cdata socket.__new__ socket.connect socket.bind socket.getaddrinfo "
        "socket.gethostbyname socket.sendto os.kill os.killpg signal.pthread_kill gc.get_objects "
        "gc.get_referrers gc.get_referents".split()
    )
    deny_imports = frozenset(("ctypes", "_ctypes", "_posixsubprocess", "subprocess", "multiprocessing"))
    # event -> number of leading path arguments; CPython passes dir_fd last (two for rename and link), -1
    # when it is not given
    paths = {"os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.chmod": 1, "os.chown": 1, "os.utime": 1,
             "os.truncate": 1, "os.chflags": 1, "os.lchflags": 1, "os.setxattr": 1, "os.removexattr": 1,
             "shutil.rmtree": 1, "os.rename": 2, "os.symlink": 2, "os.link": 2}
    two_dir_fds = ("os.rename", "os.link")
    realpath, sep, fsdecode = os.path.realpath, os.sep, os.fsdecode

    def inside(path, roots):
        p = realpath(fsdecode(path))
        return any(p == r or p.startswith(r.rstrip(sep) + sep) for r in roots)

    def hook(event, args):
        if event == "open":
            path, mode, flags = args
            if path is None or isinstance(path, int):
                return
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & W)
            if writing and not inside(path, (root,)):
                raise PermissionError(f"sandbox: writing outside the working directory is not allowed: {path}")
            if not writing and not inside(path, (root,) + readable):
                raise PermissionError(f"sandbox: reading outside the working directory is not allowed: {path}")
        elif event in deny or event.startswith("os.exec") or event.startswith("os.spawn"):
            raise PermissionError(f"sandbox: {event} is not allowed")
        elif event == "object.__setattr__" and args[1] in ("__code__", "__closure__"):
            raise PermissionError(f"sandbox: setting {args[1]} is not allowed")
        elif event == "import" and args[0].split(".")[0] in deny_imports:
            raise ImportError(f"sandbox: importing {args[0]} is not allowed")
        elif event in paths:
            for p in args[: paths[event]]:
                if isinstance(p, int) or not inside(p, (root,)):
                    raise PermissionError(f"sandbox: {event} outside the working directory is not allowed: {p}")
            if event != "os.truncate":
                fds = args[-2:] if event in two_dir_fds else args[-1:]
                if any(fd not in (None, -1, -100) for fd in fds):
                    raise PermissionError(f"sandbox: {event} with dir_fd is not allowed")

    sys.addaudithook(hook)


if cfg["hooks"]:
    _install_hook(("/dev/null", "/dev/urandom", "/dev/random"))
_main = type(sys)("__main__")
_main.__builtins__ = __builtins__
sys.modules["__main__"] = _main
sys.argv = ["main.py"]
del cfg, _m, _cpu, _install_hook, resource, json
exec(compile(_code, "main.py", "exec"), _main.__dict__)
"""

# The child interpreter's arguments: isolated (no ``PYTHON*`` variables, no user site), no ``site``, UTF-8.
_CHILD_ARGS = ("-I", "-S", "-X", "utf8", "-c", _BOOTSTRAP)


class SandboxUnavailableError(RuntimeError):
    """No OS isolation for tool code here (``bwrap`` missing or failing its self-test); the message says why
    and how to install it."""


@dataclass(frozen=True)
class SandboxResult:
    """What one ``run_python`` call produced.

    ``stdout``/``stderr``: decoded text, each cut to ``max_output_chars`` (``truncated`` says whether anything
    was cut). ``returncode``: the child's exit status (negative: killed by that signal, e.g. -9 after the
    wall-clock timeout, -24 SIGXCPU after the CPU limit; under ``bwrap`` an exit status 128+N from the sandbox
    reads as signal N, as a shell reports it). ``timed_out``: the wall-clock limit was hit.
    ``network_namespace``: the child ran in an empty network namespace. ``sandbox``: ``"bwrap"`` or
    ``"unsafe_local"``. ``seccomp``: a seccomp filter was in place. ``seconds``: wall time.
    """

    stdout: str
    stderr: str
    returncode: int
    timed_out: bool
    truncated: bool
    network_namespace: bool
    seconds: float
    sandbox: str = "bwrap"
    seccomp: bool = False

    @property
    def ok(self) -> bool:
        """Exited with status 0 within the time limit."""
        return self.returncode == 0 and not self.timed_out

    def reason(self) -> str:
        """A short human-readable description of how the run ended."""
        if self.timed_out:
            return "killed: wall-clock timeout"
        if self.returncode == -signal.SIGXCPU or self.returncode == -signal.SIGKILL:
            return "killed: CPU time limit"
        if self.returncode < 0:
            try:
                return f"killed by signal {signal.Signals(-self.returncode).name}"
            except ValueError:
                return f"killed by signal {-self.returncode}"
        return f"exit status {self.returncode}"


@functools.cache
def _unshare_prefix() -> tuple[str, ...]:
    """``unsafe_local``: the command prefix that puts the child in a new, empty network namespace, or ``()``."""
    exe = shutil.which("unshare")
    if exe is None or not sys.platform.startswith("linux"):
        return ()
    prefix = (exe, "-n") if os.geteuid() == 0 else (exe, "-r", "-n")
    try:
        ok = subprocess.run([*prefix, "true"], env={}, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return prefix if ok else ()


def _collect(
    argv: list[str], *, cwd: str | None, pass_fds: tuple[int, ...], code: bytes, timeout_s: float, keep: int
) -> tuple[int, bytes, bytes, int, int, bool, float]:
    """Start ``argv`` with ``code`` on its stdin; read its stdout and stderr through pipes, keeping at most
    ``keep`` bytes of each (the rest is drained and counted) until both close and it exits, or until
    ``timeout_s`` seconds, when its process group is killed. Returns ``(returncode, stdout, stderr,
    stdout_bytes, stderr_bytes, timed_out, seconds)``."""
    start = time.monotonic()
    deadline = start + timeout_s
    proc = subprocess.Popen(
        argv,
        cwd=cwd,
        env={},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group, killed as a whole
        close_fds=True,
        pass_fds=pass_fds,
    )
    try:
        out_fd, err_fd, in_fd = proc.stdout.fileno(), proc.stderr.fileno(), proc.stdin.fileno()
        bufs = {out_fd: bytearray(), err_fd: bytearray()}
        totals = {out_fd: 0, err_fd: 0}
        pending = memoryview(code)
        timed_out = False
        with selectors.DefaultSelector() as sel:
            sel.register(out_fd, selectors.EVENT_READ)
            sel.register(err_fd, selectors.EVENT_READ)
            os.set_blocking(in_fd, False)
            sel.register(in_fd, selectors.EVENT_WRITE)
            while len(sel.get_map()) > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                for key, _ in sel.select(left):
                    if key.fd == in_fd:
                        try:
                            pending = pending[os.write(in_fd, pending[:65536]) :]
                        except BlockingIOError:
                            continue
                        except OSError:  # the child closed its stdin
                            pending = pending[:0]
                        if not pending:
                            sel.unregister(in_fd)
                            proc.stdin.close()
                        continue
                    data = os.read(key.fd, 65536)
                    if not data:
                        sel.unregister(key.fd)
                        continue
                    totals[key.fd] += len(data)
                    room = keep - len(bufs[key.fd])
                    if room > 0:
                        bufs[key.fd] += data[:room]
    except BaseException:  # an interrupt or an OS error while reading: leave nothing running
        _kill(proc)
        raise
    if not timed_out:
        try:  # both pipes closed: the child may still be running (it closed them itself)
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    if timed_out:
        _kill(proc)
    for f in (proc.stdin, proc.stdout, proc.stderr):
        f.close()
    seconds = time.monotonic() - start
    return (
        proc.returncode,
        bytes(bufs[out_fd]),
        bytes(bufs[err_fd]),
        totals[out_fd],
        totals[err_fd],
        timed_out,
        seconds,
    )


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s process group (under bwrap its PID namespace goes with it) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _text(data: bytes, total: int, limit: int) -> tuple[str, bool]:
    text = data.decode("utf-8", errors="replace")
    if len(text) > limit or total > len(data):
        return text[
            :limit
        ] + f"\n[... output truncated: {total} bytes in all, {limit} characters shown]", True
    return text, False


def _run_bwrap(bwrap: str, code: str, cfg: dict, *, timeout_s: float, keep: int, disk_bytes: int):
    program = seccomp_program()
    read_fd = None
    if program is not None:
        read_fd, write_fd = os.pipe()
        try:
            os.write(write_fd, program)  # a few hundred bytes: fits the pipe's buffer
        finally:
            os.close(write_fd)
    try:
        head, exe = bwrap_argv(bwrap, disk_bytes, read_fd)
        root = os.geteuid() == 0
        cfg = {**cfg, "preload": [], "uid": NOBODY if root else None, "gid": NOBODY if root else None}
        argv = [*head, "--", exe, *_CHILD_ARGS, json.dumps(cfg)]
        rc, *rest = _collect(
            argv, cwd="/", pass_fds=() if read_fd is None else (read_fd,), code=code.encode("utf-8", "replace"),
            timeout_s=timeout_s, keep=keep,
        )
    finally:
        if read_fd is not None:
            os.close(read_fd)
    if rc > 128 and (rc - 128) in signal.valid_signals():  # bwrap reports a child killed by signal N as 128+N
        rc = 128 - rc
    return (rc, *rest), program is not None


@functools.cache
def _bwrap_problem(bwrap: str | None) -> str | None:
    """Why ``bwrap`` cannot be the sandbox here (``None`` when it can): it is missing, or a sandboxed
    ``print(6 * 7)`` does not print 42. Cached per ``bwrap`` path for the process."""
    if not sys.platform.startswith("linux"):
        return f"bubblewrap needs Linux (this is {sys.platform})"
    if bwrap is None:
        return "bubblewrap (bwrap) is not installed (not found on PATH)"
    cfg = {"cpu": 5, "mem": 512 << 20, "fsize": 1 << 20, "nofile": 32, "hooks": True}
    try:
        (rc, out, err, *_), _ = _run_bwrap(
            bwrap, "print(6 * 7)", cfg, timeout_s=30.0, keep=4096, disk_bytes=1 << 20
        )
    except OSError as e:
        return f"{bwrap} could not be started: {e}"
    if rc != 0 or out != b"42\n":
        detail = err.decode("utf-8", "replace").strip()[-500:] or f"exit status {rc}, output {out[:100]!r}"
        return f"{bwrap} failed its self-test (a sandboxed print(6 * 7)): {detail}"
    return None


def check_sandbox(sandbox: str = "bwrap") -> None:
    """Check that tool code can run under ``sandbox`` here; for ``"bwrap"`` this runs a self-test once per
    process.

    Raises:
        ValueError: ``sandbox`` is not one of ``SANDBOXES``.
        SandboxUnavailableError: ``"bwrap"`` and bubblewrap is missing or fails its self-test (the message
            says why and how to install it).
    """
    if sandbox not in SANDBOXES:
        raise ValueError(f"sandbox must be one of {', '.join(SANDBOXES)}; got {sandbox!r}")
    if sandbox == "bwrap":
        problem = _bwrap_problem(shutil.which("bwrap"))
        if problem is not None:
            raise SandboxUnavailableError(f"cannot run tool code in a sandbox: {problem}; {INSTALL_HINT}")


def run_python(
    code: str,
    *,
    sandbox: str = "bwrap",
    timeout_s: float = 5.0,
    cpu_seconds: int = 2,
    memory_mb: int = 256,
    max_output_chars: int = 4000,
    max_file_bytes: int = 1 << 20,
    max_disk_bytes: int = 8 << 20,
    max_open_files: int = 32,
    network_namespace: bool = True,
    _audit_hooks: bool = True,
) -> SandboxResult:
    """Run ``code`` in a fresh, limited Python subprocess (see the module docstring for the guarantees).

    Args:
        code: Python source, run as ``__main__`` in a new, empty working directory.
        sandbox: ``"bwrap"`` (OS isolation, the default) or ``"unsafe_local"`` (audit hook and rlimits only:
            not a security boundary).
        timeout_s: wall-clock limit; the child's process group is killed (SIGKILL) when it runs out, whether or
            not it still writes or holds its output open.
        cpu_seconds: ``RLIMIT_CPU`` soft limit (an integer >= 1; the hard limit is one more).
        memory_mb: ``RLIMIT_AS`` in MiB (the interpreter itself needs about 30).
        max_output_chars: at most this many characters of stdout and of stderr come back.
        max_file_bytes: ``RLIMIT_FSIZE``: the largest file the child may write.
        max_disk_bytes: ``"bwrap"``: size of the work dir's tmpfs, the most the call can write in all.
            ``"unsafe_local"`` has no total bound (``max_file_bytes`` per file, ``max_open_files`` open).
        max_open_files: ``RLIMIT_NOFILE``.
        network_namespace: ``"unsafe_local"``: run under ``unshare -n`` when it works (the audit hook blocks
            sockets either way). ``"bwrap"`` always has an empty network namespace.
        _audit_hooks: tests only: ``False`` leaves out the audit hook, to check that the rest holds alone.

    Returns:
        a :class:`SandboxResult`; a timeout, a limit or an exception in ``code`` is reported there, not raised.

    Raises:
        TypeError: ``code`` is not a string. ValueError: a limit is not positive, or an unknown ``sandbox``.
        SandboxUnavailableError: ``sandbox="bwrap"`` and bubblewrap is missing or fails its self-test.
    """
    if not isinstance(code, str):
        raise TypeError(f"run_python: code must be a str, got {type(code).__name__}")
    for name, value in (("timeout_s", timeout_s), ("cpu_seconds", cpu_seconds), ("memory_mb", memory_mb),
                        ("max_output_chars", max_output_chars), ("max_file_bytes", max_file_bytes),
                        ("max_disk_bytes", max_disk_bytes), ("max_open_files", max_open_files)):
        if not value > 0:
            raise ValueError(f"run_python: {name} must be > 0, got {value}")
    check_sandbox(sandbox)
    cfg = {
        "cpu": int(math.ceil(cpu_seconds)),
        "mem": int(memory_mb) << 20,
        "fsize": int(max_file_bytes),
        "nofile": int(max_open_files),
        "hooks": _audit_hooks,
    }
    keep = 4 * int(max_output_chars) + 4  # at most 4 bytes a character in UTF-8
    if sandbox == "bwrap":
        (rc, out, err, n_out, n_err, timed_out, seconds), seccomp = _run_bwrap(
            shutil.which("bwrap"), code, cfg, timeout_s=timeout_s, keep=keep, disk_bytes=int(max_disk_bytes)
        )
        netns = True
    else:
        (rc, out, err, n_out, n_err, timed_out, seconds), netns = _run_local(
            code, cfg, timeout_s=timeout_s, keep=keep, network_namespace=network_namespace
        )
        seccomp = False
    stdout, cut_out = _text(out, n_out, max_output_chars)
    stderr, cut_err = _text(err, n_err, max_output_chars)
    return SandboxResult(
        stdout=stdout,
        stderr=stderr,
        returncode=rc,
        timed_out=timed_out,
        truncated=cut_out or cut_err,
        network_namespace=netns,
        seconds=seconds,
        sandbox=sandbox,
        seccomp=seccomp,
    )


def _run_local(code: str, cfg: dict, *, timeout_s: float, keep: int, network_namespace: bool):
    drop = os.geteuid() == 0  # RLIMIT_NPROC does not apply to root: run as nobody
    prefix = _unshare_prefix() if network_namespace else ()
    cfg = {**cfg, "preload": PRELOAD if drop else [], "uid": NOBODY if drop else None,
           "gid": NOBODY if drop else None}
    workdir = tempfile.mkdtemp(prefix="rlbits-sandbox-")
    try:
        if drop:
            os.chown(workdir, NOBODY, NOBODY)
        argv = [*prefix, sys.executable, *_CHILD_ARGS, json.dumps(cfg)]
        result = _collect(
            argv,
            cwd=workdir,
            pass_fds=(),
            code=code.encode("utf-8", "replace"),
            timeout_s=timeout_s,
            keep=keep,
        )
        return result, bool(prefix)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


_PYTHON_DOC = """Run Python code in a sandbox and return what it printed.

    The code runs in a fresh interpreter with no network, no access to files outside a temporary directory,
    and limits on time (5 s), memory (256 MiB) and output (4000 characters). Use print() to show results.

    Args:
        code: The Python source code to run.
    """


def _tool_text(r: SandboxResult) -> str:
    parts = [r.stdout.rstrip("\n")] if r.stdout else []
    if r.stderr:
        parts.append("stderr:\n" + r.stderr.rstrip("\n"))
    if not r.ok:
        parts.append(f"[{r.reason()}]")
    return "\n".join(parts) if parts else "[no output]"


def python(code: str) -> str:
    return _tool_text(run_python(code))


python.__doc__ = _PYTHON_DOC


def python_tool(sandbox: str = "bwrap", **limits) -> Callable[[str], str]:
    """The ``python`` tool (text for the model) running under ``sandbox`` with ``run_python``'s ``limits``,
    for a ``ToolRegistry``; a task's ``make_env`` builds it from the run config's ``sandbox``.

    Checks the sandbox now (``check_sandbox``), so a machine without bubblewrap fails before the first episode
    rather than in every tool call.

    Raises:
        ValueError: an unknown ``sandbox``. TypeError: an unknown limit.
        SandboxUnavailableError: ``"bwrap"`` and bubblewrap is missing or fails its self-test.
    """
    inspect.signature(run_python).bind("", sandbox=sandbox, **limits)  # TypeError for an unknown limit
    check_sandbox(sandbox)

    def python(code: str) -> str:
        return _tool_text(run_python(code, sandbox=sandbox, **limits))

    python.__doc__ = _PYTHON_DOC
    return python

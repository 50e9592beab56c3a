"""A sandboxed Python tool and an exact calculator tool.

``run_python(code)`` runs ``code`` in a fresh interpreter (``python -I -S``: no site-packages, no
``PYTHON*`` variables, no user site) and returns a :class:`SandboxResult`; ``python(code)`` is the same as a tool
(it returns text for the model). ``calculator(expression)`` evaluates arithmetic by walking the ``ast``; it never
calls ``eval``.

What the sandbox guarantees (Linux; each item says what enforces it):

- **Time.** ``RLIMIT_CPU`` (the kernel sends SIGXCPU, then SIGKILL at the hard limit) and a wall-clock timeout
  after which the parent kills the child's process group (SIGKILL).
- **Memory.** ``RLIMIT_AS``: an allocation beyond ``memory_mb`` fails with ``MemoryError``.
- **Processes.** ``RLIMIT_NPROC = 0``, set in the child before any user code runs: ``fork``/``clone`` fail with
  EAGAIN. The kernel does not apply this limit to root, so when the parent runs as root the child first drops to
  ``nobody`` (uid/gid 65534, no supplementary groups, which also drops every capability). ``os.fork``, ``os.exec*``,
  ``os.system``, ``os.posix_spawn``, ``subprocess`` and ``ctypes`` are also refused by an audit hook.
- **Files.** The child runs in its own temporary directory (deleted afterwards). ``RLIMIT_FSIZE`` caps every file
  it writes, ``RLIMIT_NOFILE`` its open files. An audit hook (``sys.addaudithook``) refuses opening for writing,
  creating, removing, renaming, linking or changing the mode of any path outside that directory (symlinks are
  resolved first), and reading outside it except the interpreter's standard library and ``/dev/null``,
  ``/dev/urandom``. Under root the child is also ``nobody``, so the kernel refuses writes to what ``nobody``
  cannot write (the repository, ``/root``) even without the hook.
- **Network.** When ``unshare -n`` works (root, or ``unshare -rn`` with unprivileged user namespaces) the child
  runs in an empty network namespace: no interface but a down loopback, so no connection can be made even
  without the hook. Always: the audit hook refuses ``socket.socket``, ``connect``, ``bind`` and ``getaddrinfo``.
  :attr:`SandboxResult.network_namespace` says whether the namespace was in place.
- **Environment.** The child's environment is empty; ``/proc`` (other processes' ``environ``) is not readable.
- **Output.** stdout and stderr go to files capped by ``RLIMIT_FSIZE``; at most ``max_output_chars`` of each
  come back, with a note saying how much was cut.

What it does not guarantee: audit hooks are not a security boundary (CPython documents them as such): code that
finds a way around them (a C extension loaded some way other than ``ctypes``, an interpreter bug) is held only by
the kernel limits above, the ``nobody`` uid (root parent only) and the network namespace (when available). The
file rules then come down to Unix permissions: as a non-root user the child can write whatever that user can.
No seccomp filter, no mount namespace, no cgroup. Run untrusted code at scale in a container or VM.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import operator
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

NOBODY = 65534

# Imported before privileges drop: under root the interpreter may live where ``nobody`` cannot read (e.g. a
# pyenv under /root), so only modules loaded before the drop can be imported by the user code. ``socket`` is
# preloaded so that the audit hook and the namespace, not a missing module, are what stop it.
PRELOAD = (
    "math cmath fractions decimal statistics random itertools functools operator collections heapq bisect re "
    "string json datetime calendar copy enum dataclasses typing numbers textwrap unicodedata array struct "
    "hashlib base64 time io socket encodings.idna"
).split()

# The child's first code: set limits, drop privileges, install the audit hook, run the user code. Kept as a
# string (``-c``) so nothing outside the stdlib is imported by the child.
_BOOTSTRAP = r"""
import sys, os, resource, json
cfg = json.loads(sys.argv[1])
for _m in cfg["preload"]:
    try:
        __import__(_m)
    except Exception:
        pass
with open("main.py", encoding="utf-8") as _f:
    _code = _f.read()
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
if cfg["hooks"]:
    _root = os.path.realpath(os.getcwd())
    _readable = tuple(os.path.realpath(p) for p in sys.path if p) + ("/dev/null", "/dev/urandom", "/dev/random")
    _W = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    _deny = frozenset(
        "os.system os.exec os.posix_spawn os.spawn os.fork os.forkpty subprocess.Popen ctypes.dlopen "
        "ctypes.dlsym ctypes.cdata socket.__new__ socket.connect socket.bind socket.getaddrinfo "
        "socket.gethostbyname socket.sendto os.kill os.killpg signal.pthread_kill".split()
    )
    _deny_imports = frozenset(("ctypes", "_ctypes", "_posixsubprocess", "subprocess", "multiprocessing"))
    _paths = {"os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.chmod": 1, "os.chown": 1, "os.utime": 1,
              "os.truncate": 1, "os.chflags": 1, "os.lchflags": 1, "os.setxattr": 1, "os.removexattr": 1,
              "shutil.rmtree": 1, "os.rename": 2, "os.symlink": 2, "os.link": 2}
    _realpath, _sep, _fsdecode = os.path.realpath, os.sep, os.fsdecode

    def _inside(path, roots):
        p = _realpath(_fsdecode(path))
        return any(p == r or p.startswith(r.rstrip(_sep) + _sep) for r in roots)

    def _hook(event, args):
        if event == "open":
            path, mode, flags = args
            if path is None or isinstance(path, int):
                return
            writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool((flags or 0) & _W)
            if writing and not _inside(path, (_root,)):
                raise PermissionError(f"sandbox: writing outside the working directory is not allowed: {path}")
            if not writing and not _inside(path, (_root,) + _readable):
                raise PermissionError(f"sandbox: reading outside the working directory is not allowed: {path}")
        elif event in _deny or event.startswith("os.exec") or event.startswith("os.spawn"):
            raise PermissionError(f"sandbox: {event} is not allowed")
        elif event == "import" and args[0].split(".")[0] in _deny_imports:
            raise ImportError(f"sandbox: importing {args[0]} is not allowed")
        elif event in _paths:
            for p in args[: _paths[event]]:
                if isinstance(p, int) or not _inside(p, (_root,)):
                    raise PermissionError(f"sandbox: {event} outside the working directory is not allowed: {p}")
            if len(args) > _paths[event] and event != "os.truncate" and args[-1] not in (None, -100):
                raise PermissionError(f"sandbox: {event} with dir_fd is not allowed")

    sys.addaudithook(_hook)
del cfg, _m, _f
sys.argv = ["main.py"]
exec(compile(_code, "main.py", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


@dataclass(frozen=True)
class SandboxResult:
    """What one ``run_python`` call produced.

    ``stdout``/``stderr``: decoded text, each cut to ``max_output_chars`` (``truncated`` says whether anything
    was cut). ``returncode``: the child's exit status (negative: killed by that signal, e.g. -9 after the
    wall-clock timeout, -24 SIGXCPU after the CPU limit). ``timed_out``: the wall-clock limit was hit.
    ``network_namespace``: the child ran in an empty network namespace. ``seconds``: wall time.
    """

    stdout: str
    stderr: str
    returncode: int
    timed_out: bool
    truncated: bool
    network_namespace: bool
    seconds: float

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
            return f"killed by signal {signal.Signals(-self.returncode).name}"
        return f"exit status {self.returncode}"


@functools.cache
def _unshare_prefix() -> tuple[str, ...]:
    """The command prefix that puts the child in a new, empty network namespace, or ``()`` when none works."""
    exe = shutil.which("unshare")
    if exe is None or not sys.platform.startswith("linux"):
        return ()
    prefix = (exe, "-n") if os.geteuid() == 0 else (exe, "-r", "-n")
    try:
        ok = subprocess.run([*prefix, "true"], env={}, capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return prefix if ok else ()


def _read_capped(path: str, limit: int) -> tuple[str, bool]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        data = f.read(4 * limit + 4)  # at most 4 bytes a character in UTF-8
    text = data.decode("utf-8", errors="replace")
    if len(text) > limit or size > len(data):
        return text[:limit] + f"\n[... output truncated: {size} bytes in all, {limit} characters shown]", True
    return text, False


def run_python(
    code: str,
    *,
    timeout_s: float = 5.0,
    cpu_seconds: int = 2,
    memory_mb: int = 256,
    max_output_chars: int = 4000,
    max_file_bytes: int = 1 << 20,
    max_open_files: int = 32,
    network_namespace: bool = True,
    _audit_hooks: bool = True,
) -> SandboxResult:
    """Run ``code`` in a fresh, limited Python subprocess (see the module docstring for the guarantees).

    Args:
        code: Python source, run as ``__main__`` in a new temporary working directory.
        timeout_s: wall-clock limit; the child's process group is killed (SIGKILL) when it runs out.
        cpu_seconds: ``RLIMIT_CPU`` soft limit (an integer >= 1; the hard limit is one more).
        memory_mb: ``RLIMIT_AS`` in MiB (the interpreter itself needs about 30).
        max_output_chars: at most this many characters of stdout and of stderr come back.
        max_file_bytes: ``RLIMIT_FSIZE``: the largest file (stdout and stderr included) the child may write.
        max_open_files: ``RLIMIT_NOFILE``.
        network_namespace: run under ``unshare -n`` when it works (the audit hook blocks sockets either way).
        _audit_hooks: tests only: ``False`` leaves out the audit hook, to check that the kernel limits hold alone.

    Returns:
        a :class:`SandboxResult`; a timeout, a limit or an exception in ``code`` is reported there, not raised.

    Raises:
        TypeError: ``code`` is not a string. ValueError: a limit is not positive.
    """
    if not isinstance(code, str):
        raise TypeError(f"run_python: code must be a str, got {type(code).__name__}")
    for name, value in (("timeout_s", timeout_s), ("cpu_seconds", cpu_seconds), ("memory_mb", memory_mb),
                        ("max_output_chars", max_output_chars), ("max_file_bytes", max_file_bytes),
                        ("max_open_files", max_open_files)):  # fmt: skip
        if not value > 0:
            raise ValueError(f"run_python: {name} must be > 0, got {value}")
    drop = os.geteuid() == 0  # RLIMIT_NPROC does not apply to root: run as nobody
    prefix = _unshare_prefix() if network_namespace else ()
    cfg = {
        "preload": PRELOAD,
        "uid": NOBODY if drop else None,
        "gid": NOBODY if drop else None,
        "cpu": int(math.ceil(cpu_seconds)),
        "mem": int(memory_mb) << 20,
        "fsize": int(max_file_bytes),
        "nofile": int(max_open_files),
        "hooks": _audit_hooks,
    }
    workdir = tempfile.mkdtemp(prefix="rlbits-sandbox-")
    try:
        with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        out_path, err_path = os.path.join(workdir, ".stdout"), os.path.join(workdir, ".stderr")
        if drop:
            os.chown(workdir, NOBODY, NOBODY)
            os.chown(os.path.join(workdir, "main.py"), NOBODY, NOBODY)
        start = time.monotonic()
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                [*prefix, sys.executable, "-I", "-S", "-c", _BOOTSTRAP, json.dumps(cfg)],
                cwd=workdir,
                env={},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,  # its own process group, killed as a whole
                close_fds=True,
            )
            timed_out = False
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        seconds = time.monotonic() - start
        stdout, cut_out = _read_capped(out_path, max_output_chars)
        stderr, cut_err = _read_capped(err_path, max_output_chars)
        return SandboxResult(
            stdout=stdout,
            stderr=stderr,
            returncode=proc.returncode,
            timed_out=timed_out,
            truncated=cut_out or cut_err,
            network_namespace=bool(prefix),
            seconds=seconds,
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def python(code: str) -> str:
    """Run Python code in a sandbox and return what it printed.

    The code runs in a fresh interpreter with no network, no access to files outside a temporary directory,
    and limits on time (5 s), memory (256 MiB) and output (4000 characters). Use print() to show results.

    Args:
        code: The Python source code to run.
    """
    r = run_python(code)
    parts = [r.stdout.rstrip("\n")] if r.stdout else []
    if r.stderr:
        parts.append("stderr:\n" + r.stderr.rstrip("\n"))
    if not r.ok:
        parts.append(f"[{r.reason()}]")
    return "\n".join(parts) if parts else "[no output]"


# --------------------------------------------------------------------------------------------------------
# calculator: arithmetic by walking the AST
# --------------------------------------------------------------------------------------------------------

MAX_EXPRESSION_CHARS = 1000
MAX_RESULT_DIGITS = 4000

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


def _check_size(x):
    if isinstance(x, int) and x.bit_length() > MAX_RESULT_DIGITS * 3.33:
        raise ValueError(f"result has more than {MAX_RESULT_DIGITS} digits")
    return x


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        v = _eval(node.operand)
        return v if isinstance(node.op, ast.UAdd) else -v
    if isinstance(node, ast.BinOp):
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Div):
            if b == 0:
                raise ZeroDivisionError("division by zero")
            if isinstance(a, int) and isinstance(b, int) and a % b == 0:
                return a // b  # exact integer division stays an integer
            return a / b
        if isinstance(node.op, ast.Pow):
            if isinstance(b, int) and isinstance(a, int) and b >= 0:
                if abs(a) > 1 and b * math.log2(abs(a)) > MAX_RESULT_DIGITS * 3.33:
                    raise ValueError(f"result has more than {MAX_RESULT_DIGITS} digits")
            elif abs(b) > 1e4:
                raise ValueError("exponent too large")
            return _check_size(a**b)
        op = _BINARY.get(type(node.op))
        if op is None:
            raise ValueError(f"operator {type(node.op).__name__} is not supported")
        if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and b == 0:
            raise ZeroDivisionError("division by zero")
        return _check_size(op(a, b))
    raise ValueError(f"{type(node).__name__} is not allowed (only numbers, + - * / // % ** and parentheses)")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Integers are exact at any size up to 4000 digits; / of two integers gives an integer when it divides
    exactly, else a decimal. Supports + - * / // % ** and parentheses.

    Args:
        expression: The arithmetic expression, for example "123456789 * 987654321".
    """
    if not isinstance(expression, str):
        raise TypeError(f"calculator: expression must be a str, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"calculator: expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"calculator: not an arithmetic expression: {expression!r} ({e.msg})") from None
    value = _eval(tree)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return str(value)

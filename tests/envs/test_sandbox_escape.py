"""Escape attempts against the ``bwrap`` sandbox (``rlbits.envs.sandbox.run_python``): ``PAYLOADS`` (every
payload of issue 29, its 25 plain categories, and more) plus the two below that need the host's side (another
episode's output, kill -9 of the parent).

Every payload runs with the audit hook left out (``_audit_hooks=False``: the hook is assumed defeated, as the
issue's first payload defeats it on ``unsafe_local``), unless it tests the hook itself. Each must end cleanly:
``run_python`` returns a ``SandboxResult`` (never raises, never runs past its timeout plus a small margin) that
is an error (non-zero status, timeout) or says ``refused``. And nothing escapes: no output says ``ESCAPED``
(each payload prints it when the forbidden thing worked), no secret of the parent (an environment variable, a
root-only file, the repository's files) appears in the output, no file appears outside the sandbox, and
nothing connects to a listening socket of the host.

Where bubblewrap is missing the suite skips, except under CI (``CI`` or ``RLBITS_REQUIRE_BWRAP`` set, as
``.ci/run`` does), where it fails.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from sandbox_support import require_bwrap

from rlbits.envs.sandbox import SandboxResult, run_python

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="bubblewrap is Linux's")

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 3.0  # wall clock of one payload; CPU 1 s
MARGIN = 2.0  # seconds past the timeout that run_python may take to kill and collect

# Helpers every payload starts with: attempt(what, fn) prints "ESCAPED what" when fn() succeeds, else
# "refused what <error>".
PRELUDE = """\
import os, sys
def attempt(what, fn):
    try:
        value = fn()
    except BaseException as e:
        print('refused', what, type(e).__name__, str(e)[:80])
    else:
        print('ESCAPED', what, repr(value)[:200])
"""

# The first move: rewrite the audit hook's code through the main module (on unsafe_local this
# disabled the hook). Under bwrap it finds no hook there; every payload below runs without the hook anyway.
HOOK_REWRITE = """\
try:
    sys.modules['__main__']._hook.__code__ = (lambda e, a: None).__code__
    print('hook rewritten')
except BaseException as e:
    print('refused hook rewrite', type(e).__name__)
"""


@dataclass(frozen=True)
class Payload:
    name: str
    code: str  # placeholders: @PPID@ @SECRET_FILE@ @OUTSIDE@ @PORT@ @ABSTRACT@ @REPO@
    hooks: bool = False  # run with the audit hook in place (tests of the hook itself)
    timeout_s: float = TIMEOUT


P = Payload
PAYLOADS: list[Payload] = [
    # --- issue 29's escape chain, each step after the hook rewrite ------------------------------------
    P(
        "hook_rewrite_with_hook",
        HOOK_REWRITE + "attempt('read /etc/hostname', lambda: open('/etc/hostname').read())",
        hooks=True,
    ),
    P(
        "hook_rewrite_via_gc",
        "import gc\nattempt('find hook', lambda: [f for f in gc.get_objects() "
        "if getattr(f, '__name__', '') == 'hook'][0].__code__)",
        hooks=True,
    ),
    P(
        "set_code_on_function",
        "def f(): pass\nattempt('set __code__', lambda: setattr(f, '__code__', (lambda: 1).__code__))",
        hooks=True,
    ),
    P(
        "stdout_symlink_parent_environ",
        HOOK_REWRITE + "for p in ('.stdout', '.stderr'):\n"
        "    attempt('unlink ' + p, lambda: os.remove(p))\n"
        "    os.symlink('/proc/@PPID@/environ', p)\n"
        "    os.symlink(f'/proc/{os.getppid()}/environ', p + '2')\n"
        "attempt('read parent environ', lambda: open('/proc/@PPID@/environ').read())\n"
        "attempt('read ppid environ', lambda: open(f'/proc/{os.getppid()}/environ').read())",
    ),
    P(
        "stdout_symlink_root_only_file",
        HOOK_REWRITE + "os.symlink('@SECRET_FILE@', '.stdout')\n"
        "attempt('read root-only file', lambda: open('@SECRET_FILE@').read())\n"
        "attempt('read via link', lambda: open('.stdout').read())",
    ),
    P(
        "execv_bin_sh",
        HOOK_REWRITE + "attempt('execv /bin/sh', lambda: os.execv('/bin/sh', "
        "['sh', '-c', 'echo ESCAPED shell']))",
    ),
    P(
        "execv_ld_so_shell",
        "import glob\nld = (glob.glob('/lib64/ld-linux*') + glob.glob('/lib/ld-linux*'))[0]\n"
        "attempt('exec /bin/sh via ld.so', lambda: os.execv(ld, [ld, '/bin/sh', '-c', 'echo ESCAPED shell']))",
    ),
    P(
        "write_outside_work_dir",
        HOOK_REWRITE + "attempt('write outside', lambda: open('@OUTSIDE@', 'w').write('x'))\n"
        "attempt('mkdir outside', lambda: os.mkdir('@OUTSIDE@.d'))",
    ),
    P("write_into_repo", "attempt('write repo', lambda: open('@REPO@/rlbits-escape-probe', 'w').write('x'))"),
    P(
        "fifo_as_stdout",
        "os.mkfifo('.stdout')\nfd = os.open('.stdout', os.O_RDWR)\nos.dup2(fd, 1)\n"
        "os.dup2(fd, 2)\nimport time\ntime.sleep(60)",
        timeout_s=1.5,
    ),
    P(
        "tcp_to_host_loopback",
        "import socket\nattempt('connect 127.0.0.1', lambda: "
        "socket.create_connection(('127.0.0.1', @PORT@), timeout=1))",
    ),
    # --- the 25 plain payloads' categories ---------------------------------------------------------------
    P("read_etc_passwd", "attempt('read /etc/passwd', lambda: open('/etc/passwd').read())"),
    P("read_etc_shadow", "attempt('read /etc/shadow', lambda: open('/etc/shadow').read())"),
    P(
        "read_root_home",
        "attempt('list /root', lambda: [n for n in os.listdir('/root') if n != '.pyenv'] "
        "or 1/0)\nattempt('read /root/.bashrc', lambda: open('/root/.bashrc').read())",
    ),
    P(
        "read_repo_files",
        "attempt('read repo', lambda: open('@REPO@/pyproject.toml').read())\n"
        "attempt('list /work', lambda: os.listdir('/work'))",
    ),
    P("read_home", "attempt('list /home', lambda: os.listdir('/home'))"),
    P(
        "environment_secret",
        "print(sorted(os.environ))\nattempt('secret in env', lambda: os.environ['RLBITS_ESCAPE_SECRET'])",
    ),
    P(
        "proc_self_environ",
        "attempt('read /proc/self/environ', lambda: open('/proc/self/environ').read())\n"
        "attempt('read /proc/1/environ', lambda: open('/proc/1/environ').read())",
    ),
    P(
        "socket_external",
        "import socket\nattempt('connect 1.1.1.1', lambda: "
        "socket.create_connection(('1.1.1.1', 53), timeout=1))",
    ),
    P(
        "socket_udp_dns",
        "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "attempt('udp sendto', lambda: s.sendto(b'x', ('8.8.8.8', 53)))",
    ),
    P(
        "socket_getaddrinfo",
        "import socket\nattempt('resolve', lambda: socket.getaddrinfo('example.com', 80))",
    ),
    P(
        "socket_raw_packet",
        "import socket\nattempt('AF_PACKET', lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW))",
    ),
    P("fork", "attempt('fork', lambda: os.fork() or os._exit(0))"),
    P("forkpty", "import pty\nattempt('forkpty', lambda: pty.fork()[0] or os._exit(0))"),
    P(
        "subprocess_run",
        "import subprocess\nattempt('subprocess', lambda: subprocess.run(['/bin/sh', '-c', "
        "'echo ESCAPED'], capture_output=True).stdout)",
    ),
    P("os_system", "attempt('os.system', lambda: os.system('echo ESCAPED system') == 0 or 1/0)"),
    P(
        "posix_spawn",
        "attempt('posix_spawn', lambda: os.posix_spawn(sys.executable, [sys.executable, '-c', "
        "'print(1)'], {}))",
    ),
    P("threads", "import threading\nattempt('thread', lambda: threading.Thread(target=print).start())"),
    P(
        "pickle_reduce",
        "import pickle\nclass X:\n    def __reduce__(self):\n"
        "        return (os.system, ('echo ESCAPED pickle',))\n"
        "attempt('pickle', lambda: pickle.loads(pickle.dumps(X())) == 0 or 1/0)",
    ),
    P(
        "subclasses_chain",
        "subs = {c.__name__: c for c in object.__subclasses__()}\n"
        "cls = [c for c in ().__class__.__base__.__subclasses__() if c.__name__ == '_wrap_close']\n"
        "attempt('subclasses -> system', lambda: cls[0].__init__.__globals__['system']('echo ESCAPED') == 0 or 1/0)",
    ),
    P(
        "fullwidth_names",
        "attempt('fullwidth import', lambda: __ｉｍｐｏｒｔ__('ｏｓ').system('echo ESCAPED') == 0 or 1/0)",
    ),
    P(
        "raise_rlimits",
        "import resource\nfor r in ('RLIMIT_NPROC', 'RLIMIT_AS', 'RLIMIT_CPU', 'RLIMIT_FSIZE'):\n"
        "    attempt('raise ' + r, lambda: resource.setrlimit(getattr(resource, r), "
        "(resource.RLIM_INFINITY, resource.RLIM_INFINITY)))",
    ),
    # --- more ---------------------------------------------------------------------------------------------
    P(
        "ctypes_unshare_user",
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "for flag in (0x10000000, 0x00020000, 0x40000000):\n"
        "    attempt(f'unshare {flag:#x}', lambda: libc.unshare(flag) == 0 or 1/0)",
    ),
    P(
        "ctypes_mount",
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "attempt('mount tmpfs', lambda: libc.mount(b'none', b'/tmp', b'tmpfs', 0, None) == 0 or 1/0)\n"
        "attempt('remount / rw', lambda: libc.mount(None, b'/', None, 0x20 | 0x1000, None) == 0 or 1/0)",
    ),
    P(
        "ctypes_ptrace",
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "attempt('ptrace attach 1', lambda: libc.ptrace(16, 1, 0, 0) == 0 or 1/0)\n"
        "attempt('ptrace attach ppid', lambda: libc.ptrace(16, @PPID@, 0, 0) == 0 or 1/0)",
    ),
    P(
        "ctypes_keyctl",
        "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "attempt('keyctl', lambda: libc.syscall(250, 0, -4, 0, 0, 0) >= 0 or 1/0)",
    ),
    P(
        "proc_self_mem",
        "attempt('/proc/self/mem', lambda: open('/proc/self/mem', 'r+b'))\n"
        "attempt('/proc/1/root', lambda: os.listdir('/proc/1/root'))",
    ),
    P(
        "setuid_root",
        "attempt('setuid 0', lambda: os.setuid(0))\nattempt('setgid 0', lambda: os.setgid(0))\n"
        "attempt('setgroups', lambda: os.setgroups([0]))",
    ),
    P(
        "chroot_and_mknod",
        "attempt('chroot', lambda: os.chroot('/sandbox'))\n"
        "attempt('mknod', lambda: os.mknod('disk', 0o600 | 0o60000, os.makedev(8, 0)))",
    ),
    P(
        "dirfd_tricks",
        "d = os.open('/', os.O_RDONLY | os.O_DIRECTORY)\n"
        "attempt('openat root/.bashrc', lambda: os.open('root/.bashrc', os.O_RDONLY, dir_fd=d))\n"
        "w = os.open('.', os.O_RDONLY | os.O_DIRECTORY)\n"
        "attempt('openat ../../etc/passwd', lambda: os.open('../../etc/passwd', os.O_RDONLY, dir_fd=w))\n"
        "attempt('write via dirfd /', lambda: os.open('x', os.O_WRONLY | os.O_CREAT, dir_fd=d))",
    ),
    P(
        "symlinks_out",
        "for i, t in enumerate(('@SECRET_FILE@', '/proc/@PPID@/environ', '../../../../etc/shadow', "
        "'/@REPO@/pyproject.toml', '/root/.bash_history')):\n    os.symlink(t, f'l{i}')\n"
        "    attempt('read link to ' + t, lambda: open(f'l{i}').read())",
    ),
    P(
        "write_to_devices",
        "for d in ('/dev/sda', '/dev/mem', '/dev/kmsg', '/dev/tty', '/dev/shm/x', '/dev/x', "
        "'/usr/lib/x', '/x'):\n    attempt('write ' + d, lambda: open(d, 'wb').write(b'x'))",
    ),
    P(
        "unix_socket_host_daemons",
        "import socket, glob\npaths = glob.glob('/run/**/*.sock', recursive=True) + "
        "['/var/run/docker.sock', '/run/dbus/system_bus_socket', '/tmp/.X11-unix/X0']\n"
        "for p in paths:\n    s = socket.socket(socket.AF_UNIX)\n"
        "    attempt('connect ' + p, lambda: s.connect(p))",
    ),
    P(
        "abstract_unix_socket",
        "import socket\ns = socket.socket(socket.AF_UNIX)\n"
        "attempt('abstract connect', lambda: s.connect('\\0@ABSTRACT@'))",
    ),
    P(
        "signal_the_parent",
        "import signal\nattempt('kill ppid', lambda: os.kill(@PPID@, signal.SIGKILL))\n"
        "attempt('kill -1', lambda: os.kill(-1, signal.SIGKILL))\n"
        "attempt('kill init', lambda: os.kill(1, signal.SIGKILL))",
    ),
    P(
        "huge_output",
        "import sys\nfor _ in range(200000):\n    sys.stdout.write('y' * 1000)\nsys.exit(3)",
        timeout_s=2.0,
    ),
    P("memory_bomb", "x = []\nwhile True:\n    x.append(bytearray(16 << 20))"),
    P("memory_one_shot", "x = bytearray(64 << 30)"),
    P("fork_bomb", "while True:\n    os.fork()"),
    P("infinite_loop", "while True:\n    pass"),
    P("sleep_with_closed_stdout", "import time\nos.close(1)\nos.close(2)\ntime.sleep(600)", timeout_s=1.5),
    P(
        "disk_fill_many_files",
        "n = 0\ntry:\n    for i in range(10000):\n        with open(f'f{i}', 'wb') as f:\n"
        "            f.write(b'z' * (1 << 20))\n        n += 1\nexcept OSError as e:\n"
        "    print('refused disk at', n, 'MiB', e.errno)\nif n > 64:\n    print('ESCAPED disk', n)",
    ),
    P(
        "read_sys_and_proc",
        "attempt('list /sys', lambda: os.listdir('/sys'))\n"
        "attempt('read kallsyms', lambda: open('/proc/kallsyms').read(100))",
    ),
    P(
        "hard_link_host_file",
        "attempt('link', lambda: os.link('/usr/lib/os-release', 'mine'))\n"
        "attempt('chmod lib', lambda: os.chmod('/usr/lib', 0o777))",
    ),
    P("recursion_segfault", "import sys\nsys.setrecursionlimit(10**7)\ndef f(n):\n    return f(n + 1)\nf(0)"),
]
del P


@pytest.fixture(scope="module")
def host():
    """The host's side: a secret in the parent's environment, a root-only file holding a secret, a path
    outside the sandbox, a listening TCP socket on 127.0.0.1 and a listening abstract unix socket."""
    require_bwrap()
    secret = f"rlbits-secret-{uuid.uuid4().hex}"
    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        mp.setenv("RLBITS_ESCAPE_SECRET", secret)
        secret_file = Path(tmp) / "root-only"
        secret_file.write_text(f"{secret}-file")
        secret_file.chmod(0o600)
        tcp = socket.create_server(("127.0.0.1", 0))
        tcp.setblocking(False)
        abstract = f"rlbits-escape-{uuid.uuid4().hex}"
        unix = socket.socket(socket.AF_UNIX)
        unix.bind("\0" + abstract)
        unix.listen()
        unix.setblocking(False)
        try:
            yield {
                "secret": secret,
                "@PPID@": str(os.getpid()),
                "@SECRET_FILE@": str(secret_file),
                "@OUTSIDE@": str(Path(tmp) / "outside"),
                "@PORT@": str(tcp.getsockname()[1]),
                "@ABSTRACT@": abstract,
                "@REPO@": str(REPO),
                "tcp": tcp,
                "unix": unix,
            }
        finally:
            tcp.close()
            unix.close()


def _accepted(sock: socket.socket) -> bool:
    try:
        conn, _ = sock.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


def _check_clean_and_contained(r: SandboxResult, timeout_s: float, host: dict) -> None:
    assert isinstance(r, SandboxResult), r
    assert r.seconds <= timeout_s + MARGIN, f"ran {r.seconds:.1f} s past a {timeout_s} s timeout"
    out = r.stdout + r.stderr
    assert "ESCAPED" not in out, out
    assert host["secret"] not in out, "a secret of the parent came back"
    assert "[tool.pytest.ini_options]" not in out, "the repository's files came back"
    assert not (r.returncode == 0 and not r.timed_out and "refused" not in r.stdout), (
        f"no error and no refusal: {r}"
    )
    assert not os.path.lexists(host["@OUTSIDE@"]) and not os.path.lexists(host["@OUTSIDE@"] + ".d")
    assert not (REPO / "rlbits-escape-probe").exists()
    assert not _accepted(host["tcp"]), "the sandbox reached a listening socket on the host's 127.0.0.1"
    assert not _accepted(host["unix"]), "the sandbox reached an abstract unix socket of the host"


def test_payload_count():
    assert len(PAYLOADS) >= 40 and len({p.name for p in PAYLOADS}) == len(PAYLOADS)


@pytest.mark.parametrize("payload", PAYLOADS, ids=[p.name for p in PAYLOADS])
def test_escape(payload: Payload, host: dict):
    code = PRELUDE + payload.code
    for key, value in host.items():
        if key.startswith("@"):
            code = code.replace(key, value)
    r = run_python(code, _audit_hooks=payload.hooks, timeout_s=payload.timeout_s, cpu_seconds=1)
    _check_clean_and_contained(r, payload.timeout_s, host)


def test_hook_rewrite_refused_and_bounded_output(host):
    # The audit hook is defence in depth: the rewrite finds nothing to rewrite, and the hook still
    # refuses a read outside the work dir afterwards.
    r = run_python(PRELUDE + HOOK_REWRITE + "open('/usr/lib/os-release').read()\n", timeout_s=TIMEOUT)
    assert "refused hook rewrite AttributeError" in r.stdout and "PermissionError: sandbox" in r.stderr, r
    r = run_python(
        PAYLOADS[[p.name for p in PAYLOADS].index("huge_output")].code, timeout_s=2.0, cpu_seconds=1
    )
    assert r.truncated and r.stdout.startswith("y" * 100) and len(r.stdout) < 4200, r


def test_forging_another_episodes_output(host):
    # Two episodes at once: the attacker searches for the other's work dir and output (by path, as the issue's
    # probe swapped a sibling's .stdout) and writes everywhere it can; the victim's output must arrive intact.
    attacker = PRELUDE + (
        "import glob, time\n"
        "end = time.time() + 1.5\n"
        "while time.time() < end:\n"
        "    for p in glob.glob('/tmp/rlbits-sandbox-*/*') + glob.glob('/sandbox/../*/.stdout') "
        "+ glob.glob('/proc/*/fd/1'):\n"
        "        try:\n"
        "            open(p, 'w').write('FORGED')\n"
        "            print('ESCAPED wrote', p)\n"
        "        except OSError:\n"
        "            pass\n"
        "print('refused: nothing to forge')\n"
    )
    victim = "import time\ntime.sleep(1.0)\nprint('victim-output')"
    results = {}
    t = threading.Thread(target=lambda: results.update(victim=run_python(victim, timeout_s=TIMEOUT)))
    t.start()
    r = run_python(attacker, _audit_hooks=False, timeout_s=TIMEOUT, cpu_seconds=2)
    t.join()
    _check_clean_and_contained(r, TIMEOUT, host)
    assert results["victim"].stdout == "victim-output\n", results["victim"]


def test_kill_9_of_the_parent_leaves_nothing():
    # A parent running run_python is killed with SIGKILL: the sandboxed child dies with it (bwrap
    # --die-with-parent and its PID namespace) and nothing is left on the host (the work dir was a tmpfs).
    require_bwrap()
    script = (
        "import sys\n"
        f"sys.path.insert(0, {str(REPO)!r})\n"
        "from rlbits.envs.sandbox import run_python\n"
        "print('started', flush=True)\n"
        'run_python(\'import time\\nopen("x", "w").write("x")\\ntime.sleep(60)\', timeout_s=60, cpu_seconds=60)\n'
    )
    before = set(os.listdir(tempfile.gettempdir()))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "started\n"
        deadline = time.monotonic() + 20
        while not any(b"-X\0utf8" in cmd for cmd in _descendants(proc.pid).values()):
            assert time.monotonic() < deadline, "the sandboxed child never started"
            time.sleep(0.05)
        time.sleep(0.3)
        tree = _descendants(proc.pid)  # bwrap, its init in the PID namespace, the sandboxed python
        assert len(tree) >= 2, tree
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 5
        while _alive(tree) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(tree), "the sandboxed child outlived its parent"
    finally:
        proc.kill()
        proc.wait()
    left = [n for n in set(os.listdir(tempfile.gettempdir())) - before if n.startswith("rlbits-sandbox")]
    assert not left, left


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a live process, None when gone (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else (int(fields[1]), int(fields[19]))


def _descendants(root: int) -> dict[tuple[int, int], bytes]:
    """Every live descendant of ``root``: (pid, start time) -> command line."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None:
            children.setdefault(st[0], []).append(int(name))
    out, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        st = _stat(pid)
        if st is None:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                out[(pid, st[1])] = f.read()
        except OSError:
            continue
        todo.extend(children.get(pid, []))
    return out


def _alive(tree: dict[tuple[int, int], bytes]) -> list[int]:
    return [pid for pid, start in tree if (st := _stat(pid)) is not None and st[1] == start]

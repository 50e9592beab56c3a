"""The sandboxed Python tool against escape attempts, and the exact calculator.

Every attempt is small and bounded even if a limit failed: the fork test forks at most once (a real fork
bomb is never run), the memory test asks for 10 GiB in one allocation (refused by RLIMIT_AS before any page is
touched), the loops run under a 1 s CPU limit and a 3 s wall-clock timeout."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

from rlbits.envs.sandbox import calculator, python, run_python

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the sandbox's limits are Linux's"
)

REPO = Path(__file__).resolve().parents[1]
FAST = {"timeout_s": 3.0, "cpu_seconds": 1}


def test_runs_code_and_cleans_up(tmp_path):
    r = run_python("import math, fractions\nprint(math.factorial(20), fractions.Fraction(1, 3) * 3)", **FAST)
    assert r.ok and r.stdout == "2432902008176640000 1\n", r
    r = run_python("import os\nopen('note.txt', 'w').write('hi')\nprint(os.getcwd())", **FAST)
    assert r.ok, r
    assert not os.path.exists(r.stdout.strip()), "the working directory must be deleted afterwards"


def test_exception_is_reported_not_raised():
    r = run_python("1 / 0", **FAST)
    assert r.returncode == 1 and "ZeroDivisionError" in r.stderr and not r.timed_out


@pytest.mark.parametrize("target", ["/tmp", "repo"])
def test_cannot_write_outside_its_dir(target):
    path = str((Path("/tmp") if target == "/tmp" else REPO) / f"rlbits-escape-{uuid.uuid4().hex}")
    attempts = [
        f"open({path!r}, 'w').write('x')",
        f"import os\nos.close(os.open({path!r}, os.O_WRONLY | os.O_CREAT))",
        f"import os\nos.symlink({path!r}, 'link')\nopen('link', 'w').write('x')",
        f"import os\nos.mkdir({path!r})",
    ]
    try:
        for code in attempts:
            r = run_python(code, **FAST)
            assert r.returncode != 0 and "PermissionError" in r.stderr, (code, r)
            assert not os.path.exists(path), code
    finally:
        if os.path.lexists(path):
            os.remove(path) if not os.path.isdir(path) else os.rmdir(path)


def test_cannot_read_other_processes_environment(monkeypatch):
    monkeypatch.setenv("RLBITS_TEST_SECRET", "hunter2")
    r = run_python("import os\nprint(sorted(os.environ))", **FAST)
    assert r.ok and "RLBITS_TEST_SECRET" not in r.stdout and "hunter2" not in r.stdout, r
    # Python's own locale coercion may set LC_CTYPE; nothing of the parent's environment arrives.
    assert set(eval(r.stdout)) <= {"LC_CTYPE"}, r.stdout
    r = run_python(f"print(open('/proc/{os.getpid()}/environ').read())", **FAST)
    assert r.returncode != 0 and "hunter2" not in r.stdout and "PermissionError" in r.stderr, r


def test_cannot_open_a_socket():
    r = run_python("import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)", **FAST)
    assert r.returncode != 0 and "socket" in r.stderr and "not allowed" in r.stderr, r


def test_network_namespace_holds_without_the_hook():
    r = run_python("print(1)", **FAST)
    if not r.network_namespace:
        pytest.skip("unshare -n is not available here: only the audit hook blocks the network")
    code = (
        "import socket\n"
        "for host in ('127.0.0.1', '1.1.1.1'):\n"
        "    try:\n"
        "        socket.create_connection((host, 53), timeout=1)\n"
        "        print('connected', host)\n"
        "    except OSError as e:\n"
        "        print('refused', host, e.errno)\n"
    )
    r = run_python(code, _audit_hooks=False, **FAST)
    assert "connected" not in r.stdout and r.stdout.count("refused") == 2, r


def test_infinite_loop_is_stopped_by_the_cpu_limit():
    r = run_python("while True:\n    pass", timeout_s=4.0, cpu_seconds=1)
    assert not r.ok and r.returncode < 0 and "killed" in r.reason(), r
    assert r.seconds < 4.0


def test_sleep_is_stopped_by_the_wall_clock():
    r = run_python("import time\ntime.sleep(60)", timeout_s=1.0, cpu_seconds=1)
    assert r.timed_out and r.reason() == "killed: wall-clock timeout" and r.seconds < 3, r


def test_fork_is_refused():
    # One fork at most, its child exits at once: safe even if every limit failed.
    code = (
        "import os\n"
        "try:\n"
        "    pid = os.fork()\n"
        "except (OSError, PermissionError) as e:\n"
        "    print('refused', type(e).__name__)\n"
        "else:\n"
        "    if pid == 0:\n"
        "        os._exit(0)\n"
        "    os.waitpid(pid, 0)\n"
        "    print('forked')\n"
    )
    r = run_python(code, **FAST)
    assert r.stdout.startswith("refused PermissionError"), r  # the audit hook
    r = run_python(code, _audit_hooks=False, **FAST)
    assert r.stdout.startswith("refused BlockingIOError"), r  # RLIMIT_NPROC alone: EAGAIN
    r = run_python("import subprocess\nsubprocess.run(['true'])", **FAST)
    assert r.returncode != 0 and "not allowed" in r.stderr, r


def test_fork_bomb_is_stopped():
    # The classic bomb (every process forks again), under RLIMIT_NPROC = 0 set before the first line runs; the
    # hook is left out so the kernel limit is what stops it: the first fork fails with EAGAIN. For safety it
    # refuses to start unless the limit is in place and it is not root, and it is bounded to 6 generations
    # (at most 64 processes) in case the kernel ignored the limit.
    code = (
        "import os, resource\n"
        "assert resource.getrlimit(resource.RLIMIT_NPROC) == (0, 0) and os.getuid() != 0, 'unsafe'\n"
        "for _ in range(6):\n"
        "    os.fork()\n"
    )
    r = run_python(code, _audit_hooks=False, timeout_s=3.0, cpu_seconds=1)
    assert r.returncode == 1 and "BlockingIOError" in r.stderr and not r.timed_out, r


def test_memory_limit():
    r = run_python("x = bytearray(10 * 1024**3)", **FAST)
    assert r.returncode == 1 and "MemoryError" in r.stderr, r


def test_huge_output_is_truncated():
    r = run_python(
        "import sys\nfor _ in range(10**6):\n    sys.stdout.write('x' * 1000)", max_output_chars=400, **FAST
    )
    assert r.truncated and len(r.stdout) < 600 and "truncated" in r.stdout, r
    # RLIMIT_FSIZE stopped the writing at 1 MiB: the child got EFBIG, not the parent a 1 GB file.
    assert r.returncode == 1 and "File too large" in r.stderr, r


def test_python_tool_text():
    assert python("print(6 * 7)") == "42"
    out = python("raise ValueError('boom')")
    assert "ValueError: boom" in out and "[exit status 1]" in out


def test_run_python_bad_input():
    with pytest.raises(TypeError, match="code must be a str"):
        run_python(b"print(1)")
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        run_python("print(1)", timeout_s=0)


# --------------------------------------------------------------------------------------------------------
# calculator
# --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expr,want",
    [
        ("123456789 * 987654321", "121932631112635269"),
        ("2**100", str(2**100)),
        ("(7 + 5) * -3", "-36"),
        ("10 / 5", "2"),
        ("7 / 2", "3.5"),
        ("17 // 5", "3"),
        ("17 % 5", "2"),
        ("99999999999999999999 + 1", "100000000000000000000"),
    ],
)
def test_calculator_exact(expr, want):
    assert calculator(expr) == want


@pytest.mark.parametrize(
    "expr,error,match",
    [
        ("__import__('os').system('true')", ValueError, "not allowed"),
        ("open('x')", ValueError, "not allowed"),
        ("9**9**9", ValueError, "digits"),
        ("1 / 0", ZeroDivisionError, "division by zero"),
        ("2 +", ValueError, "not an arithmetic expression"),
        ("'a' * 3", ValueError, "not allowed"),
        ("1 << 100000", ValueError, "not supported"),
    ],
)
def test_calculator_refuses(expr, error, match):
    with pytest.raises(error, match=match):
        calculator(expr)

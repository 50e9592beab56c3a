"""The sandboxed Python tool, under both sandboxes (``bwrap`` and ``unsafe_local``).
The escape attempts against ``bwrap`` are tests/envs/test_sandbox_escape.py.

Every attempt is small and bounded even if a limit failed: the fork test forks at most once (a real fork
bomb is never run), the memory test asks for 10 GiB in one allocation (refused by RLIMIT_AS before any page is
touched), the loops run under a 1 s CPU limit and a 3 s wall-clock timeout."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest
from sandbox_support import require_bwrap

from rlbits.envs import sandbox as sandbox_module
from rlbits.envs.sandbox import (
    SandboxUnavailableError,
    check_sandbox,
    python,
    python_tool,
    run_python,
)

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the sandbox's limits are Linux's"
)

REPO = Path(__file__).resolve().parents[2]
FAST = {"timeout_s": 3.0, "cpu_seconds": 1}


@pytest.fixture(params=["bwrap", "unsafe_local"])
def sandbox(request) -> str:
    if request.param == "bwrap":
        require_bwrap()
    return request.param


def test_runs_code_and_cleans_up(sandbox):
    code = "import math, fractions\nprint(math.factorial(20), fractions.Fraction(1, 3) * 3)"
    r = run_python(code, sandbox=sandbox, **FAST)
    assert r.ok and r.stdout == "2432902008176640000 1\n" and r.sandbox == sandbox, r
    r = run_python(
        "import os\nopen('note.txt', 'w').write('hi')\nprint(os.getcwd())", sandbox=sandbox, **FAST
    )
    assert r.ok, r
    assert not os.path.exists(os.path.join(r.stdout.strip(), "note.txt")), (
        "the work dir must be gone afterwards"
    )


def test_files_inside_the_work_dir(sandbox):
    # remove, mkdir, rename and rmdir inside the work dir: CPython passes dir_fd=-1 to the audit hook
    code = (
        "import os\n"
        "open('a', 'w').write('x')\n"
        "os.rename('a', 'b')\n"
        "os.remove('b')\n"
        "os.mkdir('d')\n"
        "os.rename('d', 'e')\n"
        "os.rmdir('e')\n"
        "print(sorted(os.listdir('.')))\n"
    )
    r = run_python(code, sandbox=sandbox, **FAST)
    assert r.ok and r.stdout == "[]\n", r


def test_large_code_goes_in_through_stdin(sandbox):
    # The code reaches the child on a pipe the parent writes as the child reads (more than a pipe's buffer).
    code = f"s = {'x' * 300_000!r}\nprint(len(s), 'é')"
    r = run_python(code, sandbox=sandbox, **FAST)
    assert r.ok and r.stdout == "300000 é\n", r


def test_exception_is_reported_not_raised(sandbox):
    r = run_python("1 / 0", sandbox=sandbox, **FAST)
    assert r.returncode == 1 and "ZeroDivisionError" in r.stderr and not r.timed_out


@pytest.mark.parametrize("target", ["/tmp", "repo"])
def test_cannot_write_outside_its_dir(target, sandbox):
    path = str((Path("/tmp") if target == "/tmp" else REPO) / f"rlbits-escape-{uuid.uuid4().hex}")
    attempts = [
        f"open({path!r}, 'w').write('x')",
        f"import os\nos.close(os.open({path!r}, os.O_WRONLY | os.O_CREAT))",
        f"import os\nos.symlink({path!r}, 'link')\nopen('link', 'w').write('x')",
        f"import os\nos.mkdir({path!r})",
    ]
    try:
        for code in attempts:
            for hooks in (True, False) if sandbox == "bwrap" else (True,):
                r = run_python(code, sandbox=sandbox, _audit_hooks=hooks, **FAST)
                assert not os.path.lexists(path), (code, r)
                # The hook refuses first (bwrap's /tmp is a link to the work dir, so a path under /tmp, the repo
                # of a clone there included, is allowed, and harmless). Without the hook (bwrap) the host path is
                # simply not in the sandbox's view.
                if hooks and not (sandbox == "bwrap" and path.startswith("/tmp/")):
                    assert r.returncode != 0 and "PermissionError" in r.stderr, (code, r)
    finally:
        if os.path.lexists(path):
            os.remove(path) if not os.path.isdir(path) else os.rmdir(path)


def test_cannot_read_other_processes_environment(monkeypatch, sandbox):
    monkeypatch.setenv("RLBITS_TEST_SECRET", "hunter2")
    r = run_python("import os\nprint(sorted(os.environ))", sandbox=sandbox, **FAST)
    assert r.ok and "RLBITS_TEST_SECRET" not in r.stdout and "hunter2" not in r.stdout, r
    # Python's own locale coercion may set LC_CTYPE (and bwrap PWD); nothing of the parent's arrives.
    assert set(eval(r.stdout)) <= {"LC_CTYPE", "PWD"}, r.stdout
    code = f"print(open('/proc/{os.getpid()}/environ').read())"
    r = run_python(code, sandbox=sandbox, **FAST)
    assert r.returncode != 0 and "hunter2" not in r.stdout and "PermissionError" in r.stderr, r  # the hook
    if sandbox == "bwrap":  # without the hook: no /proc in the sandbox
        r = run_python(code, sandbox=sandbox, _audit_hooks=False, **FAST)
        assert r.returncode != 0 and "hunter2" not in r.stdout and "FileNotFoundError" in r.stderr, r


def test_cannot_open_a_socket(sandbox):
    r = run_python(
        "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)", sandbox=sandbox, **FAST
    )
    assert r.returncode != 0 and "socket" in r.stderr and "not allowed" in r.stderr, r


def test_network_namespace_holds_without_the_hook(sandbox):
    r = run_python("print(1)", sandbox=sandbox, **FAST)
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
    r = run_python(code, sandbox=sandbox, _audit_hooks=False, **FAST)
    assert "connected" not in r.stdout and r.stdout.count("refused") == 2, r


def test_infinite_loop_is_stopped_by_the_cpu_limit(sandbox):
    r = run_python("while True:\n    pass", sandbox=sandbox, timeout_s=4.0, cpu_seconds=1)
    assert not r.ok and r.returncode < 0 and "killed" in r.reason(), r
    assert r.seconds < 4.0


def test_sleep_is_stopped_by_the_wall_clock(sandbox):
    r = run_python("import time\ntime.sleep(60)", sandbox=sandbox, timeout_s=1.0, cpu_seconds=1)
    assert r.timed_out and r.reason() == "killed: wall-clock timeout" and r.seconds < 3, r


def test_fork_is_refused(sandbox):
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
    r = run_python(code, sandbox=sandbox, **FAST)
    assert r.stdout.startswith("refused PermissionError"), r  # the audit hook
    r = run_python(code, sandbox=sandbox, _audit_hooks=False, **FAST)
    assert r.stdout.startswith("refused BlockingIOError"), r  # RLIMIT_NPROC alone: EAGAIN
    r = run_python("import subprocess\nsubprocess.run(['true'])", sandbox=sandbox, **FAST)
    assert r.returncode != 0 and "not allowed" in r.stderr, r


def test_fork_bomb_is_stopped(sandbox):
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
    r = run_python(code, sandbox=sandbox, _audit_hooks=False, timeout_s=3.0, cpu_seconds=1)
    assert r.returncode == 1 and "BlockingIOError" in r.stderr and not r.timed_out, r


def test_memory_limit(sandbox):
    r = run_python("x = bytearray(10 * 1024**3)", sandbox=sandbox, **FAST)
    assert r.returncode == 1 and "MemoryError" in r.stderr, r


def test_huge_output_is_truncated(sandbox):
    # 1 GB written to stdout: the parent keeps 400 characters and drains the rest from its pipe until the
    # child ends (here the wall clock stops it: writing to a pipe is not limited by RLIMIT_FSIZE).
    r = run_python(
        "import sys\nfor _ in range(10**6):\n    sys.stdout.write('x' * 1000)",
        sandbox=sandbox,
        max_output_chars=400,
        timeout_s=2.0,
        cpu_seconds=1,
    )
    assert r.truncated and len(r.stdout) < 600 and "truncated" in r.stdout, r
    assert r.stdout.startswith("x" * 400) and r.seconds < 4, r


def test_disk_is_bounded_in_total():
    # Many files each under RLIMIT_FSIZE: the tmpfs of max_disk_bytes is the total bound.
    require_bwrap()
    code = (
        "import os\n"
        "n = 0\n"
        "try:\n"
        "    for i in range(1000):\n"
        "        with open(f'f{i}', 'wb') as f:\n"
        "            f.write(b'x' * (512 * 1024))\n"
        "        n += 512 * 1024\n"
        "except OSError as e:\n"
        "    print(n, e.errno)\n"
    )
    r = run_python(code, max_disk_bytes=4 << 20, max_open_files=16, **FAST)
    written, errno = map(int, r.stdout.split())
    assert written <= 4 << 20 and errno == 28, r  # ENOSPC


def test_python_tool_text(sandbox):
    tool = python_tool(sandbox)
    assert tool("print(6 * 7)") == "42"
    out = tool("raise ValueError('boom')")
    assert "ValueError: boom" in out and "[exit status 1]" in out
    if sandbox == "bwrap":
        assert python("print(6 * 7)") == "42"


def test_run_python_bad_input():
    with pytest.raises(TypeError, match="code must be a str"):
        run_python(b"print(1)")
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        run_python("print(1)", timeout_s=0)
    with pytest.raises(ValueError, match="sandbox must be one of bwrap, unsafe_local; got 'docker'"):
        run_python("print(1)", sandbox="docker")
    with pytest.raises(TypeError, match="memory_gb"):
        python_tool("unsafe_local", memory_gb=1)


def test_no_bwrap_no_tool_code(monkeypatch, tmp_path):
    # Without bubblewrap (missing, or failing its self-test), tool code does not run under "bwrap".
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda name, *a, **k: None)
    with pytest.raises(SandboxUnavailableError, match="not installed.*apt-get install bubblewrap"):
        run_python("print(1)")
    with pytest.raises(SandboxUnavailableError, match="unsafe_local"):
        python_tool()
    assert run_python("print(1)", sandbox="unsafe_local", **FAST).stdout == "1\n"  # explicit: still runs
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda name, *a, **k: str(fake))
    with pytest.raises(SandboxUnavailableError, match="failed its self-test.*No permissions"):
        check_sandbox("bwrap")


def test_the_run_configs_sandbox_reaches_the_tools():
    # EnvConfig.sandbox is validated and reaches a task's make_env that takes a sandbox keyword (the loops build
    # every episode's env with phases.env_options); a make_env without one gets only env_options.
    from rlbits.envs import ToolEnv, ToolRegistry
    from rlbits.loops.config import ConfigError, EnvConfig
    from rlbits.loops.phases import env_options

    with pytest.raises(ConfigError, match="sandbox must be one of 'bwrap', 'unsafe_local'; got 'docker'"):
        EnvConfig(sandbox="docker")
    with pytest.raises(ConfigError, match="env_options must not set sandbox"):
        EnvConfig(env_options={"sandbox": "unsafe_local"})

    def make_env(prompt, *, sandbox="bwrap", max_turns=2):
        return ToolEnv(ToolRegistry([python_tool(sandbox, **FAST)]), mode="plain", max_turns=max_turns)

    cfg = EnvConfig(sandbox="unsafe_local", env_options={"max_turns": 3})
    options = env_options(make_env, cfg)
    assert options == {"max_turns": 3, "sandbox": "unsafe_local"}
    assert env_options(lambda prompt, max_turns=1: None, cfg) == {"max_turns": 3}
    env = make_env("p", **options)
    env.reset("p")
    r = env.step('<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>')
    assert r.observation.text == "\n<tool_response>\n42\n</tool_response>\n", r

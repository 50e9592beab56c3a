"""The ``bwrap`` sandbox's command line and its seccomp filter, used by ``rlbits.envs.sandbox.run_python``.

``bwrap_argv`` sets up the child's namespaces and a mount namespace holding, read-only, the system's shared
libraries, the interpreter's prefix and a minimal ``/dev``, plus a tmpfs work dir (``WORK_DIR``);
``seccomp_program`` compiles the filter of the system calls the child may not make. What they guarantee and
what not: the docstring of ``rlbits.envs.sandbox`` and docs/envs.md ("The sandbox")."""

from __future__ import annotations

import functools
import os
import sys
import tempfile

WORK_DIR = "/sandbox"  # the call's work dir inside the bwrap sandbox


def interpreter() -> tuple[str, str]:
    """The real interpreter binary (a venv's base) and its prefix, symlinks resolved."""
    exe = getattr(sys, "_base_executable", None) or sys.executable
    return os.path.realpath(exe), os.path.realpath(sys.base_prefix)


def bwrap_argv(bwrap: str, disk_bytes: int, seccomp_fd: int | None) -> tuple[list[str], str]:
    """``bwrap``'s arguments up to ``--``, and the interpreter binary (bound read-only inside) to run after it.

    ``disk_bytes``: the size of the work dir's tmpfs. ``seccomp_fd``: a file descriptor the child inherits that
    holds ``seccomp_program()``'s filter, or ``None`` for no filter."""
    exe, prefix = interpreter()
    root = os.geteuid() == 0
    if root:
        # No user namespace: it would map the sandbox's uid to host root, whom RLIMIT_NPROC does not bind.
        # The bootstrap drops to nobody with the two capabilities kept for that; the drop clears them.
        argv = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--cap-drop", "ALL"]
    argv += ["--die-with-parent", "--new-session", "--clearenv", "--hostname", "sandbox"]
    made: set[str] = {"/"}
    bound: list[str] = []

    def parents(path: str) -> None:  # bwrap makes missing parents 0700: make them 0755 first
        parent = os.path.dirname(path)
        if parent in made:
            return
        parents(parent)
        argv.extend(["--perms", "0755", "--dir", parent])
        made.add(parent)

    def ro_bind(path: str) -> None:
        parents(path)
        argv.extend(["--ro-bind", path, path])
        made.add(path)
        bound.append(path)

    for name in ("lib", "lib64", "lib32", "libx32"):
        if os.path.isdir(f"/usr/{name}") and not os.path.islink(f"/usr/{name}"):
            ro_bind(f"/usr/{name}")
        if os.path.islink(f"/{name}"):
            argv.extend(["--symlink", os.readlink(f"/{name}"), f"/{name}"])
        elif os.path.isdir(f"/{name}"):
            ro_bind(f"/{name}")
    if os.path.isfile("/etc/ld.so.cache"):
        ro_bind("/etc/ld.so.cache")
    if not any(prefix == d or prefix.startswith(d + "/") for d in bound):
        if prefix in ("/usr", "/"):  # a system Python: its stdlib is under /usr/lib, bound above
            ro_bind(exe)
        else:
            ro_bind(prefix)
    if not any(exe == d or exe.startswith(d + "/") for d in bound):
        ro_bind(exe)
    argv += ["--dev", "/dev", "--perms", "0777", "--size", str(disk_bytes), "--tmpfs", WORK_DIR,
             "--symlink", WORK_DIR, "/tmp", "--chdir", WORK_DIR, "--remount-ro", "/dev", "--remount-ro", "/"]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    return argv, exe


_CLONE_NEW_FLAGS = (
    0x00000080,
    0x00020000,
    0x02000000,
    0x04000000,
    0x08000000,
    0x10000000,
    0x20000000,
    0x40000000,
)
_SECCOMP_DENY = (
    "unshare setns mount umount umount2 pivot_root chroot move_mount open_tree fsopen fsconfig fsmount fspick "
    "mount_setattr ptrace process_vm_readv process_vm_writev keyctl add_key request_key bpf perf_event_open "
    "userfaultfd kexec_load kexec_file_load init_module finit_module delete_module acct swapon swapoff reboot "
    "syslog open_by_handle_at name_to_handle_at quotactl fanotify_init"
).split()


@functools.cache
def seccomp_program() -> bytes | None:
    """The compiled seccomp filter (BPF, as ``bwrap --seccomp`` reads it), built with libseccomp; ``None``
    when libseccomp is not installed or fails."""
    import ctypes

    try:
        lib = ctypes.CDLL("libseccomp.so.2")
    except OSError:
        return None

    class ArgCmp(ctypes.Structure):  # struct scmp_arg_cmp
        _fields_ = [
            ("arg", ctypes.c_uint),
            ("op", ctypes.c_int),
            ("a", ctypes.c_uint64),
            ("b", ctypes.c_uint64),
        ]

    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p,
        ctypes.c_uint32,
        ctypes.c_int,
        ctypes.c_uint,
        ctypes.POINTER(ArgCmp),
    ]
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    allow, masked_eq = 0x7FFF0000, 7  # SCMP_ACT_ALLOW, SCMP_CMP_MASKED_EQ

    def errno_action(err: int) -> int:  # SCMP_ACT_ERRNO(err)
        return 0x00050000 | (err & 0xFFFF)

    ctx = lib.seccomp_init(allow)
    if not ctx:
        return None
    try:
        rules: list[tuple[str, int, list[ArgCmp]]] = [(name, errno_action(1), []) for name in _SECCOMP_DENY]
        rules += [("clone", errno_action(1), [ArgCmp(0, masked_eq, f, f)]) for f in _CLONE_NEW_FLAGS]
        rules.append(
            ("clone3", errno_action(38), [])
        )  # ENOSYS: glibc falls back to clone, whose flags we see
        for name, action, cmps in rules:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:
                continue  # not a syscall of this architecture
            arr = (ArgCmp * max(1, len(cmps)))(*cmps)
            if lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), arr) != 0:
                return None
        with tempfile.TemporaryFile() as f:
            if lib.seccomp_export_bpf(ctx, f.fileno()) != 0:
                return None
            f.seek(0)
            return f.read()
    finally:
        lib.seccomp_release(ctx)

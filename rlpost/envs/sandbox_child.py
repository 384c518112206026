"""The program the sandboxed interpreter runs (``python -I -c CHILD_SCRIPT``): the child's side of
:class:`~rlpost.envs.sandbox.SandboxProcess`'s pipe protocol (see :mod:`rlpost.envs.sandbox`).

It sets the limits and the prelude guards, then runs the blocks it reads from stdin (``"<length>\\n"``
and the code) in one globals dict, writing one JSON status line per block to the status pipe. It
runs under ``python -I``, so it uses only the standard library; argv: status fd, limits (JSON,
:meth:`~rlpost.envs.sandbox.Limits.for_child`), parent pid (0: do not check). A change here is a
change of the protocol: the parent reads the status line in ``SandboxProcess._take_status_line``.
"""

CHILD_SCRIPT = r'''
import builtins, ctypes, io, _io, json, linecache, os, posix, resource, signal, socket, _socket
import sys, traceback, _posixsubprocess

STATUS_FD, LIMITS, PARENT_PID = int(sys.argv[1]), json.loads(sys.argv[2]), int(sys.argv[3])
ROOT = os.path.realpath(os.getcwd())
ALLOWED_WRITES = {"/dev/null", "/dev/stdout", "/dev/stderr"}
READ_REQUEST, WRITE_STATUS = os.read, os.write  # kept before the guards replace anything


class SandboxViolation(PermissionError):
    def __init__(self, reason, what):
        super().__init__(f"{reason} in rlpost sandbox ({what})")
        self.reason, self.what = reason, what


def kernel_guards():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the parent
        libc.unshare(0x40000000)  # CLONE_NEWNET (guard mode); fails without CAP_SYS_ADMIN: fine
    except Exception:
        pass
    if PARENT_PID and os.getppid() != PARENT_PID:
        os._exit(1)


def uid_task_count(uid):
    count = 0
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields["Threads"])
        except (OSError, ValueError, KeyError):  # gone, or not a process entry
            continue
    return count


def set_limit(which, soft, hard):
    _, cur_hard = resource.getrlimit(which)
    if cur_hard != resource.RLIM_INFINITY:
        soft, hard = min(soft, cur_hard), min(hard, cur_hard)
    resource.setrlimit(which, (soft, hard))


def set_limits():
    set_limit(resource.RLIMIT_CORE, 0, 0)
    set_limit(resource.RLIMIT_CPU, LIMITS["cpu_s"], LIMITS["cpu_s"] + 1)
    set_limit(resource.RLIMIT_FSIZE, LIMITS["file_bytes"], LIMITS["file_bytes"])
    # NPROC counts every task (threads too) of the real uid and is not enforced for root.
    base = 0 if os.getuid() == 0 else uid_task_count(os.getuid())
    set_limit(resource.RLIMIT_NPROC, base + LIMITS["max_procs"], base + LIMITS["max_procs"])
    set_limit(resource.RLIMIT_AS, LIMITS["memory_bytes"], LIMITS["memory_bytes"])


def check_write(path, dir_fd=None):
    if isinstance(path, int):  # an open descriptor reaches nothing new by name
        return
    name = os.fsdecode(os.fspath(path))
    base = os.getcwd() if dir_fd is None else os.readlink(f"/proc/self/fd/{dir_fd}")
    if os.path.normpath(os.path.join(base, name)) in ALLOWED_WRITES:
        return
    full = os.path.realpath(os.path.join(base, name))  # symlinks resolved: no escape through one
    if full != ROOT and not full.startswith(ROOT + os.sep):
        raise SandboxViolation("write outside working directory", full)


def guard_files():
    real_open, real_os_open = builtins.open, os.open
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND

    def open(file, mode="r", *args, **kwargs):
        if any(c in mode for c in "wax+"):
            check_write(file)
        return real_open(file, mode, *args, **kwargs)

    def os_open(path, flags, mode=0o777, *, dir_fd=None):
        if flags & write_flags:
            check_write(path, dir_fd)
        return real_os_open(path, flags, mode, dir_fd=dir_fd)

    builtins.open = io.open = _io.open = open
    os.open = posix.open = os_open
    one = [(0, "path", "dir_fd")]
    two = [(0, "src", "src_dir_fd"), (1, "dst", "dst_dir_fd")]
    paths = {"mkdir": one, "rmdir": one, "remove": one, "unlink": one, "chmod": one,
             "chown": one, "lchown": one, "truncate": one, "utime": one, "mkfifo": one,
             "mknod": one, "rename": two, "replace": two, "link": two,
             "symlink": [(1, "dst", "dir_fd")]}
    for fn_name, specs in paths.items():
        real = getattr(os, fn_name, None)
        if real is not None:
            wrapped = guard_paths(real, specs)
            setattr(os, fn_name, wrapped)
            setattr(posix, fn_name, wrapped)


def guard_paths(real, specs):
    def guarded(*args, **kwargs):
        for index, param, dir_fd_param in specs:
            path = args[index] if index < len(args) else kwargs.get(param)
            if path is not None:
                check_write(path, kwargs.get(dir_fd_param))
        return real(*args, **kwargs)
    return guarded


def guard_processes():
    def refuse(reason, name):
        def refused(*args, **kwargs):
            raise SandboxViolation(reason, name)
        return refused

    # os.exec*/spawn*/popen, subprocess and multiprocessing all end in one of these.
    creation = ["fork", "forkpty", "system", "execv", "execve", "posix_spawn", "posix_spawnp"]
    control = ["setsid", "setpgid", "setpgrp", "killpg"]  # leaving the session, signalling others
    groups = [("process creation disabled", creation), ("process control disabled", control)]
    for reason, names in groups:
        for name in names:
            for module in (os, posix):
                if hasattr(module, name):
                    setattr(module, name, refuse(reason, name))
    _posixsubprocess.fork_exec = refuse("process creation disabled", "subprocess")
    real_kill = os.kill

    def kill(pid, sig):
        if pid != os.getpid():
            raise SandboxViolation("process control disabled", f"kill({pid})")
        return real_kill(pid, sig)

    os.kill = posix.kill = kill


def guard_network():
    class NoNewSocket(socket.socket):
        # Wrapping an existing descriptor (socketpair, fromfd) is local and allowed.
        def __init__(self, family=-1, type=-1, proto=-1, fileno=None):
            if fileno is None:
                raise SandboxViolation("network disabled", "socket")
            super().__init__(family, type, proto, fileno)

    def refuse(name):
        def refused(*args, **kwargs):
            raise SandboxViolation("network disabled", name)
        return refused

    # _socket.socket stays: socket.socket.__init__ looks it up by name.
    socket.socket = socket.SocketType = NoNewSocket
    lookups = ["getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr", "getnameinfo"]
    for name in lookups:
        for module in (socket, _socket):
            setattr(module, name, refuse(name))


def print_traceback(exc):
    """The traceback without this script's frames (the code is "<code>", this script "<string>")."""
    top = report = traceback.TracebackException(type(exc), exc, exc.__traceback__.tb_next)
    seen = set()
    while report is not None and id(report) not in seen:
        seen.add(id(report))
        report.stack = traceback.StackSummary.from_list(
            [frame for frame in report.stack if frame.filename != "<string>"])
        report = report.__cause__ or report.__context__
    sys.stderr.write("".join(top.format()))


def describe(exc):
    status = {"exc_type": type(exc).__name__, "errno": getattr(exc, "errno", None),
              "violation": None, "exit_code": 1,
              "error_line": traceback.format_exception_only(type(exc), exc)[-1].strip()}
    cause, seen = exc, set()
    while cause is not None and id(cause) not in seen:  # urllib & co. wrap the guard's error
        seen.add(id(cause))
        if isinstance(cause, SandboxViolation):
            status["violation"] = [cause.reason, cause.what]
            break
        cause = cause.__cause__ or cause.__context__
    return status


def read_exactly(n):
    data = bytearray()
    while len(data) < n:
        chunk = READ_REQUEST(0, n - len(data))
        if not chunk:
            return None
        data.extend(chunk)
    return bytes(data)


def read_request():
    header = bytearray()
    while not header.endswith(b"\n"):
        byte = READ_REQUEST(0, 1)
        if not byte:
            return None
        header.extend(byte)
    body = read_exactly(int(header))
    return None if body is None else body.decode("utf-8", errors="replace")


def run_block(source, user_globals):
    linecache.cache["<code>"] = (len(source), None, source.splitlines(True), "<code>")
    reserve = bytearray(1 << 20)  # freed on failure so the traceback can be printed
    try:
        exec(compile(source, "<code>", "exec"), user_globals)
    except SystemExit as exc:
        code = exc.code
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        return {"exit_code": code or 0}
    except BaseException as exc:
        del reserve
        if isinstance(exc, MemoryError):
            user_globals.clear()  # what filled the memory is likely held there
            user_globals.update(__name__="__main__", __builtins__=builtins)
        print_traceback(exc)
        return describe(exc)
    return {"exit_code": 0}


def main():
    kernel_guards()
    set_limits()
    guard_files()
    guard_processes()
    guard_network()
    user_globals = {"__name__": "__main__", "__builtins__": builtins}
    exit_code = 0
    while (source := read_request()) is not None:
        status = run_block(source, user_globals)
        sys.stdout.flush()
        sys.stderr.flush()
        WRITE_STATUS(STATUS_FD, json.dumps(status).encode() + b"\n")
        exit_code = status["exit_code"]
    sys.exit(exit_code)


main()
'''

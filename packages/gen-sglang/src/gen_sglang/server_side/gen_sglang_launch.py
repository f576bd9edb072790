"""Runs ``sglang.launch_server`` (same arguments) and ends it when the process that started it
is gone.

A backend stops its servers on ``shutdown``, when collected and at exit; an owner killed
without a word (SIGKILL, the OOM killer) can do none of that. So the server watches its parent:
once it has been re-parented, it removes its files (its ``TMPDIR``, which ``SglangServer`` made
for it, and the files SGLang's processes have open in ``/dev/shm``) and kills its own
process group, which ``SglangServer`` made a session of its own holding the server and every
process SGLang started (scheduler, detokenizer, Python's resource tracker). The next staged
checkpoint made on the machine removes the owner's own shared-memory files
(``gen_sglang.checkpoint``).

Either way the session is killed with ``kill_session``: Python's resource tracker last, so it
unlinks the ``sem.mp-*`` semaphores SGLang's processes registered with it. Those semaphores
are named after the server (``semaphore_files``), so the ones a session killed all at once
leaves (its tracker with it) are found and removed too, and no other process's.

The module imports the standard library only: ``gen_sglang.server`` uses its process and file
scans too.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

_POLL_S = 1.0
_TRACKER = "multiprocessing.resource_tracker"
#: Before the launcher's pid, the name of every multiprocessing semaphore of a server's
#: processes (Python's own is ``/mp``, shared by every Python process on the machine).
_SEMAPHORE_PREFIX = ".mp-gen-sglang-"


def session_processes(pgid: int) -> list[int]:
    """The live (not zombie) processes of the session a server leads: itself, its scheduler
    and detokenizer, and whatever they started."""
    alive = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(entry.name))
    return alive


def shared_memory_files(pgid: int) -> set[Path]:
    """The files in ``/dev/shm`` that the processes of a server's session have open or mapped:
    SGLang's own (a ``sglang_loads_*`` slot file per server), which it leaves behind however
    it stops."""
    found: set[Path] = set()
    for pid in session_processes(pgid):
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
            links = [os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        links += [
            line[line.index("/dev/shm/") :] for line in maps.splitlines() if "/dev/shm/" in line
        ]
        found |= {Path(link) for link in links if link.startswith("/dev/shm/sglang_")}
    return found


def kill_session(pgid: int, grace_s: float = 5.0) -> None:
    """SIGKILL every process of a server's session, Python's resource tracker last.

    The tracker (one per session, started by SGLang's multiprocessing) holds the names of the
    semaphores and shared memory the session's processes made and have not released (the
    ``sem.mp-*`` files in ``/dev/shm``); once every other process is gone it reads the end of
    its pipe, unlinks them and exits. A SIGKILL to the whole session at once left one such file
    per start. Waits ``grace_s`` at most for the session to end, then kills what is left.

    Called from inside the session (the owner watch), the calling process is spared: it keeps
    the tracker's pipe open, so it must end itself next, and the tracker then cleans up alone.
    """
    me = os.getpid()
    inside = me in session_processes(pgid)
    deadline = time.monotonic() + grace_s
    while True:
        alive = [pid for pid in session_processes(pgid) if pid != me]
        now = time.monotonic()
        if not alive or now > deadline + grace_s:  # the rest cannot be killed: give up
            return
        for pid in alive:
            if now >= deadline or not _is_tracker(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if inside:
            return
        time.sleep(0.02)


def semaphore_files(pgid: int) -> list[Path]:
    """The multiprocessing semaphores in ``/dev/shm`` that the processes of the server whose
    session is ``pgid`` made: the launcher names them after itself (``_SEMAPHORE_PREFIX``)."""
    return sorted(Path("/dev/shm").glob(f"sem{_SEMAPHORE_PREFIX}{pgid}-*"))


def _is_tracker(pid: int) -> bool:
    try:
        return _TRACKER in Path(f"/proc/{pid}/cmdline").read_text()
    except OSError:
        return False


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_POLL_S)
    try:  # what gen_sglang.server's stop does, from inside
        shutil.rmtree(os.environ["TMPDIR"], ignore_errors=True)
        for slot in shared_memory_files(os.getpgrp()):
            slot.unlink(missing_ok=True)
        kill_session(os.getpgrp())
        for semaphore in semaphore_files(os.getpgrp()):  # those the tracker has not unlinked
            semaphore.unlink(missing_ok=True)
    finally:
        os.kill(os.getpid(), signal.SIGKILL)


def _name_semaphores() -> None:
    """Name the semaphores this process and the processes it starts make after this server.
    multiprocessing takes the prefix from the process's config, which the processes it
    spawns inherit."""
    import multiprocessing.process

    config = multiprocessing.process.current_process()._config  # type: ignore[attr-defined]
    config["semprefix"] = f"/{_SEMAPHORE_PREFIX[1:]}{os.getpid()}"


if __name__ == "__main__":
    _name_semaphores()
    threading.Thread(target=_watch, args=(os.getppid(),), name="owner-watch", daemon=True).start()
    sys.argv[0] = "sglang.launch_server"
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)

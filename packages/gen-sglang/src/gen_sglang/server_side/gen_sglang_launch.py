"""Runs ``sglang.launch_server`` (same arguments) and ends it when the process that started it
is gone.

A backend stops its servers on ``shutdown``, when collected and at exit; an owner killed
without a word (SIGKILL, the OOM killer) can do none of that. So the server watches its parent:
once it has been re-parented, it removes its files (its ``TMPDIR``, which ``SglangServer`` made
for it, and the files SGLang's processes have open in ``/dev/shm``) and kills its own
process group, which ``SglangServer`` made a session of its own holding the server and every
process SGLang started (scheduler, detokenizer). The next staged checkpoint made on the machine
removes the owner's own shared-memory files (``gen_sglang.checkpoint``).

The module imports the standard library only: ``gen_sglang.server`` uses its process and file
scans too.
"""

from __future__ import annotations

import os
import runpy
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

_POLL_S = 1.0


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


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_POLL_S)
    try:  # what gen_sglang.server's stop does, from inside
        shutil.rmtree(os.environ["TMPDIR"], ignore_errors=True)
        for slot in shared_memory_files(os.getpgrp()):
            slot.unlink(missing_ok=True)
    finally:
        os.killpg(os.getpgrp(), signal.SIGKILL)


if __name__ == "__main__":
    threading.Thread(target=_watch, args=(os.getppid(),), name="owner-watch", daemon=True).start()
    sys.argv[0] = "sglang.launch_server"
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)

"""Runs ``sglang.launch_server`` (same arguments) and ends it when the process that started it
is gone.

A backend stops its servers on ``shutdown``, when collected and at exit; an owner killed
without a word (SIGKILL, the OOM killer) can do none of that. So the server watches its parent:
once it has been re-parented, it removes its files (its ``TMPDIR``, which ``SglangServer`` made
for it, and the files SGLang's processes have open in ``/dev/shm``) and kills its own
process group, which ``SglangServer`` made a session of its own holding the server and every
process SGLang started (scheduler, detokenizer). The next staged checkpoint made on the machine
removes the owner's own shared-memory files (``gen_sglang.checkpoint``).
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


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(_POLL_S)
    try:  # as gen_sglang.server._stop does (this side cannot import gen_sglang)
        shutil.rmtree(os.environ["TMPDIR"], ignore_errors=True)
        for slot in _shared_memory_files():
            slot.unlink(missing_ok=True)
    finally:
        os.killpg(os.getpgrp(), signal.SIGKILL)


def _shared_memory_files() -> set[Path]:
    """SGLang's files in ``/dev/shm`` that this session's processes have open or mapped."""
    group = os.getpgrp()
    found: set[Path] = set()
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or os.getpgid(int(entry.name)) != group:
                continue
            links = [os.readlink(fd) for fd in (entry / "fd").iterdir()]
            maps = (entry / "maps").read_text()
        except OSError:
            continue
        links += [
            line[line.index("/dev/shm/") :] for line in maps.splitlines() if "/dev/shm/" in line
        ]
        found |= {Path(link) for link in links if link.startswith("/dev/shm/sglang_")}
    return found


if __name__ == "__main__":
    threading.Thread(target=_watch, args=(os.getppid(),), name="owner-watch", daemon=True).start()
    sys.argv[0] = "sglang.launch_server"
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)

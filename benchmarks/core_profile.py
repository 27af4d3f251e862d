"""py-spy sampling a server's engine core while a benchmark cell runs (``nmt bench batching --profile-core``).

The engine core is the process that decodes: with ``--frontends N`` the supervisor's child running
``server.core.process``, else the server process itself. py-spy (``pip install py-spy``; it needs to trace the
process, which a container may forbid) samples every thread of it, idle ones included, without pausing it, and
writes the collapsed stacks (one ``thread;frame;...;frame count`` line per stack) to a file; the summary printed
gives, for each thread (the inference worker first), the frames where most of its samples ended. Samples of the
worker that end in ONNX Runtime's ``run`` are the device's (or the CPU's) compute; those ending in the
interpreter's own frames (the search, the bindings, the hand-offs) are what surrounds each step.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from collections import Counter
from pathlib import Path

CORE_MODULE = "server.core.process"
RATE = 250  # samples a second


def core_pid(server_pid: int) -> int:
    """The engine core of the server started as ``server_pid``: its child running :data:`CORE_MODULE`, or the
    server itself when it has none (one process)."""
    children = []
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        children += [int(pid) for pid in (task / "children").read_text().split()]
    for pid in children:
        if CORE_MODULE in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode():
            return pid
    return server_pid


class CoreProfile:
    """``with CoreProfile(server_pid, path):`` samples the server's engine core until the block ends, then prints
    the summary (see the module docstring). Without py-spy, or where it cannot trace, it says so and the block
    runs unsampled."""

    def __init__(self, server_pid: int, path: Path) -> None:
        self.server_pid, self.path = server_pid, path
        self._process: subprocess.Popen | None = None

    def __enter__(self) -> CoreProfile:
        spy = shutil.which("py-spy")
        if spy is None:
            print(f"# no py-spy on PATH: {self.path.name} not sampled", flush=True)
            return self
        try:
            pid = core_pid(self.server_pid)
        except OSError as error:  # the server's process tree cannot be read
            print(f"# {self.path.name} not sampled: {error}", flush=True)
            return self
        self._process = subprocess.Popen(
            [spy, "record", "--pid", str(pid), "--rate", str(RATE), "--format", "raw", "--threads", "--idle",
             "--nonblocking", "--output", str(self.path)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        return self

    def __exit__(self, *_: object) -> None:
        if self._process is None:
            return
        self._process.send_signal(signal.SIGINT)  # py-spy writes its output on an interrupt
        try:
            _, errors = self._process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self._process.kill()
            _, errors = self._process.communicate()
        if not self.path.exists():
            print(f"# py-spy wrote no {self.path.name}: {errors.strip()[-300:]}", flush=True)
            return
        print(summary(self.path), flush=True)


def summary(path: Path, frames: int = 8) -> str:
    """For each thread in the collapsed stacks at ``path``, the ``frames`` frames where most of its samples ended,
    as shares of its samples (every thread is sampled at every tick, idle or not)."""
    threads: dict[str, Counter[str]] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        parts = stack.split(";")
        thread = next((part for part in parts if part.startswith("thread")), "?").partition(": ")[2] or "?"
        threads.setdefault(thread, Counter())[parts[-1]] += int(count)
    lines = [f"# engine core sampled at {RATE}/s ({path.name}), where each thread's samples ended:"]
    for thread, leaves in sorted(threads.items(), key=lambda item: not item[0].startswith("engine")):
        total = sum(leaves.values())
        lines.append(f"#   {thread} ({total} samples)")
        lines += [f"#     {count / total:5.1%}  {leaf}" for leaf, count in leaves.most_common(frames)]
    return "\n".join(lines)

"""milvus-lite served from its own process, so a local ``.db`` folder is reached like a server.

milvus-lite 3 can run its gRPC server inside the caller's process, where its faiss searches
would build an OpenMP team beside the model's and slow every decoding step (``threads``). Here
it runs as ``python -m milvus_lite server`` on a loopback port, with one OpenMP thread: a
search is a real round trip, and a stopped server is a real fault, as with a Milvus cluster.
One server per folder per process, stopped when the process exits, and by itself when the
process is killed (it would otherwise keep the folder locked).
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from rag_spec.errors import RagSpecError

START_TIMEOUT_S = 60.0

_servers: dict[Path, LiteServer] = {}
_servers_lock = threading.RLock()  # serving, starting and stopping, one at a time


class LiteServer:
    """A milvus-lite server process for one data folder, on a fixed loopback port (a restart
    keeps the address, so clients reconnect)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = _free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    @classmethod
    def serving(cls, folder: str | Path) -> LiteServer:
        """This process's server for ``folder``, started on first use (and again if it died)."""
        path = Path(folder).expanduser().resolve()
        with _servers_lock:
            server = _servers.get(path)
            if server is None:
                server = _servers[path] = cls(path)
            if not server.running():
                server.start()
            return server

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        """Start the process and wait until it accepts connections (bounded)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        log = self.folder.parent / f"{self.folder.name}.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the child's environment, not ours
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", __name__, str(os.getpid()), "server",
                 "--data-dir", str(self.folder), "--host", "127.0.0.1", "--port", str(self.port)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                msg = (f"milvus-lite could not serve {self.folder} (it exited with "
                       f"{self.process.returncode}): {_tail(log)} If another process serves "
                       f"this folder, stop it or connect to that server's URI instead.")
                raise RagSpecError(msg)
            if _accepts(self.port):
                return
            time.sleep(0.05)
        self.stop()
        msg = (f"milvus-lite did not start serving {self.folder} within {START_TIMEOUT_S:.0f} s; "
               f"its log is {log}.")
        raise RagSpecError(msg)

    def stop(self) -> None:
        """Stop the process (an interrupt lets it close its folder cleanly; then a kill)."""
        with _servers_lock:  # never while another thread starts it
            process = self.process
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGINT)
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
            self.process = None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def _tail(log: Path, lines: int = 3) -> str:
    try:
        return " ".join(log.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"


@atexit.register
def _stop_all() -> None:
    with _servers_lock:
        for server in _servers.values():
            server.stop()


def _serve(argv: list[str]) -> None:
    """``python -m rag_spec.retrieval.milvus_lite PARENT_PID server ...``: milvus-lite's own
    server, which stops cleanly on SIGTERM too and exits once its parent is gone."""
    from milvus_lite.cmdline import main

    parent = int(argv[0])

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    main(argv[1:])


if __name__ == "__main__":
    _serve(sys.argv[1:])

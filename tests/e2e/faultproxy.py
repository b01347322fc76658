"""A TCP forwarder that can cut and restore a link, for network faults on loopback."""

from __future__ import annotations

import contextlib
import socket
import threading


class FaultProxy:
    """Forwards ``listen_port`` to ``target_port`` on loopback until :meth:`cut`.

    A cut closes every forwarded connection (both sides see the link drop) and
    refuses new ones until :meth:`restore`, like a partition that breaks TCP.
    ``listen_port`` 0 takes an ephemeral port, kept across cuts;
    ``target_port`` may change (an engine restarted on new ports).
    """

    def __init__(self, listen_port: int = 0, target_port: int = 0, host: str = "127.0.0.1") -> None:
        self.listen_port = listen_port
        self.target_port = target_port
        self.host = host
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._open = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, daemon=True)

    def start(self) -> FaultProxy:
        self.restore()
        self._thread.start()
        return self

    def _listen(self) -> socket.socket:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((self.host, self.listen_port))
        self.listen_port = int(s.getsockname()[1])
        s.listen(16)
        s.settimeout(0.1)
        return s

    def restore(self) -> None:
        with self._lock:
            if self._listener is None:
                self._listener = self._listen()
        self._open.set()

    def cut(self) -> None:
        self._open.clear()
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._conns = self._conns, set()
        if listener is not None:
            listener.close()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()

    def close(self) -> None:
        self._closed = True
        self.cut()
        self._open.set()
        self._thread.join(timeout=5)

    def _accept_loop(self) -> None:
        while not self._closed:
            if not self._open.wait(timeout=0.1):
                continue
            with self._lock:
                listener = self._listener
            if listener is None:
                continue
            try:
                down, _ = listener.accept()
            except (TimeoutError, OSError):
                continue
            try:
                up = socket.create_connection((self.host, self.target_port), timeout=1.0)
            except OSError:
                down.close()
                continue
            up.settimeout(None)
            down.settimeout(None)
            with self._lock:
                if not self._open.is_set():
                    down.close()
                    up.close()
                    continue
                self._conns.update((down, up))
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()
            with self._lock:
                self._conns.discard(src)
                self._conns.discard(dst)

"""The lifecycle the fake HTTP servers share: a ThreadingHTTPServer on 127.0.0.1 (a free port), served by a
daemon thread between ``start()`` and ``stop()`` (or as a context manager)."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self


class ServedInThread(ABC):
    """Subclasses give ``start()`` their handler class through ``_serve``."""

    _httpd: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None

    def _serve(self, handler: type[BaseHTTPRequestHandler], block_on_close: bool = True) -> Self:
        httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        httpd.daemon_threads = True
        httpd.block_on_close = block_on_close
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    @abstractmethod
    def start(self) -> Self:
        """Serve (``_serve`` with the subclass's handler); returns self."""

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

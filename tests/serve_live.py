"""A `fastqwen serve` app on loopback in a thread, for the tests that drive it over HTTP."""
from __future__ import annotations

import contextlib
import socket
import threading
import time


@contextlib.contextmanager
def serving(srv):
    """srv (a fastqwen.serve.app.Server) behind uvicorn on a free port; yields its URL once /health
    answers 200 (an error if it does not within 60 s); on exit the web server stops and srv is closed."""
    import httpx
    import uvicorn

    from fastqwen.serve.app import create_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    web = uvicorn.Server(uvicorn.Config(create_app(srv), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=web.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or not thread.is_alive():
            web.should_exit = True
            srv.close()
            raise RuntimeError(f"the server at {url} did not answer /health with 200 within 60 s")
        time.sleep(0.05)
    try:
        yield url
    finally:
        web.should_exit = True
        thread.join(timeout=10)
        srv.close()

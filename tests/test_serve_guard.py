"""The server's guard (treespec.serve.guard), in process over ASGI: API keys on the /v1 routes,
compared in constant time, /health and /metrics open; bodies over the limit answered 413,
declared or chunked; where the keys come from; the warning for an open server beyond loopback;
clients that stall (headers or body) answered 408 over a real socket.
The guarded server end to end: tests/test_serve.py (413, --max-tree-nodes)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from treespec.serve.cli import access, engine_threads  # noqa: E402
from treespec.serve.guard import API_KEY_ENV, Guard, read_api_keys  # noqa: E402


async def echo(scope, receive, send):
    """The app behind the guard: answers with the body it read (an OpenAI model list on GET)."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    data = body or json.dumps({"object": "list", "data": []}).encode()
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
    )
    await send({"type": "http.response.body", "body": data})


def call(guard, method, path, **kw):
    async def go():
        transport = httpx.ASGITransport(app=guard)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.request(method, path, **kw)

    return asyncio.run(go())


def test_v1_routes_want_a_key_and_health_and_metrics_do_not():
    guard = Guard(echo, api_keys=("k1", "k2"))
    for headers in (
        {},
        {"authorization": "Bearer wrong"},
        {"authorization": "k1"},
        {"authorization": "Basic k1"},
    ):
        r = call(guard, "POST", "/v1/completions", headers=headers, content=b"{}")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", headers
        assert r.json()["error"]["code"] == "invalid_api_key" and "Bearer" in r.json()["error"]["message"]
    for key in ("k1", "k2"):
        assert (
            call(guard, "POST", "/v1/completions", headers={"authorization": f"Bearer {key}"}).status_code
            == 200
        )
    assert call(guard, "GET", "/health").status_code == 200
    assert call(guard, "GET", "/metrics").status_code == 200
    assert call(Guard(echo), "GET", "/v1/models").status_code == 200  # no keys: open


def test_the_schema_and_docs_pages_want_a_key_too():
    guard = Guard(echo, api_keys=("k1",))
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert call(guard, "GET", path).status_code == 401, path
        assert call(guard, "GET", path, headers={"authorization": "Bearer k1"}).status_code == 200, path
    assert call(Guard(echo), "GET", "/openapi.json").status_code == 200  # no keys: open


def test_the_openai_client_sees_an_authentication_error():
    guard = Guard(echo, api_keys=("secret",))

    async def models(key):
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=guard))
        async with openai.AsyncOpenAI(
            base_url="http://t/v1", api_key=key, http_client=http, max_retries=0
        ) as c:
            return await c.models.list()

    with pytest.raises(openai.AuthenticationError):
        asyncio.run(models("wrong"))
    assert asyncio.run(models("secret")).data == []


def test_bodies_over_the_limit_are_413_declared_or_chunked():
    guard = Guard(echo, max_body_bytes=100)
    r = call(guard, "POST", "/v1/completions", content=b"x" * 101)
    assert r.status_code == 413 and "100 bytes" in r.json()["error"]["message"]
    assert call(guard, "POST", "/v1/completions", content=b"x" * 100).text == "x" * 100

    def chunks(n):
        async def gen():
            for _ in range(n):
                yield b"y" * 30

        return gen()

    assert call(guard, "POST", "/v1/completions", content=chunks(4)).status_code == 413  # 120 bytes
    r = call(guard, "POST", "/v1/completions", content=chunks(3))  # 90: handed on whole
    assert r.status_code == 200 and r.text == "y" * 90


def test_keys_come_from_flags_the_environment_and_a_file(tmp_path, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    f = tmp_path / "keys"
    f.write_text("# ops\nalpha\n\n beta \n")
    assert read_api_keys(["k"], str(f)) == ("k", "alpha", "beta")
    monkeypatch.setenv(API_KEY_ENV, "env")
    assert read_api_keys(None, None) == ("env",)
    f.write_text("# none\n")
    with pytest.raises(ValueError, match="no key in it"):
        read_api_keys(None, str(f))
    with pytest.raises(ValueError, match="cannot read"):
        read_api_keys(None, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="empty"):
        read_api_keys([" "], None)


def test_an_open_server_beyond_loopback_is_warned_about(monkeypatch, caplog):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    args = argparse.Namespace(api_key=None, api_key_file=None, host="0.0.0.0")
    with caplog.at_level(logging.WARNING, logger="treespec.serve"):
        assert access(args) == ()
        access(argparse.Namespace(api_key=None, api_key_file=None, host="127.0.0.1"))
        access(argparse.Namespace(api_key=["k"], api_key_file=None, host="0.0.0.0"))
    assert len(caplog.records) == 1 and "no API key" in caplog.records[0].getMessage()


def test_shared_tree_nodes_and_deterministic_exclude_each_other(capsys):
    """Trimming trees by load makes outputs depend on the load: refused before loading."""
    from treespec.cli import main

    assert main(["serve", "--deterministic", "--shared-tree-nodes", "4"]) == 2
    assert (
        "--shared-tree-nodes trims trees by load; --deterministic rules that out" in capsys.readouterr().err
    )
    assert main(["serve", "--shared-tree-nodes", "-1"]) == 2
    assert "--shared-tree-nodes must be >= 0, got -1" in capsys.readouterr().err


def test_a_client_that_stalls_gets_408_and_loses_its_connection():
    """A real uvicorn over a socket (`timed_h11` below ASGI, the Guard's body clock above it):
    a connection that sends nothing, half its headers, or half its body (declared or chunked)
    is answered 408 and closed after the read timeout; a whole request is answered as ever,
    and a stalled keep-alive connection is closed too."""
    import socket
    import threading
    import time

    import uvicorn

    from treespec.serve.guard import timed_h11

    timeout = 0.5
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    guarded = Guard(echo, max_body_bytes=1 << 20, read_timeout=timeout)
    config = uvicorn.Config(guarded, host="127.0.0.1", port=port, http=timed_h11(timeout), log_level="error")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.05)

        def send(payload: bytes) -> tuple[bytes, float]:
            with socket.create_connection(("127.0.0.1", port)) as c:
                c.settimeout(10)
                c.sendall(payload)
                t0, data = time.monotonic(), b""
                while chunk := c.recv(4096):  # until the server closes
                    data += chunk
                return data, time.monotonic() - t0

        post = b"POST /v1/completions HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\n"
        for payload in (
            b"",
            b"GET /health HTTP/1.1\r\nhost: t\r\n",
            post + b"content-length: 100\r\n\r\n{",
            post + b"transfer-encoding: chunked\r\n\r\n1\r\n{\r\n",
        ):
            data, waited = send(payload)
            assert data.startswith(b"HTTP/1.1 408"), (payload, data)
            assert timeout * 0.8 < waited < timeout + 5
            if payload.startswith(b"POST"):
                assert b'"code": "request_timeout"' in data and b"--read-timeout" in data
        data, waited = send(b"GET /health HTTP/1.1\r\nhost: t\r\n\r\n")  # answered, then kept alive
        assert data.startswith(b"HTTP/1.1 200") and waited < timeout + 5
    finally:
        server.should_exit = True
        thread.join(10)


def test_a_cpu_server_leaves_one_core_to_its_event_loop():
    """The engine decodes with torch's threads less one (never fewer than one): the event loop
    wakes every round, and on a core torch also uses it stalls the product (docs/serving.md)."""
    assert [engine_threads(n) for n in (1, 2, 4, 16)] == [1, 1, 3, 15]

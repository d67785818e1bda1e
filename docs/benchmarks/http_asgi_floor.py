"""The floor under the HTTP single send on an asyncio server: the service's send statement
behind uvicorn (uvloop, httptools) and an ASGI callable with no framework, beside the sync
floor (a WSGI callable under gunicorn, `http_send_floor.py`), delaysvc's own app and the raw
insert the HTTP target is set against (issue 36: "single send at 50 clients >= 25% of the raw
insert").

    pip install uvicorn uvloop httptools uvicorn-worker
    python docs/benchmarks/http_asgi_floor.py [SERVER_URL] [ROUNDS] [SECONDS]

(default postgresql://root@127.0.0.1:5432/postgres, 2 rounds of 15 s; it works in a database
of its own.) Each round, in turn: the raw one-row insert at 50 clients (as `delaysvc bench
http` measures it), then wrk with 50 connections posting `delaysvc bench http`'s single-send
body to

- delaysvc's app under `delaysvc web`'s command (gunicorn -w 4);
- a WSGI callable calling `Producer.send_item`, under gunicorn -w 4 (the sync floor);
- an ASGI callable that checks the body as `send_item` does (`Producer._prepare_item`) and runs
  the single send's statement (`SEND_ONE`, prepared, autocommitted) on a psycopg
  AsyncConnection of a pool (4 connections a process), under uvicorn with 2 worker processes;
- the same, but sends that arrive while one is written wait and are written together in the
  group statement (`SEND_GROUP`, as `Producer(group_writers=2)` does with threads), two writes
  at most under way in a process; under uvicorn with 2 and 4 worker processes, and under
  gunicorn's master with 2 of uvicorn's workers (`pip install uvicorn-worker`), as `delaysvc
  web` could run it.

No token is checked by the floors (nor by the WSGI one). Each line gives requests/s, their
share of the raw insert, the web workers' CPU a request and the messages stored meanwhile
(wrk counts the requests answered; a request cut off at the run's end may be stored
unanswered).
"""

from __future__ import annotations

import sys
import textwrap

import http_ceiling
import http_send_floor

APPS = http_send_floor.APPS + textwrap.dedent(
    """
    import asyncio
    import os

    from psycopg_pool import AsyncConnectionPool

    from delaysvc.config.validation import json_text
    from delaysvc.db.engines import libpq_url
    from delaysvc.store.producing import SEND_GROUP, SEND_ONE, _driver_sql, _message_params

    GROUPED = os.environ.get("FLOOR_GROUPED") == "1"
    WRITERS = 2
    ONE, GROUP = _driver_sql(SEND_ONE), _driver_sql(SEND_GROUP)
    pool = None
    waiting = []
    writing = 0
    async def one(params):
        async with pool.connection() as conn:
            cursor = await conn.execute(ONE, {**params, "caps_held": False}, prepare=True)
            return await cursor.fetchone()

    async def grouped(params):
        global writing
        done = asyncio.get_running_loop().create_future()
        waiting.append((params, done))
        if writing < WRITERS:
            writing += 1
            asyncio.create_task(write())
        return await done

    async def write():
        global waiting, writing
        try:
            while waiting:
                group, waiting = waiting, []
                try:
                    if len(group) == 1:
                        rows = [await one(group[0][0])]
                    else:
                        names = group[0][0]
                        lists = {n: [p[n] for p, _ in group] for n in names}
                        lists["tags"] = [None if t is None else json_text(t) for t in lists["tags"]]
                        async with pool.connection() as conn:
                            cursor = await conn.execute(GROUP, lists, prepare=True)
                            rows = await cursor.fetchall()
                except Exception as exc:
                    for _, done in group:
                        done.set_exception(exc)
                    continue
                for (_, done), row in zip(group, rows):
                    done.set_result(row)
        finally:
            writing -= 1

    async def asgi_app(scope, receive, send):
        global pool
        if scope["type"] == "lifespan":
            while True:
                event = await receive()
                if event["type"] == "lifespan.startup":
                    pool = AsyncConnectionPool(
                        libpq_url(settings.database_url), min_size=4, max_size=4,
                        kwargs={"autocommit": True}, open=False,
                    )
                    await pool.open(wait=True)
                    await send({"type": "lifespan.startup.complete"})
                elif event["type"] == "lifespan.shutdown":
                    await pool.close()
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["path"] == "/healthz":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/plain")]})
            await send({"type": "http.response.body", "body": b"ok"})
            return
        body, more = b"", True
        while more:
            event = await receive()
            body += event.get("body", b"")
            more = event.get("more_body", False)
        new = producer._prepare_item(json.loads(body), None)
        row = await (grouped if GROUPED else one)(_message_params(new))
        answer = json.dumps({"id": row[0], "topic": new.topic, "created": True}).encode()
        await send({"type": "http.response.start", "status": 201, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(answer)).encode()),
        ]})
        await send({"type": "http.response.body", "body": answer})
    """
)


def uvicorn(folder: str, port: int, workers: int) -> list[str]:
    return [
        sys.executable, "-m", "uvicorn", "--host", "127.0.0.1", "--port", str(port),
        "--workers", str(workers), "--loop", "uvloop", "--http", "httptools",
        "--no-access-log", "--log-level", "warning", "--app-dir", folder, "floor_apps:asgi_app",
    ]  # fmt: skip


def servers(folder: str, port: int) -> dict[str, tuple[list[str], dict[str, str]]]:
    """name -> (the command serving it on `port`, its environment's own variables)."""
    sync = http_send_floor.servers(folder, port)
    grouped = {"FLOOR_GROUPED": "1"}
    gunicorn = [sys.executable, "-m", "gunicorn", "-b", f"127.0.0.1:{port}", "-w", "2"]
    gunicorn += ["--log-level", "warning", "-k", "uvicorn_worker.UvicornWorker"]
    return {
        **{name: sync[name] for name in SYNC},
        "ASGI + async send, uvicorn 2 workers": (uvicorn(folder, port, 2), {}),
        "ASGI + async group send, uvicorn 2 workers": (uvicorn(folder, port, 2), grouped),
        "ASGI + async group send, uvicorn 4 workers": (uvicorn(folder, port, 4), grouped),
        "ASGI + async group send, gunicorn -w 2 -k UvicornWorker": (
            [*gunicorn, "--chdir", folder, "floor_apps:asgi_app"],
            grouped,
        ),
    }


SYNC = ("delaysvc's app, gunicorn -w 4", "WSGI + send_item, gunicorn -w 4")
"""The sync floor's servers measured beside these (`http_send_floor.servers`)."""


if __name__ == "__main__":
    http_ceiling.SECONDS = float(sys.argv[3]) if len(sys.argv) > 3 else 15.0
    http_send_floor.in_rounds(
        sys.argv[1] if len(sys.argv) > 1 else "postgresql://root@127.0.0.1:5432/postgres",
        int(sys.argv[2]) if len(sys.argv) > 2 else 2,
        "delaysvc_http_asgi_floor",
        APPS,
        servers,
    )

"""Single sends on an event loop (`delaysvc.producer.aio`) and the web app as an ASGI callable
(`delaysvc.web.asgi`, `delaysvc web --server asgi`): sends that meet are written together, each
stored once; every answer is the Flask app's answer to the same request; and the real server
(gunicorn's master, uvicorn's workers) serves many sends at once, the dashboard's pages too."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from sqlalchemy import Engine

from delaysvc import auth
from delaysvc.config.settings import Settings
from delaysvc.db.engines import make_engine
from delaysvc.db.names import sql
from delaysvc.errors import ValidationError
from delaysvc.producer.aio import CONNECT_SECONDS, AsyncSends
from delaysvc.producer.grouping import MOST
from delaysvc.producer.sending import Producer
from delaysvc.runtime.commands import web_command
from delaysvc.runtime.supervisor import (
    die_with_parent,
    free_port,
    wait_until_answering,
)
from delaysvc.web.asgi import AsgiApp
from tests.conftest import outside_env

URL = "/api/v1/messages"
ORDER = {"topic": "order.cancel", "body": {"id": 42}, "delay": "30m", "key": "order-42"}


def _stored(engine: Engine) -> list[tuple[int, str, str | None]]:
    with engine.connect() as conn:
        rows = conn.execute(sql("SELECT id, topic, key FROM delaysvc.commit_log ORDER BY id"))
        return [tuple(row) for row in rows]  # type: ignore[misc]


async def _opened(sends: AsyncSends) -> AsyncSends:
    await sends.open()
    return sends


def test_sends_that_meet_are_written_together_each_stored_once(
    producer: Producer, engine: Engine
) -> None:
    async def main() -> tuple[list[Any], int]:
        sends = await _opened(AsyncSends(producer, writers=1))
        try:
            items = [{"topic": "t.meet", "body": n, "delay": "30s"} for n in range(100)]
            sent = await asyncio.gather(*(sends.send_item(item) for item in items))
            return sent, sends.groups
        finally:
            await sends.close()

    sent, groups = asyncio.run(main())
    assert all(message is not None and message.created for message in sent)
    ids = [message.id for message in sent]
    assert len(set(ids)) == 100
    # all 100 came before the first write began: MOST (64) of them, then the other 36
    assert MOST == 64 and groups == 2
    assert [row[0] for row in _stored(engine)] == sorted(ids)
    assert (sent[7].topic, sent[7].status) == ("t.meet", "scheduled")
    assert sent[7].deliver_at - sent[7].stored_at == timedelta(seconds=30)


def test_what_the_loop_does_not_store_is_left_to_the_producer(
    settings: Settings, producer: Producer, engine: Engine
) -> None:
    producer.send(ORDER["topic"], ORDER["body"], delay="30m", key=ORDER["key"])
    capped = Producer(
        Settings(
            database_url=settings.database_url,
            delay_levels=settings.delay_levels,
            backlog_caps="topic:t.capped=5:reject",
        ),
        engine,
    )

    async def main() -> list[Any]:
        sends = await _opened(AsyncSends(producer))
        own_caps = await _opened(AsyncSends(capped))
        try:
            with pytest.raises(ValidationError, match="delay"):
                await sends.send_item({"topic": "t", "body": 1, "delay": "soon"})
            return [
                await sends.send_item(ORDER),  # its key is held: the holder is the producer's
                await sends.send_item({**ORDER, "key": "order-43", "on_duplicate": "replace"}),
                await own_caps.send_item({"topic": "t.capped", "body": 1}),
            ]
        finally:
            await sends.close()
            await own_caps.close()

    assert asyncio.run(main()) == [None, None, None]
    assert len(_stored(engine)) == 1  # the first send's alone


def test_a_connection_the_server_closed_while_idle_costs_a_send_no_error(
    producer: Producer, engine: Engine
) -> None:
    async def main() -> list[Any]:
        sends = await _opened(AsyncSends(producer))
        try:
            first = await sends.send_item({"topic": "t.restart", "body": 1})
            with engine.connect() as conn:  # as a restart ends them: every idle one of ours
                ended = conn.execute(
                    sql(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                        "AND state = 'idle'"
                    )
                ).scalar_one()
            assert ended >= 1
            await asyncio.sleep(0.2)  # the goodbye reaches the pooled connection's socket
            return [first, await sends.send_item({"topic": "t.restart", "body": 2})]
        finally:
            await sends.close()

    sent = asyncio.run(main())
    assert all(message is not None and message.created for message in sent)
    assert [row[0] for row in _stored(engine)] == [message.id for message in sent]


def test_a_database_not_reached_leaves_the_send_to_the_producer_within_seconds(
    settings: Settings,
) -> None:
    unreachable = Settings(
        database_url=f"postgresql://root@127.0.0.1:{free_port()}/nowhere",
        delay_levels=settings.delay_levels,
    )
    producer = Producer(unreachable, make_engine(unreachable))

    async def main() -> Any:
        sends = await _opened(AsyncSends(producer))
        try:
            return await sends.send_item({"topic": "t.down", "body": 1})
        finally:
            await sends.close()

    started = time.monotonic()
    assert asyncio.run(main()) is None  # nothing was sent: the app's send answers the outage
    assert time.monotonic() - started < CONNECT_SECONDS + 5


# ---------------------------------------------------------------- the ASGI app in-process


@pytest.fixture
def asgi(app: Flask) -> Iterator[AsgiApp]:
    services = app.extensions["delaysvc"]
    yield AsgiApp(app, AsyncSends(services["producer"]), services["engine"])


async def _request(
    asgi: AsgiApp,
    path: str,
    body: bytes,
    headers: dict[str, str],
    method: str = "POST",
    chunked: bool = False,
) -> tuple[int, dict[str, str], bytes]:
    """One request through the ASGI callable, as a server makes it (`chunked`: its body sent
    with `Transfer-Encoding: chunked`, in two parts, with no Content-Length)."""
    events = [{"type": "http.request", "body": body, "more_body": False}]
    length = [(b"content-length", str(len(body)).encode())]
    if chunked:
        half = len(body) // 2
        events = [
            {"type": "http.request", "body": body[half:], "more_body": False},
            {"type": "http.request", "body": body[:half], "more_body": True},
        ]
        length = [(b"transfer-encoding", b"chunked")]
    answer: dict[str, Any] = {"body": b""}

    async def receive() -> dict[str, Any]:
        if events:
            return events.pop()
        await asyncio.sleep(3600)  # the client waits for its answer
        raise AssertionError("not reached")

    async def send(event: dict[str, Any]) -> None:
        if event["type"] == "http.response.start":
            answer["status"] = event["status"]
            answer["headers"] = {k.decode(): v.decode() for k, v in event["headers"]}
        else:
            answer["body"] += event.get("body", b"")

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "server": ("127.0.0.1", 80),
        "client": ("127.0.0.1", 5000),
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        + [*length, (b"host", b"localhost")],
    }
    await asgi(scope, receive, send)
    return answer["status"], answer["headers"], answer["body"]


def _through_both(
    asgi: AsgiApp, client: FlaskClient, requests: list[tuple[bytes, dict[str, str]]]
) -> list[tuple[tuple[int, Any], tuple[int, Any]]]:
    """Each request through the ASGI app, then the same through the Flask app: (status,
    JSON answer) of each."""

    async def main() -> list[tuple[int, dict[str, str], bytes]]:
        await asgi.sends.open()
        try:
            return [await _request(asgi, URL, body, headers) for body, headers in requests]
        finally:
            await asgi.sends.close()

    answered = asyncio.run(main())
    pairs = []
    for (status, _, body), (sent, headers) in zip(answered, requests, strict=True):
        flask = client.post(URL, data=sent, headers=headers)
        pairs.append(((status, json.loads(body)), (flask.status_code, flask.get_json())))
    return pairs


def _shape(answer: Any) -> Any:
    """An answer without what differs from one message to the next."""
    if isinstance(answer, dict) and "id" in answer:
        return {k: v for k, v in answer.items() if k not in ("id", "deliver_at")}
    return answer


def test_the_asgi_app_answers_each_send_as_the_flask_app_does(
    asgi: AsgiApp, client: FlaskClient, engine: Engine
) -> None:
    token = auth.create_token(engine, "shop", "send")
    sms_only = auth.create_token(engine, "sms", "send", ["sms"])
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    limited = {**headers, "Authorization": f"Bearer {sms_only}"}
    plain = json.dumps({"topic": "greet", "body": {"name": "Ada"}, "delay": "5m"}).encode()
    requests = [
        (plain, headers),
        (json.dumps(ORDER).encode(), headers),
        (json.dumps({"topic": "greet", "body": 1, "delay": "soon"}).encode(), headers),
        (json.dumps({"topic": "greet"}).encode(), headers),
        (b"[1, 2]", headers),
        (b"{not json", headers),
        (plain, {**headers, "Authorization": "Bearer nope"}),
        (plain, {"Content-Type": "application/json"}),
        (plain, limited),
    ]
    pairs = _through_both(asgi, client, requests)
    statuses = [(ours[0], flasks[0]) for ours, flasks in pairs]
    assert statuses == [
        (201, 201),
        (201, 200),  # the ASGI app stored order-42 first; Flask's send found it held
        (400, 400),
        (400, 400),
        (400, 400),
        (400, 400),
        (401, 401),
        (401, 401),
        (403, 403),
    ]
    assert pairs[1][0][1] == {**pairs[1][1][1]}  # the holder, as the app answers a held key
    for ours, flasks in pairs[2:]:
        assert ours == flasks
    assert _shape(pairs[0][0][1]) == _shape(pairs[0][1][1])
    assert set(pairs[0][0][1]) == {"id", "topic", "key", "status", "delay_level", "deliver_at"}
    stored = _stored(engine)
    assert [(topic, key) for _, topic, key in stored] == [
        ("greet", None),
        ("order.cancel", "order-42"),
        ("greet", None),
    ]


def test_a_connection_lost_once_the_send_was_written_is_a_503_and_no_second_send(
    asgi: AsgiApp, engine: Engine
) -> None:
    token = auth.create_token(engine, "shop", "send")
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    body = json.dumps({"topic": "greet", "body": 1}).encode()

    async def main() -> tuple[int, dict[str, str], bytes]:
        await asgi.sends.open()
        try:
            with engine.connect() as locker:  # the send's statement waits on the commit log
                locker.execute(sql("LOCK TABLE delaysvc.commit_log IN ACCESS EXCLUSIVE MODE"))
                request = asyncio.create_task(_request(asgi, URL, body, headers))
                waiting: list[int] = []
                for _ in range(200):
                    await asyncio.sleep(0.05)
                    waiting = list(
                        locker.execute(
                            sql(
                                "SELECT pid FROM pg_stat_activity WHERE wait_event_type = "
                                "'Lock' AND datname = current_database()"
                            )
                        ).scalars()
                    )
                    if waiting:
                        break
                assert len(waiting) == 1
                locker.execute(sql("SELECT pg_terminate_backend(:pid)"), {"pid": waiting[0]})
                answer = await asyncio.wait_for(request, 30)  # not a send again: it would wait
                locker.rollback()
            return answer
        finally:
            await asgi.sends.close()

    status, headers_given, answer = asyncio.run(main())
    assert status == 503 and headers_given["retry-after"] == "1"
    error = json.loads(answer)["error"]
    assert error["code"] == "unavailable"
    assert "may be stored: send again with the same key" in error["message"]
    assert _stored(engine) == []  # killed before it committed, and not sent again


def test_a_chunked_request_body_is_read_whole_and_one_over_the_limit_is_413(
    asgi: AsgiApp, engine: Engine
) -> None:
    """A body sent with `Transfer-Encoding: chunked` (no Content-Length), as the sync server
    reads it: it used to be read as empty, every such request a 400 "must be a JSON object"."""
    token = auth.create_token(engine, "shop", "admin")
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    one = json.dumps({"topic": "greet", "body": {"name": "Ada"}}).encode()
    batch = json.dumps({"messages": [{"topic": "greet", "body": n} for n in range(3)]}).encode()
    limits = json.dumps({"max_running": 3}).encode()
    too_big = json.dumps({"topic": "greet", "body": "x" * (9 * 1024 * 1024)}).encode()

    async def main() -> list[tuple[int, dict[str, str], bytes]]:
        await asgi.sends.open()
        try:
            return [
                await _request(asgi, URL, one, headers, chunked=True),
                await _request(asgi, URL + "/batch", batch, headers, chunked=True),
                await _request(asgi, "/api/v1/topics/greet/limits", limits, headers, "PUT", True),
                await _request(asgi, URL, too_big, headers, chunked=True),
            ]
        finally:
            await asgi.sends.close()

    answers = asyncio.run(main())
    assert [status for status, _, _ in answers] == [201, 201, 200, 413], answers
    assert len(_stored(engine)) == 4


def test_other_requests_are_the_flask_apps(asgi: AsgiApp, engine: Engine) -> None:
    token = auth.create_token(engine, "shop", "send")
    headers = {"Authorization": f"Bearer {token}"}

    async def main() -> list[tuple[int, dict[str, str], bytes]]:
        return [
            await _request(asgi, "/healthz", b"", {}, method="GET"),
            await _request(asgi, "/api/v1/levels", b"", headers, method="GET"),
            await _request(asgi, "/api/v1/nowhere", b"", headers, method="GET"),
        ]

    (health, _, _), (levels, _, body), (missing, _, error) = asyncio.run(main())
    assert (health, levels, missing) == (200, 200, 404)
    lanes = [level["lane"] for level in json.loads(body)["levels"]]
    assert {"level-1", "level-2", "level-3"} <= set(lanes)
    assert json.loads(error)["error"]["code"] == "not_found"


# ---------------------------------------------------------------- the real server


def test_the_asgi_server_stores_many_sends_at_once(database_url: str, engine: Engine) -> None:
    token = auth.create_token(engine, "shop", "send")
    port = free_port()
    command = web_command("127.0.0.1", port, workers=2, access_log=False, server="asgi")
    env = outside_env() | {"DELAYSVC_DATABASE_URL": database_url}
    web = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, preexec_fn=die_with_parent()
    )

    def post(n: int) -> tuple[int, dict[str, Any]]:
        body = json.dumps({"topic": "t.many", "body": n, "delay_ms": 60_000}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}{URL}",
            data=body,
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, json.loads(answer.read())

    try:
        assert wait_until_answering(f"http://127.0.0.1:{port}/healthz", process=web)
        with ThreadPoolExecutor(max_workers=20) as pool:
            answers = list(pool.map(post, range(200)))
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/login", timeout=30) as page:
            assert page.status == 200 and b"<form" in page.read()
    finally:
        web.terminate()
        web.wait(timeout=30)
    assert {status for status, _ in answers} == {201}
    ids = [answer["id"] for _, answer in answers]
    assert len(set(ids)) == 200
    assert sorted(ids) == [row[0] for row in _stored(engine)]

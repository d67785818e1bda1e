"""The dashboard's searches through Flask's test client against a real database: messages by keyset
pages (never through the backlog), a message's page and its cancel, dead letters grouped,
redriven and purged."""

from __future__ import annotations

import re
from typing import Any

import pytest
from flask.testing import FlaskClient
from sqlalchemy import Engine, text

from delaysvc.config.settings import Settings
from delaysvc.db.names import qualify
from delaysvc.maintenance import history
from delaysvc.producer.sending import Producer
from delaysvc.store import dashboard as dash
from delaysvc.store import history as store_history
from tests.support.dashboard import csrf, flashes, make_dead


def _ids_on(page: str) -> list[int]:
    return [int(i) for i in re.findall(r'<tr data-key="(\d+)">', page)]


def _link(page: str, name: str) -> Any:
    found = re.search(rf'href="([^"]+)" id="{name}"', page)
    return found.group(1).replace("&amp;", "&") if found else None


def test_message_search_filters_and_pages_by_id(admin: FlaskClient, producer: Producer) -> None:
    ids = [
        producer.send("dash.a" if n % 2 else "dash.b", {"n": n}, key=f"k{n}", delay_level=5).id
        for n in range(7)
    ]
    page = admin.get("/messages?limit=20")
    assert _ids_on(page.text) == ids[::-1]
    first = admin.get("/messages?limit=3").text
    assert _ids_on(first) == ids[6:3:-1]
    assert _link(first, "newer") is None
    second = admin.get(_link(first, "older")).text
    assert _ids_on(second) == ids[3:0:-1]
    assert _ids_on(admin.get(_link(second, "newer")).text) == ids[6:3:-1]
    third = admin.get(_link(second, "older")).text
    assert _ids_on(third) == [ids[0]]
    assert _link(third, "older") is None
    assert _ids_on(admin.get("/messages?topic=dash.a").text) == [ids[5], ids[3], ids[1]]
    assert _ids_on(admin.get("/messages?topic=dash.b&key=k4").text) == [ids[4]]
    assert _ids_on(admin.get(f"/messages?id={ids[2]}").text) == [ids[2]]
    assert _ids_on(admin.get("/messages?status=scheduled&limit=2").text) == ids[6:4:-1]
    assert _ids_on(admin.get("/messages?status=dead").text) == []
    assert _ids_on(admin.get("/messages?from=2000-01-01T00:00&to=2000-01-02T00:00").text) == []
    assert _ids_on(admin.get("/messages?from=2000-01-01T00:00:00%2B00:00").text) == ids[::-1]
    bad = admin.get("/messages?status=lost")
    assert bad.status_code == 400 and "status: &#39;lost&#39; is not one of" in bad.text
    assert admin.get("/messages?id=abc").status_code == 400
    assert admin.get("/messages?from=yesterday").status_code == 400


def test_search_messages_keyset_cursors(engine: Engine, producer: Producer) -> None:
    ids = [producer.send("dash.a", {"n": n}, delay_level=5).id for n in range(5)]
    with engine.connect() as conn:
        page = dash.search_messages(conn, dash.MessageSearch(limit=2))
        assert ([r.id for r in page.rows], page.older, page.newer) == (
            [ids[4], ids[3]],
            ids[3],
            None,
        )
        page = dash.search_messages(conn, dash.MessageSearch(before=ids[3], limit=2))
        assert ([r.id for r in page.rows], page.older, page.newer) == (
            [ids[2], ids[1]],
            ids[1],
            ids[2],
        )
        page = dash.search_messages(conn, dash.MessageSearch(before=ids[1], limit=2))
        assert ([r.id for r in page.rows], page.older, page.newer) == ([ids[0]], None, ids[0])
        page = dash.search_messages(conn, dash.MessageSearch(after=ids[0], limit=2))
        assert ([r.id for r in page.rows], page.older, page.newer) == (
            [ids[2], ids[1]],
            ids[1],
            ids[2],
        )
        page = dash.search_messages(conn, dash.MessageSearch(after=ids[2], limit=2))
        assert ([r.id for r in page.rows], page.older, page.newer) == (
            [ids[4], ids[3]],
            ids[3],
            None,
        )


def _scans(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """Every node of a plan, depth first."""
    return [plan, *(node for child in plan.get("Plans", []) for node in _scans(child))]


@pytest.mark.parametrize("finished_days", [0, 2])
def test_keyset_page_walks_the_ids_backwards(
    engine: Engine, producer: Producer, finished_days: int
) -> None:
    """The plan of a page at any depth: a LIMIT over backward scans of the ids, commit_log's
    primary key and each history day's id index (each table's page, merged in id order),
    starting at the cursor (a moved message's state probes the topic queue's); no sort (but
    of an empty history's nothing), no sequential scan and no count, so page cost does not
    grow with the tables."""
    for _ in range(2):
        producer.send_batch([{"topic": "dash.bulk", "body": {"n": n}} for n in range(10_000)])
    with engine.begin() as conn:
        for day in range(finished_days):  # finished messages, moved into two days of history
            conn.execute(
                text(
                    "UPDATE commit_log SET status = 'succeeded', finished_at = now() - "
                    "make_interval(days => :day) WHERE id % 3 = :day"
                ),
                {"day": day},
            )
            conn.execute(text("DELETE FROM topic_queue WHERE message_id % 3 = :day"), {"day": day})
    history.move_all(engine)
    with engine.begin() as conn:
        conn.execute(text("ANALYZE commit_log, message_history"))
        days = len(store_history.partitions(conn))
        assert days == finished_days
        for search in (
            dash.MessageSearch(before=15_000, limit=50),
            dash.MessageSearch(before=15_000, limit=50, topic="dash.bulk"),
            dash.MessageSearch(limit=50, status="ready"),
        ):
            sql, params = dash._search_statement(search, search.limit + 1)
            plan = conn.execute(text("EXPLAIN (FORMAT JSON) " + qualify(sql)), params).scalar_one()[
                0
            ]["Plan"]
            while plan["Node Type"] == "Subquery Scan":  # the page, then its rows' state
                plan = plan["Plans"][0]
            assert plan["Node Type"] == "Limit", search
            nodes = _scans(plan["Plans"][0])
            kinds = {node["Node Type"] for node in nodes}
            assert not kinds & {"Seq Scan", "Bitmap Heap Scan", "Aggregate"}, search
            sorted_ = [sort["Plans"][0] for sort in nodes if sort["Node Type"] == "Sort"]
            assert all(n["Node Type"] == "Result" for n in sorted_), search  # an empty history
            walks = [
                (node["Index Name"], node["Scan Direction"])
                for node in nodes
                if node["Node Type"] in ("Index Scan", "Index Only Scan")
            ]
            if search.status == "ready":  # the topic queue's ids, walked, each probing its row
                assert ("topic_queue_pkey", "Backward") in walks or (
                    "commit_log_pkey",
                    "Backward",
                ) in walks, search
                continue
            assert ("commit_log_pkey", "Backward") in walks, search
            assert len(walks) == 1 + days, search
            assert {direction for _, direction in walks} == {"Backward"}, search


@pytest.mark.parametrize("status", ["dead", "succeeded", "cancelled"])
def test_a_finished_status_is_not_sought_through_the_backlog(
    engine: Engine, producer: Producer, status: str
) -> None:
    """Finished messages are in the history (or, for seconds, among commit_log's few finished
    rows): a search by a finished status reads commit_log's finished rows only, not every
    waiting message in it. (It walked the whole backlog backwards for none: 0.5 s a page with
    5M waiting, `delaysvc bench dashboard`.)"""
    for _ in range(2):
        producer.send_batch([{"topic": "dash.bulk", "body": {}, "delay": "1h"}] * 10_000)
    finished = [m.id for m in producer.send_batch([{"topic": "dash.old", "body": {}}] * 120)]
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE commit_log SET status = :s, finished_at = now() WHERE id = ANY(:ids)"),
            {"s": status, "ids": finished[:100]},
        )
        conn.execute(
            text("DELETE FROM topic_queue WHERE message_id = ANY(:ids)"), {"ids": finished}
        )
    history.move_all(engine)  # the 100 into the history; 20 of them finish after the sweep
    with engine.begin() as conn:
        conn.execute(
            text("UPDATE commit_log SET status = :s, finished_at = now() WHERE id = ANY(:ids)"),
            {"s": status, "ids": finished[100:]},
        )
        conn.execute(text("ANALYZE commit_log, message_history"))
        search = dash.MessageSearch(status=status, limit=50)
        sql, params = dash._search_statement(search, search.limit + 1)
        plan = conn.execute(
            text("EXPLAIN (ANALYZE, FORMAT JSON) " + qualify(sql)), params
        ).scalar_one()[0]["Plan"]
        page = dash.search_messages(conn, search)
    assert [row.id for row in page.rows] == finished[::-1][:50]
    read_in_commit_log = sum(
        node.get("Actual Rows", 0) + node.get("Rows Removed by Filter", 0)
        for node in _scans(plan)
        if node.get("Relation Name") == "commit_log"
    )
    assert read_in_commit_log <= 20


def test_message_page_shows_the_timeline_errors_and_body(
    admin: FlaskClient, producer: Producer, engine: Engine, settings: Settings
) -> None:
    [dead_id] = make_dead(
        settings, engine, producer, [{"topic": "dash.fails", "error": "no stock"}]
    )
    view = admin.get(f"/ui/messages/{dead_id}.json").get_json()
    assert view["cells"] == {
        "status": "dead",
        "attempts": "1",
        "last_error": "ValueError: no stock",
    }
    assert view["flags"] == {"cancellable": False, "dead": True}
    labels = [(e["label"], e["detail"]) for e in view["timeline"]]
    assert labels[:3] == [("stored", ""), ("due", ""), ("delivered", "moved to the topic queue")]
    assert labels[3:5] == [("attempt 1 started", ""), ("attempt 1 failed", "ValueError: no stock")]
    assert labels[5][0] == "dead" and re.fullmatch(r"handler ran \d+ ms", labels[5][1])
    assert "ValueError: no stock" in view["timeline"][4]["trace"]
    times = [e["at"] for e in view["timeline"]]
    assert times == sorted(times)
    page = admin.get(f"/messages/{dead_id}").text
    assert "<strong>attempt 1 failed</strong>" in page and "<summary>traceback</summary>" in page
    body = '{\n  "error": "no stock",\n  "topic": "dash.fails"\n}'
    assert f'<pre id="body" class="body">{body.replace(chr(34), "&#34;")}</pre>' in page
    assert 'action="/dead/redrive" data-flag="dead" >' in page
    raw = producer.send("dash.bytes", b"\x00\x01\xff", delay_level=5)
    assert "3 bytes (not JSON):\n00000000  0001 ff<" in admin.get(f"/messages/{raw.id}").text
    missing = admin.get("/messages/999999")
    assert missing.status_code == 404 and "no message with id 999999" in missing.text
    assert admin.get("/ui/messages/999999.json").status_code == 404


def test_admin_cancels_a_message_once(admin: FlaskClient, producer: Producer) -> None:
    sent = producer.send("dash.t", {"n": 1}, delay="1h", key="order-7")
    page = admin.get(f"/messages/{sent.id}").text
    assert f'action="/messages/{sent.id}/cancel" data-flag="cancellable" >' in page
    response = admin.post(f"/messages/{sent.id}/cancel", data={"csrf_token": csrf(admin)})
    assert response.location == f"/messages/{sent.id}"
    assert flashes(admin, response) == [f"message {sent.id} cancelled"]
    assert producer.get(sent.id).status == "cancelled"
    labels = [e["label"] for e in admin.get(f"/ui/messages/{sent.id}.json").get_json()["timeline"]]
    assert labels == ["stored", "cancelled", "due"]
    again = admin.post(f"/messages/{sent.id}/cancel", data={"csrf_token": csrf(admin)})
    assert flashes(admin, again) == [
        f"not cancelled: message {sent.id} is cancelled; it cannot be cancelled"
    ]


@pytest.fixture
def dead_ids(settings: Settings, engine: Engine, producer: Producer) -> list[int]:
    return make_dead(
        settings,
        engine,
        producer,
        [
            {"topic": "dash.fails", "error": "no stock"},
            {"topic": "dash.fails", "error": "no stock"},
            {"topic": "dash.fails", "error": "no stock"},
            {"topic": "dash.fails", "error": "timeout"},
            {"topic": "dash.fails", "error": "timeout"},
            {"topic": "dash.other", "error": "sku"},
        ],
    )


def _groups(client: FlaskClient, query: str = "") -> list[tuple[str, str, int]]:
    page = client.get("/dead" + query).text
    body = page.split('<table id="dead-groups">')[1].split("</table>")[0]
    return [
        (topic, error.replace("&#39;", "'"), int(n))
        for topic, error, n in re.findall(
            r'<tr data-topic="([^"]*)" data-error="([^"]*)".*?<td class="num">(\d+)</td>',
            body,
            re.S,
        )
    ]


def test_dead_letters_are_grouped_by_topic_and_error(
    admin: FlaskClient, dead_ids: list[int]
) -> None:
    assert _groups(admin) == [
        ("dash.fails", "ValueError: no stock", 3),
        ("dash.fails", "ValueError: timeout", 2),
        ("dash.other", "KeyError: 'sku'", 1),
    ]
    assert _groups(admin, "?topic=dash.other") == [("dash.other", "KeyError: 'sku'", 1)]
    page = admin.get("/dead?topic=dash.fails&error=ValueError:+timeout").text
    letters = page.split('<table id="dead-letters">')[1]
    assert _ids_on(letters) == [dead_ids[4], dead_ids[3]]
    assert "Letters of this group" in page


def test_a_group_of_a_long_error_is_linked_by_its_digest_and_its_actions_come_back_to_it(
    admin: FlaskClient, settings: Settings, engine: Engine, producer: Producer
) -> None:
    """Found by a reviewer: the Show link, the pager and the redirect after a group's redrive
    held the whole error, 6-36 KB: `--server sync` answered 414 (and a proxy would), and the
    note of how many were redriven was lost."""
    long_error = "upstream said: " + "ü" * 3000 + "\nand more"
    bodies = [{"topic": "dash.fails", "error": long_error}] * 2
    make_dead(settings, engine, producer, [*bodies, {"topic": "dash.fails", "error": "other"}])
    page = admin.get("/dead").text
    show = re.search(r'href="(/dead\?topic=dash\.fails&amp;group=[0-9a-f]{32})">Show', page)
    assert show is not None
    letters = admin.get(show.group(1).replace("&amp;", "&")).text
    assert (
        "Letters of this group" in letters and len(_ids_on(letters.split("dead-letters")[1])) == 2
    )
    token = csrf(admin)
    form = {
        "csrf_token": token,
        "scope": "group",
        "topic": "dash.fails",
        "error": f"ValueError: {long_error}",
    }
    response = admin.post("/dead/redrive", data=form)
    assert len(response.location) < 200, response.location
    assert flashes(admin, response) == ["2 redriven"]
    gone = admin.get(show.group(1).replace("&amp;", "&"))  # no letter left with that error
    assert gone.status_code == 200 and "No letter is left with this error." in gone.text
    assert _ids_on(gone.text.split("dead-letters")[1]) == []  # not the topic's other letters
    assert admin.get("/dead?group=nothex").status_code == 400


def test_dead_letters_page_steps_back_by_id(
    admin: FlaskClient, dead_ids: list[int], engine: Engine
) -> None:
    with engine.connect() as conn:
        rows, older = dash.dead_letters_page(conn, "dash.fails", limit=2)
        assert ([r.message_id for r in rows], older) == ([dead_ids[4], dead_ids[3]], dead_ids[3])
        rows, older = dash.dead_letters_page(conn, "dash.fails", before=older, limit=2)
        assert ([r.message_id for r in rows], older) == ([dead_ids[2], dead_ids[1]], dead_ids[1])
        rows, older = dash.dead_letters_page(conn, "dash.fails", before=older, limit=2)
        assert ([r.message_id for r in rows], older) == ([dead_ids[0]], None)


def test_redrive_and_purge_one_and_a_selection(
    admin: FlaskClient, dead_ids: list[int], producer: Producer
) -> None:
    token = csrf(admin)
    response = admin.post("/dead/redrive", data={"csrf_token": token, "ids": str(dead_ids[0])})
    assert flashes(admin, response) == [f"1 redriven ({dead_ids[0]})"]
    assert producer.get(dead_ids[0]).status == "ready"
    response = admin.post(
        "/dead/redrive", data={"csrf_token": token, "ids": [str(dead_ids[1]), str(dead_ids[0])]}
    )
    assert flashes(admin, response) == [
        f"1 redriven ({dead_ids[1]}); not redriven: message {dead_ids[0]} is not a dead letter"
    ]
    response = admin.post(
        "/dead/purge",
        data={
            "csrf_token": token,
            "ids": [str(dead_ids[2]), str(dead_ids[3])],
            "topic": "dash.fails",
        },
    )
    assert response.location == "/dead?topic=dash.fails"
    assert flashes(admin, response) == ["2 purged"]
    assert _groups(admin) == [
        ("dash.fails", "ValueError: timeout", 1),
        ("dash.other", "KeyError: 'sku'", 1),
    ]
    response = admin.post("/dead/purge", data={"csrf_token": token})
    assert flashes(admin, response) == ["nothing selected"]


def test_redrive_and_purge_all_matching_a_group(
    admin: FlaskClient, dead_ids: list[int], producer: Producer
) -> None:
    token = csrf(admin)
    group = {"csrf_token": token, "scope": "group", "topic": "dash.fails"}
    response = admin.post("/dead/redrive", data={**group, "error": "ValueError: no stock"})
    assert flashes(admin, response) == ["3 redriven"]
    assert [producer.get(i).status for i in dead_ids] == ["ready"] * 3 + ["dead"] * 3
    response = admin.post("/dead/purge", data={**group, "error": "ValueError: timeout"})
    assert flashes(admin, response) == ["2 purged"]
    assert _groups(admin) == [("dash.other", "KeyError: 'sku'", 1)]
    assert [producer.get(i).status for i in dead_ids[3:5]] == ["dead", "dead"]  # history kept


def test_a_group_whose_error_spans_lines_is_acted_on_as_a_browser_sends_it(
    admin: FlaskClient, settings: Settings, engine: Engine, producer: Producer
) -> None:
    """A browser sends a form field's line breaks as CRLF: a group whose error has a line
    break (a psycopg error's DETAIL, a pydantic error) is still the group the buttons act on,
    and the page they come back to shows it (it was "0 redriven", "0 purged")."""
    dead = make_dead(
        settings,
        engine,
        producer,
        [{"topic": "dash.fails", "error": "no stock\nDETAIL: sku 7"} for _ in range(3)],
    )
    token = csrf(admin)
    group = {"csrf_token": token, "scope": "group", "topic": "dash.fails"}
    sent = "ValueError: no stock\r\nDETAIL: sku 7"  # as the browser sends it
    response = admin.post("/dead/redrive", data={**group, "error": sent, "ids": []})
    assert flashes(admin, response) == ["3 redriven"]
    assert [producer.get(i).status for i in dead] == ["ready"] * 3
    make_dead(settings, engine, producer, [{"topic": "dash.fails", "error": "a\nb"}])
    response = admin.post("/dead/purge", data={**group, "error": "ValueError: a\r\nb"})
    assert flashes(admin, response) == ["1 purged"]
    # (the three redriven ran again meanwhile, and died again: their group is back)
    assert [error for _, error, _ in _groups(admin)] == ["ValueError: no stock\nDETAIL: sku 7"]


def test_dead_ids_in_group_matches_the_error_exactly(engine: Engine, dead_ids: list[int]) -> None:
    with engine.connect() as conn:
        assert (
            dash.dead_ids_in_group(conn, "dash.fails", "ValueError: no stock", 10) == dead_ids[:3]
        )
        assert dash.dead_ids_in_group(conn, "dash.fails", "ValueError: no", 10) == []
        assert dash.dead_ids_in_group(conn, None, None, 10, after=dead_ids[3]) == dead_ids[4:]
        assert dash.dead_ids_in_group(conn, "dash.fails", None, 2) == dead_ids[:2]

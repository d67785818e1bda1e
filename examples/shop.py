"""The README's order-cancellation example, runnable: an order is created together with its
cancellation timer in one transaction; paying cancels the timer; otherwise the handler cancels
the unpaid order when the timer fires.

    DELAYSVC_HANDLERS=examples.shop delaysvc up            # the worker runs `cancel_unpaid`
    python -m examples.shop                                 # creates two orders, pays one
"""

from __future__ import annotations

import os

from sqlalchemy import Column, Engine, Integer, MetaData, Table, Text, select, update
from sqlalchemy.orm import Session

import delaysvc
from delaysvc import handler

CANCEL_AFTER = os.environ.get("SHOP_CANCEL_AFTER", "30m")

metadata = MetaData()
orders = Table(
    "shop_order",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("item", Text, nullable=False),
    Column("status", Text, nullable=False),  # unpaid -> paid | cancelled
)


def create_order(session: Session, item: str) -> int:
    """Insert the order and schedule its cancellation in the same transaction: no order
    without its timer, no timer without its order."""
    order_id = session.execute(
        orders.insert().values(item=item, status="unpaid").returning(orders.c.id)
    ).scalar_one()
    delaysvc.send(
        "order.cancel",
        {"order_id": order_id},
        delay=CANCEL_AFTER,
        key=f"order-{order_id}",
        connection=session,
    )
    return order_id


def pay_order(session: Session, order_id: int) -> None:
    session.execute(update(orders).where(orders.c.id == order_id).values(status="paid"))
    delaysvc.cancel(topic="order.cancel", key=f"order-{order_id}", connection=session)


@handler("order.cancel")
def cancel_unpaid(message) -> None:  # type: ignore[no-untyped-def]
    """Runs when the timer fires: cancel the order unless it was paid meanwhile."""
    order_id = message.body["order_id"]
    with Session(_engine()) as session, session.begin():
        cancelled = session.execute(
            update(orders)
            .where(orders.c.id == order_id, orders.c.status == "unpaid")
            .values(status="cancelled")
        ).rowcount
    print(f"shop: order {order_id} " + ("cancelled, unpaid" if cancelled else "not unpaid: kept"))


def order_status(engine: Engine, order_id: int) -> str:
    with engine.connect() as conn:
        return conn.execute(select(orders.c.status).where(orders.c.id == order_id)).scalar_one()


def _engine() -> Engine:
    return delaysvc.default_producer().engine


def main() -> None:
    engine = _engine()
    metadata.create_all(engine)
    with Session(engine) as session, session.begin():
        unpaid = create_order(session, "book")
        paid = create_order(session, "lamp")
    with Session(engine) as session, session.begin():
        pay_order(session, paid)
    print(f"order {unpaid} (unpaid) is cancelled in {CANCEL_AFTER}; order {paid} was paid")


if __name__ == "__main__":
    main()

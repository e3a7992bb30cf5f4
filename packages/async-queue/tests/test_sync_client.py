"""`SyncMessageQueueClient`: works in plain code, refuses to block a running event loop."""

from __future__ import annotations

import pytest
import ray
from async_queue import (
    ProducerFailed,
    QueueClosed,
    QueueFull,
    QueueTimeout,
    SyncClientInEventLoopError,
    SyncMessageQueueClient,
)

pytestmark = pytest.mark.usefixtures("ray_logs_dir")


def test_sync_client_in_plain_code(make_item) -> None:
    client = SyncMessageQueueClient.create(maxsize=4, policy="reject")
    client.put(make_item(0))
    client.put_many([make_item(1), make_item(2)])
    with pytest.raises(QueueFull):
        client.put_many([make_item(3), make_item(4)])
    assert client.size() == 3
    assert client.get().item_id == "p-0"
    assert [i.item_id for i in client.get_batch(1)] == ["p-1"]
    with pytest.raises(QueueTimeout):
        client.get_batch(3, timeout=0.1, min_items=3)
    client.close()
    assert [item.item_id for item in client] == ["p-2"]  # drains, then the loop ends
    with pytest.raises(QueueClosed):
        client.get()
    with pytest.raises(QueueClosed):
        client.put(make_item(9))
    stats = client.stats()
    assert (stats.produced, stats.consumed, stats.rejected, stats.closed) == (3, 3, 2, True)
    ray.kill(client.handle)


def test_sync_client_sees_producer_failure(make_item) -> None:
    client = SyncMessageQueueClient.create(maxsize=4)
    client.put(make_item(0))
    client.close(OSError("disk full"))
    with pytest.raises(ProducerFailed, match="OSError: disk full"):
        client.get()
    ray.kill(client.handle)


async def test_sync_client_refuses_to_block_a_running_loop(make_item) -> None:
    client = SyncMessageQueueClient.create(maxsize=4)
    calls = [
        lambda: client.put(make_item(0)),
        lambda: client.put_many([make_item(1)]),
        client.get,
        lambda: client.get_batch(2),
        client.stats,
        client.size,
        client.close,
        lambda: list(client),
    ]
    for call in calls:
        with pytest.raises(SyncClientInEventLoopError) as caught:
            call()
        assert isinstance(caught.value, RuntimeError)
        assert "MessageQueueClient" in str(caught.value)
    # Nothing reached the actor; the async twin of the client works here.
    stats = await client.to_async().stats()
    assert (stats.produced, stats.closed) == (0, False)
    ray.kill(client.handle)

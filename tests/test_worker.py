"""core/service/worker.py: one thread runs every job; a stream is made, advanced and closed there, runs
ahead of its reader, stops when the reader leaves, and hands failures over."""

import threading

import pytest

from core.service.worker import Worker


def test_call_runs_on_the_worker_and_returns_or_raises():
    worker = Worker()
    assert worker.call(lambda: (worker.here, threading.current_thread().name)) == (True, "aerie-torch")
    assert not worker.here
    with pytest.raises(KeyError, match="nope"):
        worker.call(lambda: {}["nope"])
    assert worker.call(lambda: worker.call(lambda: 7)) == 7  # a job calling in runs inline, no deadlock


def test_stream_items_are_made_on_the_worker_in_order():
    worker = Worker()

    def items():
        for i in range(5):
            yield i, worker.here

    assert list(worker.stream(items)) == [(i, True) for i in range(5)]


def test_stream_runs_ahead_of_a_slow_reader():
    worker, done = Worker(), threading.Event()

    def items():
        yield from range(50)
        done.set()

    stream = worker.stream(items)
    assert next(stream) == 0
    assert done.wait(5)  # every item was made while the reader sat on the first
    assert list(stream) == list(range(1, 50))


def test_leaving_a_stream_stops_it_there_and_waits_for_its_cleanup():
    worker, made, cleaned = Worker(), [], []
    go_on = threading.Event()

    def items():
        try:
            for i in range(1000):
                made.append(i)
                yield i
                go_on.wait(5)  # one item at a time until the reader has left
        finally:
            cleaned.append(worker.here)

    stream = worker.stream(items)
    assert next(stream) == 0
    go_on.set()  # the worker goes on making items while the reader closes
    stream.close()
    assert cleaned == [True]  # closed on the worker, before close() returned
    count = len(made)
    assert worker.call(lambda: len(made)) == count < 1000  # the worker is free: nothing runs on


def test_a_failing_stream_raises_at_the_reader_and_the_worker_lives_on():
    worker = Worker()

    def items():
        yield 1
        raise ValueError("broken step")

    stream = worker.stream(items)
    assert next(stream) == 1
    with pytest.raises(ValueError, match="broken step"):
        next(stream)

    def not_a_generator():
        raise RuntimeError("failed before the first item")

    with pytest.raises(RuntimeError, match="before the first"):
        list(worker.stream(not_a_generator))
    assert worker.call(lambda: "still here") == "still here"


def test_post_runs_after_the_queued_jobs_without_waiting_and_logs_a_failure(caplog):
    worker, gate, order = Worker(), threading.Event(), []
    worker.submit(lambda: (gate.wait(5), order.append("queued")))
    worker.post(lambda: order.append("posted"))   # returns while the worker still waits on the gate
    assert order == []
    gate.set()
    worker.post(lambda: {}["lost"])
    assert worker.call(lambda: list(order)) == ["queued", "posted"]
    assert "posted to the torch worker failed" in caplog.text and "lost" in caplog.text
    assert worker.call(lambda: worker.post(lambda: order.append("inline")) or order[-1]) == "inline"  # here: now


def test_close_ends_the_thread_after_the_queued_jobs():
    worker, ran = Worker(), []
    thread = worker.call(threading.current_thread)
    worker.post(lambda: ran.append(1))
    worker.close()
    assert ran == [1] and not thread.is_alive()
    worker.close()   # twice is fine
    with pytest.raises(RuntimeError, match="closed"):
        worker.call(lambda: 2)

import threading

from common.write_behind import WriteBehind


def test_jobs_are_written_in_order_and_flush_waits_for_them():
    written = []
    writer = WriteBehind("t", written.append, max_items=8)
    assert all(writer.submit(i) for i in range(5))
    assert writer.flush(5.0) and written == [0, 1, 2, 3, 4]
    writer.close()


def test_full_queue_and_byte_budget_drop_instead_of_blocking():
    gate, started = threading.Event(), threading.Event()

    def write(job):
        started.set()
        gate.wait(5.0)

    writer = WriteBehind("t", write, max_items=1, max_bytes=100)
    assert writer.submit("a", nbytes=60)
    assert started.wait(5.0)  # "a" is off the queue, blocked on the gate, its 60 bytes still pending
    assert not writer.submit("b", nbytes=60)  # 120 bytes would be pending
    assert writer.submit("c", nbytes=10)  # fits the budget and the one queue slot
    assert not writer.submit("d", nbytes=10)  # the queue is full
    gate.set()
    assert writer.flush(5.0)
    assert writer.submit("e", nbytes=90)  # the budget is free again
    writer.close()


def test_a_failing_write_does_not_stop_the_writer():
    written = []

    def write(job):
        if job == "bad":
            raise ValueError("boom")
        written.append(job)

    writer = WriteBehind("t", write, max_items=4)
    writer.submit("bad")
    writer.submit("good")
    assert writer.flush(5.0) and written == ["good"]
    writer.close()

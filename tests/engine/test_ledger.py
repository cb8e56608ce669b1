"""The loop's ledger of the runner's bytes (server/engine/loop/ledger.py), driven directly: what the loop has let go
of stays counted until the runner's report or answer shows it gone, and `nbytes` is everything it counts."""

from kvfork.backends.base import BlockStats
from kvfork.server.engine import messages as m
from kvfork.server.engine.loop.ledger import LoopLedger


def test_a_release_others_still_read_is_counted_until_a_report_shows_it_run():
    ledger = LoopLedger()
    ledger.released(0)  # Release 1: nothing of it read by others
    ledger.released(300)  # Release 2
    ledger.released(500)  # Release 3
    assert ledger.in_transit == 800 and ledger.nbytes == 800
    ledger.update(m.Ledger(live_sessions=4, total_bytes=2000, pooled_bytes=0, releases=1))  # run before 2 and 3
    assert ledger.in_transit == 800
    ledger.update(m.Ledger(live_sessions=3, total_bytes=1700, pooled_bytes=300, releases=2))
    assert (ledger.in_transit, ledger.pooled, ledger.nbytes) == (500, 300, 800)
    ledger.update(m.Ledger(live_sessions=2, total_bytes=1200, pooled_bytes=800, releases=3))
    assert (ledger.in_transit, ledger.pooled, ledger.nbytes) == (0, 800, 800)


def test_what_a_release_frees_of_the_pool_is_a_credit_until_a_report_shows_it_run():
    """Evicted prefix cache entries free the pooled blocks they read once the runner runs their release: until
    its report, `freeing` says so (eviction counts it as free), and it is no term of `nbytes`."""
    ledger = LoopLedger()
    ledger.update(m.Ledger(live_sessions=3, total_bytes=3000, pooled_bytes=2000, releases=0))
    ledger.released(0, freeing=1000)  # Release 1
    assert (ledger.freeing, ledger.nbytes) == (1000, 2000)
    ledger.update(m.Ledger(live_sessions=1, total_bytes=1200, pooled_bytes=1000, releases=1))
    assert (ledger.freeing, ledger.nbytes) == (0, 1000)


def test_the_runners_last_report_is_what_it_holds():
    ledger = LoopLedger()
    assert ledger.runner == m.Ledger() and ledger.nbytes == 0
    report = m.Ledger(live_sessions=2, total_bytes=4096, pooled_bytes=1024, releases=0, blocks=BlockStats(4, 1, 1024))
    ledger.update(report)
    assert ledger.runner == report and ledger.pooled == 1024
    ledger.update(m.Ledger(live_sessions=1, total_bytes=1024, pooled_bytes=0, releases=0))
    assert ledger.runner.live_sessions == 1 and ledger.runner.blocks is None and ledger.nbytes == 0


def test_an_abandoned_order_is_held_until_the_runner_answers_it():
    ledger = LoopLedger()
    assert not ledger.answered(7)  # an answer to an order its request still waits for
    ledger.abandon(7, 400)
    assert (ledger.abandoned, ledger.nbytes) == (1, 400)
    ledger.update(m.Ledger(releases=5))  # a report does not answer an order
    assert (ledger.abandoned, ledger.nbytes) == (1, 400)
    assert ledger.answered(7)
    assert (ledger.abandoned, ledger.nbytes) == (0, 0)
    assert not ledger.answered(7)


def test_several_orders_of_one_request_are_answered_oldest_first():
    ledger = LoopLedger()
    ledger.abandon(3, 100)  # a clone order, then a state load, then another clone
    ledger.abandon(3, 250)
    ledger.abandon(9, 40)
    ledger.abandon(3, 600)
    assert (ledger.abandoned, ledger.nbytes) == (4, 990)
    assert ledger.answered(3)
    assert ledger.nbytes == 890
    assert ledger.answered(3)
    assert ledger.nbytes == 640
    assert ledger.answered(9)
    assert ledger.nbytes == 600
    assert ledger.answered(3) and not ledger.answered(3)
    assert (ledger.abandoned, ledger.nbytes) == (0, 0)


def test_a_spilling_entry_is_held_until_its_file_is_written():
    ledger = LoopLedger()
    ledger.spill(1000)
    ledger.spill(200)
    assert (ledger.spilling, ledger.nbytes) == (1200, 1200)
    ledger.update(m.Ledger(releases=10))  # the runner's export is not the file written
    assert ledger.spilling == 1200
    ledger.spilled(1000)
    assert (ledger.spilling, ledger.nbytes) == (200, 200)
    ledger.spilled(200)
    assert ledger.nbytes == 0


def test_nbytes_is_the_sum_of_every_term():
    ledger = LoopLedger()
    ledger.released(30)  # Release 1, still read
    ledger.update(m.Ledger(live_sessions=3, total_bytes=9000, pooled_bytes=700, releases=0))
    ledger.abandon(1, 5)
    ledger.spill(11)
    assert (ledger.pooled, ledger.in_transit, ledger.spilling) == (700, 30, 11)
    assert ledger.nbytes == 700 + 30 + 5 + 11
    ledger.update(m.Ledger(live_sessions=2, total_bytes=8000, pooled_bytes=730, releases=1))
    assert ledger.nbytes == 730 + 0 + 5 + 11

"""The KV each engine holds for the routes in flight (disagg.proxy.kvledger)."""

from __future__ import annotations

import math

from disagg.proxy.kvledger import KvLedger


def test_room_is_the_capacity_less_what_is_booked_and_when_each_booking_comes_free() -> None:
    book = KvLedger()
    long_one = book.hold("http://gamer", 2304.0, until=10.0)
    short_one = book.hold("http://gamer", 512.0, until=4.0)
    book.hold("http://workstation", 100.0, until=1.0)
    free, frees = book.room("http://gamer", 6144.0, now=3.0)
    assert free == 6144.0 - 2816.0
    assert frees == ((1.0, 512.0), (7.0, 2304.0))      # soonest first, as kv_wait_s takes them
    # re-estimated at its first token; a booking past its expected end counts as ending now
    book.retime(long_one, 2.0)
    assert book.room("http://gamer", 6144.0, now=3.0)[1] == ((0.0, 2304.0), (1.0, 512.0))
    book.release(long_one)
    book.release(long_one)                     # twice: nothing more
    assert book.held_tokens("http://gamer") == 512.0
    # a capacity not known: as if nothing waited; nothing booked: all of it free
    assert book.room("http://gamer", None, now=3.0) == (math.inf, ())
    assert book.room("http://nobody", 6144.0, now=3.0) == (6144.0, ())
    # an engine that came back: its bookings went with the old process
    book.forget("http://gamer")
    assert book.held_tokens("http://gamer") == 0.0
    book.release(short_one)                    # released after it was forgotten: nothing
    assert book.held_tokens("http://workstation") == 100.0

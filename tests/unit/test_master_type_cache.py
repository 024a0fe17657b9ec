"""The interpreter's type attribute cache, emptied by the master before it forks slots
(qcluster.slot.prefork.clear_type_cache): a slot then writes no reference count of the
names the master's loop cached, and the master empties it once per pass of forks, not
before each fork (its own lookups between two forks would be written again)."""

from __future__ import annotations

import sys

import pytest

from qcluster.slot.prefork import clear_type_cache
from tests.unit.test_master_component import Harness, make_app

Q = "work"


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12's interned names are immortal")
def test_the_emptied_cache_holds_no_reference_to_a_name() -> None:
    class Looked:
        pass

    name = "".join(["not_an_attribute_", str(id(Looked))])  # a str of this test's own
    before = sys.getrefcount(name)
    getattr(Looked, name, None)  # a lookup the cache keeps, with a reference to the name
    assert sys.getrefcount(name) > before
    clear_type_cache()
    assert sys.getrefcount(name) == before


def test_the_cache_is_emptied_once_per_pass_that_forks(monkeypatch: pytest.MonkeyPatch) -> None:
    emptied: list[int] = []
    monkeypatch.setattr("qcluster.master.pool.clear_type_cache", lambda: emptied.append(1))
    h = Harness(monkeypatch, make_app(Q), {Q: 3})
    try:
        h.step()
        assert len(h.os.forks) == 3
        assert len(emptied) == 1  # one pass, three forks
        h.hello()
        h.step(1.0)
        assert len(emptied) == 1  # a pass without a fork leaves it
        h.exit(h.os.forks[0], 1)
        h.step(1.0)
        h.step(5.0)  # the crashed slot's restart, after its backoff
        assert len(h.os.forks) == 4
        assert len(emptied) == 2
    finally:
        h.close()

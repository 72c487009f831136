"""ScopedValue: set inside a with block, restored after; one scope re-entered nests."""

from xscale.models.scoped import ScopedValue


def test_scopes_nest_and_restore():
    value: ScopedValue[int] = ScopedValue()
    outer, inner = value.scope(1), value.scope(2)
    with outer:
        assert value.current == 1
        with inner:
            assert value.current == 2
            with outer:  # re-entered while already entered (a recomputation inside a forward)
                assert value.current == 1
            assert value.current == 2
        assert value.current == 1
    assert value.current is None

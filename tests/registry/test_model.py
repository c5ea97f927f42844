"""Pointer transitions and ids (pure functions, no storage)."""

from __future__ import annotations

import random

import pytest

from services.registry import model as m
from services.registry.model import FailedPrecondition, InvalidArgument, NoChange, PointerState

T = "tgt"


def v(n: int) -> str:
    return m.version_id(T, n)


def test_version_ids_round_trip_and_reject_garbage():
    assert v(7) == "tgt/v0007" and m.parse_version("org/model-1.5/v12345") == ("org/model-1.5", 12345)
    for bad in ("", "tgt", "tgt/v7", "tgt/7", "/v0001", "a b/v0001", "../x/v0001"):
        with pytest.raises(InvalidArgument):
            m.parse_version(bad)
    for bad in ("", "-x", "a//b", "a/", "x" * 129, "a/../b", "tab\t"):
        with pytest.raises(InvalidArgument):
            m.check_target(bad)


def test_promote_pushes_previous_without_duplicates():
    s = PointerState(T)
    for n in (1, 2, 3):
        s = m.promote(s, v(n), "r", "a", 1.0)
    assert (s.current, s.previous, s.generation) == (v(3), (v(2), v(1)), 3)
    s = m.promote(s, v(1), "again", "a", 2.0)  # v1 leaves previous, v3 goes on top
    assert (s.current, s.previous) == (v(1), (v(3), v(2)))
    with pytest.raises(NoChange):
        m.promote(s, v(1), "same", "a", 3.0)
    with pytest.raises(FailedPrecondition, match="not 'tgt/v0002'"):
        m.promote(s, v(4), "stale", "a", 3.0, expected_current=v(2))
    assert m.promote(s, v(4), "cas", "a", 3.0, expected_current=v(1)).current == v(4)
    assert m.promote(PointerState(T), v(1), "", "", 0, expected_current="").current == v(1)


def test_pin_overrides_current_until_unpin():
    s = m.promote(PointerState(T), v(1), "", "", 0)
    s = m.pin(s, v(2), "hold", "op", 1)
    assert (s.effective, s.current, s.pinned) == (v(2), v(1), v(2))
    s = m.promote(s, v(3), "trainer", "trainer", 2)
    assert s.effective == v(2) and s.current == v(3)  # promotion waits for the unpin
    with pytest.raises(NoChange):
        m.pin(s, v(2), "", "", 3)
    s = m.unpin(s, "done", "op", 4)
    assert s.effective == v(3) and s.pinned == ""
    with pytest.raises(NoChange):
        m.unpin(s, "", "", 5)
    e = s.history[0]
    assert (e.action, e.from_version, e.to_version, e.reason, e.actor, e.generation) == (
        "unpin",
        v(2),
        v(3),
        "done",
        "op",
        s.generation,
    )


def test_rollback_steps_back_and_records_why():
    with pytest.raises(FailedPrecondition, match="no previous"):
        m.rollback(PointerState(T), "bad", "ctl", 0)
    s = PointerState(T)
    for n in (1, 2, 3, 4):
        s = m.promote(s, v(n), "", "", n)
    s = m.rollback(s, "acceptance fell", "controller", 10)
    assert (s.current, s.previous) == (v(3), (v(2), v(1)))  # v4 is not kept: a second rollback goes further back
    e = s.history[0]
    assert (e.action, e.from_version, e.reason) == ("rollback", v(4), "acceptance fell")
    s2 = m.rollback(s, "", "", 11, to_version=v(1))
    assert (s2.current, s2.previous) == (v(1), ())
    with pytest.raises(FailedPrecondition, match="promote it instead"):
        m.rollback(s, "", "", 11, to_version=v(9))
    with pytest.raises(FailedPrecondition):
        m.rollback(s2, "", "", 12)


def test_rollback_with_expected_current_refuses_after_a_newer_promotion():
    """The controller decides to roll back v2, an operator promotes v3 meanwhile: the rollback must
    not undo v3."""
    s = PointerState(T)
    for n in (1, 2, 3):
        s = m.promote(s, v(n), "", "", n)
    with pytest.raises(FailedPrecondition, match=f"is '{v(3)}', not '{v(2)}'"):
        m.rollback(s, "auto", "controller", 10, expected_current=v(2))
    s = m.rollback(s, "auto", "controller", 10, expected_current=v(3))
    assert s.current == v(2)


def test_history_and_previous_are_bounded():
    s = PointerState(T)
    for n in range(1, m.HISTORY_LIMIT + 20):
        s = m.promote(s, v(n), "", "", n)
    assert len(s.history) == m.HISTORY_LIMIT and len(s.previous) == m.PREVIOUS_LIMIT
    assert s.history[0].generation == s.generation == m.HISTORY_LIMIT + 19


def test_json_round_trip_and_replay_reproduce_random_sequences():
    rng = random.Random(0)
    s = PointerState(T)
    for i in range(150):
        op = rng.choice(["promote", "pin", "unpin", "rollback"])
        try:
            if op == "promote":
                s = m.promote(s, v(rng.randint(1, 8)), f"r{i}", "a", i)
            elif op == "pin":
                s = m.pin(s, v(rng.randint(1, 8)), f"r{i}", "a", i)
            elif op == "unpin":
                s = m.unpin(s, f"r{i}", "a", i)
            else:
                s = m.rollback(s, f"r{i}", "a", i)
        except (NoChange, FailedPrecondition):
            pass
        assert PointerState.from_json(s.to_json()) == s
        assert s.current not in s.previous and len(set(s.previous)) == len(s.previous)
    assert s.generation == len(s.history) > 50
    assert m.replay(T, list(reversed(s.history))) == s

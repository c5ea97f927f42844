"""tools.supervisor's restart policy on its own, with a scripted clock and processes whose life the
test decides (the launcher tests kill real ones)."""

from __future__ import annotations

from tools.supervisor import FIRST_DELAY_S, MAX_DELAY_S, STABLE_AFTER_S, Supervisor, Unit


class Proc:
    def __init__(self) -> None:
        self.running, self.pid, self.starts, self.fail_next = True, 100, 0, 0

    def restart(self) -> None:
        if self.fail_next:
            self.fail_next -= 1
            raise OSError("port in use")
        self.running, self.pid, self.starts = True, self.pid + 1, self.starts + 1


def supervised():
    now = [0.0]
    said: list[str] = []
    sup = Supervisor(said.append, clock=lambda: now[0])
    proc = Proc()
    sup.add(Unit("trainer", lambda: proc.running, lambda: -9, proc.restart, lambda: proc.running, lambda: proc.pid))
    return sup, proc, now, said


def run_until(sup, now, t):
    while now[0] < t:
        now[0] += 0.5
        sup.tick()


def test_a_dead_process_is_restarted_after_a_doubling_delay_and_reported():
    sup, proc, now, said = supervised()
    delays = []
    for _ in range(7):
        proc.running = False
        sup.tick()
        died = now[0]
        assert sup.degraded == ["trainer"] and sup.snapshot()["trainer"]["state"] == "restarting"
        while sup.snapshot()["trainer"]["state"] != "ready":
            now[0] += 0.25
            sup.tick()
        delays.append(now[0] - died)
    assert [round(d) for d in delays] == [1, 2, 4, 8, 16, 30, 30]  # capped at MAX_DELAY_S
    snap = sup.snapshot()["trainer"]
    assert snap == {"state": "ready", "restarts": 7, "last_exit": -9, "pid": 107}
    assert sup.degraded == []
    assert "trainer exited with status -9; restarting in 1 s (restart 1)" in said


def test_the_delay_starts_over_once_the_process_has_stayed_up():
    sup, proc, now, _ = supervised()
    for _ in range(3):
        proc.running = False
        run_until(sup, now, now[0] + MAX_DELAY_S)
    assert sup.units[0].delay_s == 8 * FIRST_DELAY_S
    run_until(sup, now, now[0] + STABLE_AFTER_S + 1)
    assert sup.units[0].delay_s == FIRST_DELAY_S


def test_a_failed_restart_is_tried_again_and_the_others_are_left_alone():
    sup, proc, now, said = supervised()
    other = Proc()
    sup.add(Unit("registry", lambda: other.running, lambda: 0, other.restart, lambda: True, lambda: other.pid))
    proc.running, proc.fail_next = False, 2
    run_until(sup, now, 20)
    assert proc.running and proc.starts == 1 and sup.units[0].restarts == 3
    assert sum("failed (port in use)" in line for line in said) == 2
    assert other.starts == 0 and sup.snapshot()["registry"]["state"] == "ready"

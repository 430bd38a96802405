"""Super-seeding rules on a fake clock (no server): first copies count only for joined nodes that keep
their word, deferrals are bounded, stalled and failed copies reopen the shard."""
from node.coordinator.seeding import IN_FLIGHT_WINDOWS, SuperSeeder

S = (3, 0)  # (step, shard index)


class Clock:
    t = 100.0

    def __call__(self):
        return self.t


def seeder(**kw):
    clock = Clock()
    return SuperSeeder(10.0, announce_grace_s=4.0, clock=clock, **kw), clock


def first_copy(s, node="a"):
    assert s.admit(S, node)
    s.started(S, node)
    s.finished(S, node)


def test_honest_first_copy_spreads_for_a_window():
    s, clock = seeder()
    first_copy(s)
    assert not s.admit(S, "b")  # fetch it from a peer
    clock.t += 2
    s.announced("a", [S])
    clock.t += 5  # 7 s after the copy: announced, still inside the window
    assert not s.admit(S, "c")
    assert s.admit(S, "a")  # the claimant itself (a Range resume) is served
    clock.t += 4  # the window is over: the origin serves again
    assert s.admit(S, "b")


def test_a_claim_never_announced_dies_after_the_grace_and_never_counts_again():
    """The griefer took every shard's first copy and never shared it: honest nodes were deferred."""
    s, clock = seeder()
    first_copy(s, "griefer")
    assert not s.admit(S, "honest")
    clock.t += 4.1  # no `have` announcement within the grace
    assert s.admit(S, "honest")
    s.started(S, "griefer")  # claims again: does not count
    s.finished(S, "griefer")
    assert s.admit(S, "other")
    s.started(S, "other")  # a node that does announce takes the claim
    s.finished(S, "other")
    s.announced("other", [S])
    assert not s.admit(S, "honest2")


def test_an_announcement_by_someone_else_does_not_keep_a_claim_alive():
    s, clock = seeder()
    first_copy(s, "a")
    s.announced("b", [S])
    clock.t += 4.1
    assert s.admit(S, "c")


def test_unsigned_requests_are_served_and_never_claim():
    s, clock = seeder()
    assert s.admit(S, None)
    s.started(S, None)
    s.finished(S, None)
    assert s.admit(S, "b")  # nothing is spreading


def test_deferrals_are_bounded_per_node():
    s, clock = seeder(max_deferrals=3)
    first_copy(s)
    s.announced("a", [S])
    assert [s.admit(S, "b") for _ in range(5)] == [False, False, False, True, True]
    assert not s.admit(S, "c")  # counted per node


def test_a_stalled_first_copy_stops_counting_and_a_failed_one_reopens():
    s, clock = seeder()
    assert s.admit(S, "slow")
    s.started(S, "slow")  # never finishes
    clock.t += IN_FLIGHT_WINDOWS * 10 - 1
    assert not s.admit(S, "b")
    clock.t += 2
    assert s.admit(S, "b")
    s2, clock2 = seeder()
    s2.started(S, "x")
    s2.failed(S, "x")
    assert s2.admit(S, "y")


def test_off_when_the_window_is_zero():
    s = SuperSeeder(0.0)
    s.started(S, "a")
    assert s.admit(S, "b")


def test_state_is_bounded():
    s, clock = seeder(max_keys=50)
    for i in range(500):
        key = (0, i)
        s.started(key, f"n{i}")
        s.finished(key, f"n{i}")
        s.admit(key, "other")
    assert len(s._claims) <= 50 and len(s._deferred) <= 50

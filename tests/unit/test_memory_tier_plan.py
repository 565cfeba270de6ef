"""The memory tier's pure decisions: which holder (a spare, else a peer rank) keeps which rank (buddies.py), and
whether a repair loads from memory or disk, and from disk whether the survivors keep their processes
(recovery_source.py)."""
import pytest

from supervisor.cluster.buddies import Holder, buddy_plan, link_steps
from supervisor.control.classify import FaultKind
from supervisor.control.recovery_source import Source, can_keep, hang_culprits, keep_survivors, recovery_source


def spares(**nodes):
    return {name: Holder(node) for name, node in nodes.items()}


def peers(nodes: list):
    return {f"p{r}": Holder(node, r) for r, node in enumerate(nodes)}


def test_one_spare_per_rank_on_other_nodes():
    assert buddy_plan(["a", "a"], spares(s1="b", s2="c")) == {0: "s1", 1: "s2"}


def test_a_spare_on_another_node_comes_before_one_on_the_rank_node():
    assert buddy_plan(["a", "b"], spares(s1="a", s2="a")) == {0: "s1", 1: "s2"}  # rank 0 has only its own node's
    assert buddy_plan(["a", "b"], spares(s1="a", s2="b")) == {0: "s2", 1: "s1"}


def test_one_spare_holds_every_rank_when_it_is_the_only_one():
    assert buddy_plan(["a", "a"], spares(s1="b")) == {0: "s1", 1: "s1"}


def test_an_unknown_node_counts_as_the_rank_node():
    assert buddy_plan([None, "a"], spares(s1="b", s2=None)) == {0: "s1", 1: "s1"}


def test_a_working_link_is_kept_and_a_gone_spare_replaced():
    assert buddy_plan(["a", "a"], spares(s1="b", s3="c"), held={0: "s2", 1: "s1"}) == {0: "s3", 1: "s1"}


def test_without_spares_the_ranks_hold_each_other_and_never_themselves():
    assert buddy_plan(["a", "b"], peers(["a", "b"])) == {0: "p1", 1: "p0"}
    assert buddy_plan(["a"], peers(["a"])) == {}  # one rank: nobody to hold it
    # ranks sharing a node hold each other there (a process death); a peer on another node comes first
    assert buddy_plan(["a", "a", "b"], peers(["a", "a", "b"])) == {0: "p2", 1: "p2", 2: "p0"}


def test_spares_and_peers_in_the_order_of_what_they_cover():
    holders = spares(s1="a") | peers(["a", "b"])
    # rank 0: a peer on another node (a node loss) before a spare on its own node (a process death)
    # rank 1: the spare on another node
    assert buddy_plan(["a", "b"], holders) == {0: "p1", 1: "s1"}
    assert buddy_plan(["a", "a"], spares(s1="a") | peers(["a", "a"])) == {0: "s1", 1: "s1"}


def test_a_link_gives_way_to_a_holder_of_a_better_class_only():
    holders = spares(s1="b") | peers(["a", "b"])
    assert buddy_plan(["a", "b"], holders, held={0: "p1", 1: "p0"}) == {0: "s1", 1: "p0"}  # the pool refilled
    assert buddy_plan(["a", "a"], spares(s1="b", s2="c"), held={0: "s2", 1: "s2"}) == {0: "s2", 1: "s2"}


def test_no_holders_no_buddies():
    assert buddy_plan(["a", "b"], {}) == {}


def test_a_rank_links_once_its_holder_is_ready_and_is_prepared_for_only_once():
    plan = {0: "s1", 1: "s1", 2: "s2"}
    # rank 0's holder is ready: it links now; rank 1's is being prepared; rank 2 is linked already
    assert link_steps(plan, {2: "s2"}, {1: "s1"}, {0: "s1"}, {0, 1, 2}) == ([0], [])
    # after a repair nothing is linked: every rank whose slots are known has its holder prepared, beside the step
    assert link_steps(plan, {}, {}, {}, {0, 2}) == ([], [0, 2])


def test_a_holder_prepared_for_a_rank_the_plan_moved_is_not_used():
    # s1 left the pool (it took a dead rank's place): rank 0 is planned on s2, prepared anew
    assert link_steps({0: "s2"}, {}, {}, {0: "s1"}, {0}) == ([], [0])
    # a rank linked to one holder, planned on another (its holder went), and one being prepared elsewhere
    assert link_steps({0: "s2", 1: "s2"}, {0: "s1"}, {1: "s3"}, {}, {0, 1}) == ([], [0, 1])


def choose(**overrides):
    args = dict(enabled=None, kind=FaultKind.WORKER_DIED, world_size=2, lost={1}, buddies={0: "s1", 1: "s2"},
                holding={"s1": {0: [4, 5]}, "s2": {1: [4, 5]}}, staged=[4, 5], snapshots={4, 5},
                spares=frozenset({"s1", "s2"}))
    return recovery_source(**(args | overrides))


PEERS = dict(buddies={0: "p1", 1: "p0"}, holding={"p0": {1: [4, 5]}}, peers={"p0": 0, "p1": 1}, spares=frozenset())


def test_a_rank_held_by_a_peer_is_given_its_copy_in_a_new_process():
    c = choose(**PEERS, bundled={1})
    assert (c.source, c.step, c.adopters, c.givers, c.lost, c.bundled) == (Source.MEMORY, 5, {}, {1: "p0"}, [1], {1})
    for place in (dict(spares=frozenset({"s9"})), dict(free_bundles=1)):  # its node is gone: a spare, or a free bundle
        c = choose(**PEERS | place)
        assert (c.source, c.givers, c.bundled) == (Source.MEMORY, {1: "p0"}, frozenset())


def test_a_spare_adopts_and_a_peer_gives_in_one_repair():
    c = choose(world_size=3, lost={1, 2}, buddies={0: "p1", 1: "s1", 2: "p0"},
               holding={"s1": {1: [5]}, "p0": {2: [5], 1: [5]}}, staged=[5], peers={"p0": 0, "p1": 1},
               spares=frozenset({"s1"}), bundled={2})
    assert (c.source, c.adopters, c.givers) == (Source.MEMORY, {1: "s1"}, {2: "p0"})
    # the adopter is not a place for the peer-held rank as well: with its bundle gone, rank 2 has none
    c = choose(world_size=3, lost={1, 2}, buddies={0: "p1", 1: "s1", 2: "p0"},
               holding={"s1": {1: [5]}, "p0": {2: [5], 1: [5]}}, staged=[5], peers={"p0": 0, "p1": 1},
               spares=frozenset({"s1"}))
    assert c.source is Source.DISK and "rank 2's state is held by a peer, but it has no bundle" in c.reason


def test_a_buddy_spare_on_a_node_going_away_adopts_nothing():
    """A spare that still answers from a node that drains or died is not counted live by the controller: it
    cannot take a rank's place (before, an empty list was indexed: IndexError in the controller)."""
    c = choose(spares=frozenset({"s1"}))  # rank 1's buddy s2 is on a node going away
    assert c.source is Source.DISK and c.reason == "rank 1's buddy is on a node going away"


def test_the_newest_step_every_lost_rank_buddy_holds():
    c = choose()
    assert (c.source, c.step, c.adopters) == (Source.MEMORY, 5, {1: "s2"})


def test_a_node_with_every_rank_is_recovered_by_their_buddies_elsewhere():
    c = choose(lost={0, 1}, staged=[])
    assert (c.source, c.step, c.adopters) == (Source.MEMORY, 5, {0: "s1", 1: "s2"})


def test_a_step_still_landing_at_the_buddy_is_not_used():
    c = choose(holding={"s1": {0: [4, 5]}, "s2": {1: [4]}})
    assert (c.source, c.step) == (Source.MEMORY, 4)


def test_a_step_the_supervisor_or_a_survivor_lacks_is_not_used():
    assert choose(snapshots={5}, holding={"s2": {1: [4]}}).source is Source.DISK
    assert choose(staged=[5], holding={"s2": {1: [4]}}).source is Source.DISK


def test_the_other_groups_ranks_roll_back_in_place_to_a_step_they_hold():
    """PPO: beside the faulty group, the other group's every rank rolls back from its own slots, so the step
    restored is the newest that they hold too; a group that holds none of the lost ranks' steps sends the repair to
    disk, saying which."""
    assert choose(beside={"actor": [4, 5]}).step == 5
    assert choose(beside={"actor": [4]}).step == 4  # the actor's ranks had not all staged step 5
    assert choose(lost={0, 1}, staged=[], beside={"critic": [5]}).step == 5
    c = choose(beside={"critic": [3]})
    assert c.source is Source.DISK and c.reason == ("the critic's ranks hold no step in memory that every lost "
                                                    "rank's copy does (the critic's [3], the lost ranks' [4, 5])")


@pytest.mark.parametrize("overrides, reason", [
    (dict(enabled="recover.memory is off"), "recover.memory is off"),
    (dict(kind=FaultKind.OBJECT_LOST), "object_lost"),
    (dict(kind=FaultKind.SUPERVISOR_DIED), "the Supervisor restarted"),
    (dict(world_size=0, lost=set()), "no TrainGroup was running"),
    (dict(lost=set()), "every rank answered"),
    (dict(buddies={0: "s1"}), "rank 1 had no buddy"),
    (dict(holding={"s1": {0: [5]}}), "rank 1 and its buddy were lost together"),
    (dict(world_size=3, lost={0, 1}, buddies={0: "s1", 1: "s1"}, holding={"s1": {0: [5], 1: [5]}}), "share one buddy"),
    (dict(holding={"s2": {1: []}}), "no step is held in memory"),
    (PEERS, "rank 1's state is held by a peer, but it has no bundle to start again in and no warm spare is free"),
    (dict(lost={0, 1}, **PEERS), "rank 0 and its buddy were lost together"),
    # a stuck rank that still answers as a holder: its copy is not given, it is lost with the rank it holds
    (dict(lost={0, 1}, **PEERS | dict(holding={"p0": {1: [5]}, "p1": {0: [5]}})),
     "rank 0 and its buddy rank 1 were lost together"),
])
def test_every_loss_the_tier_cannot_cover_goes_to_disk_and_says_why(overrides, reason):
    c = choose(**overrides)
    assert c.source is Source.DISK and reason in c.reason and c.step is None


def test_the_default_job_is_served_by_the_memory_tier_with_spares_or_without():
    from supervisor.config import load_config

    c = load_config()
    # without spares the peers hold each other's copies
    assert c.memory_tier_off({"actor": 2}) is None and c.memory_tier_off({"actor": 0}) is None
    one = load_config(None, ["cluster.n_train_workers=1", "recover.spare_workers=0"])
    assert one.memory_tier_off() == "one rank and no warm spare: nothing holds its copies (recover.spare_workers)"
    # GRPO's KL term against the initial policy: a new rank rebuilds that reference from the config
    assert load_config(None, ["actor.kl_coef=0.1"]).memory_tier_off({"actor": 2}) is None


@pytest.mark.parametrize("overrides, reason", [
    (["recover.memory=off"], "recover.memory is off"),
    (["actor.backend=deepspeed"], "actor.backend fsdp"),
    (["actor.kl_coef=0.1", "actor.ref_update_steps=5"], "KL reference"),
])
def test_auto_falls_back_to_disk_and_says_why(overrides, reason):
    from supervisor.config import load_config

    assert reason in load_config(None, overrides).memory_tier_off({"actor": 2})


def test_memory_on_for_a_job_it_cannot_serve_is_an_error_naming_the_key():
    from supervisor.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="recover.memory = on.*deepspeed"):
        load_config(None, ["recover.memory=on", "actor.backend=deepspeed"])


def test_ranks_sharing_a_node_share_the_one_spare_off_it():
    assert buddy_plan(["b", "b"], spares(s3="b", s4="a")) == {0: "s4", 1: "s4"}


def waiting(seq):
    return {"phase": "train", "secs": 9.0, "seq": seq}


@pytest.mark.parametrize("pending, progress, culprits", [
    ({1}, {0: {"phase": "idle", "secs": 9.0, "seq": 7}, 1: waiting(7)}, {1}),   # the others returned
    ({0, 1}, {0: waiting(7), 1: None}, {1}),                                     # stopped, or its node lost
    ({0, 1, 2}, {0: waiting(8), 1: waiting(7), 2: waiting(8)}, {1}),             # behind the others' collective
    ({0, 1}, {0: waiting(7), 1: waiting(7)}, set()),                             # all in one collective
    ({0, 1}, {0: None, 1: None}, {0, 1}),                                        # every rank silent
])
def test_the_culprits_of_a_hang_are_the_ranks_the_others_wait_on(pending, progress, culprits):
    assert hang_culprits(pending, progress) == culprits


STATIC = dict(rejoins=True, kind=FaultKind.WORKER_DIED, committed=True, reference=False, shrunk=False)
KEEP = dict(kind=FaultKind.WORKER_DIED, world_size=2, lost={1}, placeable={1}, node_lost=False)


def test_a_repair_from_disk_keeps_the_ranks_that_still_answer():
    assert can_keep(**STATIC) is None and keep_survivors(**KEEP) is None
    assert keep_survivors(**KEEP | {"kind": FaultKind.HANG, "lost": {0}, "placeable": {0}}) is None
    assert keep_survivors(**KEEP | {"kind": FaultKind.COLLECTIVE_FAILED, "lost": set(), "placeable": set()}) is None


@pytest.mark.parametrize("change, reason", [
    ({"rejoins": False}, "cannot re-form its process group"),          # deepspeed
    ({"kind": FaultKind.STORAGE_ERROR}, "may not be settled"),
    ({"committed": False}, "no checkpoint yet"),                       # a survivor no longer holds the initial weights
    ({"reference": True}, "KL reference"),                             # refreshed past the checkpoint, maybe
    ({"shrunk": True}, "runs shrunk"),                                 # elastic: a new start grows it back
])
def test_what_rules_out_keeping_any_rank_before_they_are_asked(change, reason):
    assert reason in can_keep(**STATIC | change)


@pytest.mark.parametrize("change, reason", [
    ({"lost": {0, 1}, "placeable": {0, 1}}, "no rank is left to keep"),
    ({"world_size": 0}, "no rank is left to keep"),                    # the fault struck as the group started
    ({"kind": FaultKind.HANG, "lost": set(), "placeable": set()}, "every rank answered after a hang"),
    ({"node_lost": True}, "node is gone"),                             # placed again (and elastically) by a new start
    ({"placeable": set()}, "rank 1 has no bundle"),                    # a rank adopted from a spare, none left
])
def test_every_repair_from_disk_that_starts_every_rank_again_says_why(change, reason):
    assert reason in keep_survivors(**KEEP | change)


def test_after_a_repair_from_memory_a_second_fault_before_the_ranks_link_again_is_served_from_memory():
    """Seen in the phase hang job with the tier: a rank hung in the step after its repair from memory, before the
    ranks were linked again, and went to disk (5 steps trained again). The holders still hold what they held: the
    peer that gave the dead rank its copy, the survivor's own slots the step both rolled back to."""
    from supervisor.cluster.memory_copies import MemoryCopies

    copies = MemoryCopies(None, warn=lambda _: None, linked=lambda _: None)
    try:
        copies.buddies, copies.own, copies.staged = {0: "p1", 1: "p0"}, {0: [17, 18], 1: [17, 18]}, [17, 18]
        # rank 1's new process loaded p0's copy of 18; p1, the dead rank 1, held rank 0's copies
        copies.adopted(18, lost=[1], adopters={}, givers={1: "p0"}, own={0}, gone={"p1"})
        assert copies.buddies == {} and copies.staged == []  # nobody is linked: no new copy goes anywhere
        assert copies.restored == 18  # what the holders still hold of it is what counts (holding: no later step)
        # rank 1 lost again: its giver still holds its copy of 18, and rank 0's own slots hold 18
        assert copies.covering() == {1: "p0"} and copies.staged_by({0}) == [18]
        choice = recovery_source(enabled=None, kind=FaultKind.HANG, world_size=2, lost={1},
                                 buddies=copies.covering(), holding={"p0": {1: [17, 18]}},
                                 staged=copies.staged_by({0}), snapshots={17, 18}, peers={"p0": 0}, bundled={1})
        assert (choice.source, choice.step, choice.givers) == (Source.MEMORY, 18, {1: "p0"})
        # rank 0 lost instead: nothing holds its state (its holder was the dead rank 1)
        assert 0 not in copies.covering()
        # the survivor's next copy, staged but sent nowhere: its own slots hold 18 and 19
        copies.own[0], copies.own[1] = [18, 19], []
        assert copies.staged_by({0}) == [18, 19]
        # a spare that took a dead rank's place is a rank now: it covers nobody, and the survivor's spare still does
        copies.buddies, copies.own = {0: "s0", 1: "s1"}, {0: [5], 1: [5]}
        copies.adopted(5, lost=[1], adopters={1: "s1"}, givers={}, own={0}, gone=set())
        assert copies.covering() == {0: "s0"} and copies.own == {0: [5], 1: []}
    finally:
        copies.linker.shutdown()


def test_a_new_process_that_loaded_a_peers_copy_holds_it_as_its_own_until_its_slots_hold_the_next_steps():
    """Three ranks holding each other's copies (rank r's by rank r + 1's process). Rank 1 dies; rank 2 gives its
    copy of 18 to a new process. Before the ranks are linked again, rank 2 dies too: rank 0 holds its copy of 18,
    and the survivors roll back to 18, the new rank 1 from the copy it loaded (it has no slots of its own yet, and
    staged nothing at step 19). Before, the new process counted as holding nothing: disk."""
    from types import SimpleNamespace

    from supervisor.cluster.memory_copies import MemoryCopies

    copies = MemoryCopies(None, warn=lambda _: None, linked=lambda _: None)
    try:
        copies.buddies, copies.staged = {0: "p1", 1: "p2", 2: "p0"}, [17, 18]
        copies.own = {r: [17, 18] for r in range(3)}
        copies.slots = {r: {"numel": 8, "dtype": 0} for r in range(3)}
        copies.adopted(18, lost=[1], adopters={}, givers={1: "p2"}, own={0, 1, 2}, gone={"p1"})
        assert copies.own == {0: [18], 1: [18], 2: [18]} and copies.covering() == {1: "p2", 2: "p0"}
        asked = SimpleNamespace(remote=lambda: None)
        group = SimpleNamespace(members=[SimpleNamespace(pid=None, node_id=None,
                                                         handle=SimpleNamespace(memory_slots=asked))] * 3,
                                nodes=[None] * 3, world_size=3, call_all=lambda method, step: [True, False, True])
        copies.begin(group, 19)  # the new rank 1 has no slots yet: it staged nothing
        assert copies.own == {0: [18, 19], 1: [18], 2: [18, 19]} and 1 in copies.allocating
        choice = recovery_source(enabled=None, kind=FaultKind.WORKER_DIED, world_size=3, lost={2},
                                 buddies=copies.covering(), holding={"p0": {2: [18]}},
                                 staged=copies.staged_by({0, 1}), snapshots={18, 19}, peers={"p0": 0, "p2": 2},
                                 bundled={2})
        assert (choice.source, choice.step, choice.givers) == (Source.MEMORY, 18, {2: "p0"})
    finally:
        copies.linker.shutdown()


def test_a_second_fault_that_loses_a_survivor_of_the_first_rolls_the_adopter_back_in_the_slots_it_kept():
    """The spare that took rank 1's place kept the slots it held for it, which hold the step restored: when rank 0,
    the first repair's survivor, is lost before the ranks are linked again, its spare adopts and the adopter rolls
    back in place. Before, the adopter's slots were not counted and the repair went to disk."""
    from supervisor.cluster.memory_copies import MemoryCopies

    copies = MemoryCopies(None, warn=lambda _: None, linked=lambda _: None)
    try:
        copies.buddies, copies.own, copies.staged = {0: "s0", 1: "s1"}, {0: [4, 5], 1: [4, 5]}, [4, 5]
        copies.adopted(5, lost=[1], adopters={1: "s1"}, givers={}, own={0, 1}, gone=set())
        assert copies.covering() == {0: "s0"} and copies.own == {0: [5], 1: [5]}
        choice = recovery_source(enabled=None, kind=FaultKind.WORKER_DIED, world_size=2, lost={0},
                                 buddies=copies.covering(), holding={"s0": {0: [4, 5]}},
                                 staged=copies.staged_by({1}), snapshots={4, 5}, peers={}, spares=frozenset({"s0"}))
        assert (choice.source, choice.step, choice.adopters) == (Source.MEMORY, 5, {0: "s0"})
        # an adopter whose slots were still being written gave them up: nothing of rank 1 is held, disk
        copies.buddies, copies.own = {0: "s0", 1: "s1"}, {0: [5], 1: [5]}
        copies.adopted(5, lost=[1], adopters={1: "s1"}, givers={}, own={0}, gone=set())
        assert copies.staged_by({1}) == []
    finally:
        copies.linker.shutdown()

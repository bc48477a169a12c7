"""The cache fault campaign at test scale (benchmarks/fault_campaign.py runs it at full scale): concurrent,
slow and SIGKILLed writers, kills in the middle of a publish, and random corruptions of an entry."""

import cache_faults


def test_concurrent_and_killed_writers_leave_only_whole_right_entries(tmp_path):
    rep = cache_faults.concurrent_writers(tmp_path, runs=2, writers=4, keys=3, kill_fraction=0.5, seed=1)
    assert rep.writers == 8 and rep.failed_writers == 0
    assert (rep.invalid_entries, rep.wrong_entries, rep.missing, rep.leftovers_after_prune) == (0, 0, 0, 0), rep
    assert rep.entries >= 3


def test_a_kill_during_a_publish_leaves_a_counted_temporary_that_is_cleaned(tmp_path):
    rep = cache_faults.kills_during_publish(tmp_path, kills=2)
    assert rep.kills == 2 and rep.entries_after_kill == 0 and rep.temporaries_counted == 2, rep
    assert (rep.cleaned_by_next_writer, rep.cleaned_by_prune, rep.published_after) == (1, 1, 1), rep


def test_corruptions_are_refused_or_harmless_and_never_crash(tmp_path):
    rep = cache_faults.corruptions(tmp_path, count=300, seed=3, readonly_every=10)
    assert rep.crashes == 0, rep.crash_examples
    assert rep.wrong_weights == 0 and rep.readonly_changed_disk == 0, rep
    assert rep.detected + rep.accepted_same_tensors + rep.unchanged == rep.tried
    assert rep.detected > 0.9 * rep.tried, rep.by_kind
    # a changed bit in the stored tensors is always caught (the payload digest)
    assert rep.by_kind["flip-tensor-bit"]["accepted"] == 0, rep.by_kind

"""Cliff detection and the partial-swap splice, on small hand-built batches (K = 4)."""

import numpy as np
import pytest

from lspo_jax.rl.scaffold import SpliceStats, find_cliffs, splice

K, T = 4, 5


def _rows(accuracy, first_id, length=T):
    """Per-row fields whose values name the row: tokens = id, old_logp = -id / 10, mask on the first 3."""
    n = len(accuracy)
    ids = np.arange(first_id, first_id + n)
    return {
        "tokens": np.repeat(ids[:, None], length, axis=1).astype(np.int32),
        "mask": np.broadcast_to(np.arange(length) < 3, (n, length)).copy(),
        "old_logp": np.repeat(-ids[:, None] / 10.0, length, axis=1).astype(np.float32),
        "accuracy": np.asarray(accuracy, np.float32),
        "reward": np.asarray(accuracy, np.float32) - 0.1 * np.arange(n),  # overlong-shaped, unequal
    }


def _base(*groups):
    return _rows(np.concatenate(groups), first_id=0)


def _rerolls(*groups):
    # Re-roll ids start at 100 so a spliced row is recognisable by its tokens and old_logp.
    return _rows(np.concatenate(groups) if groups else np.zeros(0), first_id=100)


def test_find_cliffs_uses_accuracy_per_group():
    acc = np.array([0, 0, 0, 0, 0, 1, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0])
    np.testing.assert_array_equal(find_cliffs(acc, K), [True, False, False, True])
    with pytest.raises(ValueError, match="multiple of group_size"):
        find_cliffs(np.zeros(6), K)


def test_no_cliffs_leaves_the_batch_unchanged():
    base = _base([1, 0, 0, 0], [0, 1, 1, 0])
    cliffs = find_cliffs(base["accuracy"], K)
    out, spliced, stats = splice(base, _rerolls(), cliffs, K)
    assert not spliced.any()
    for key in base:
        np.testing.assert_array_equal(out[key], base[key])
    assert stats == SpliceStats(2, 0, 0, 0, 0, 0) and stats.surpass_rate is None and stats.reroll_pass_rate is None
    assert "scaffold/surpass_rate" not in stats.as_metrics()


@pytest.mark.parametrize(
    ("reroll_acc", "expected_slots"),
    [
        ([0, 0, 0, 0], []),  # nothing passes: the cliff stays a cliff
        ([0, 1, 0, 1], [0, 1]),  # re-rolls 1 and 3 fill slots 0 and 1 of the group, in order
        ([1, 1, 1, 1], [0, 1, 2, 3]),  # every failed row is replaced
    ],
)
def test_single_cliff_with_zero_some_all_passing(reroll_acc, expected_slots):
    base = _base([1, 0, 1, 0], [0, 0, 0, 0], [0, 1, 0, 0])  # group 1 (rows 4..7) is the cliff
    cliffs = find_cliffs(base["accuracy"], K)
    out, spliced, stats = splice(base, _rerolls(reroll_acc), cliffs, K)
    expected_rows = [4 + s for s in expected_slots]
    np.testing.assert_array_equal(np.flatnonzero(spliced), expected_rows)
    passing_ids = 100 + np.flatnonzero(reroll_acc)
    np.testing.assert_array_equal(out["tokens"][expected_rows, 0], passing_ids)
    # Spliced rows carry the re-roll's (adapter-on) old_logp; all other rows keep theirs.
    np.testing.assert_array_equal(out["old_logp"][expected_rows, 0], (-passing_ids / 10.0).astype(np.float32))
    for key in base:
        np.testing.assert_array_equal(out[key][~spliced], base[key][~spliced], err_msg=key)
    n_pass = len(expected_slots)
    assert out["accuracy"][4:8].sum() == n_pass
    assert stats == SpliceStats(3, 1, int(n_pass > 0), 4, n_pass, n_pass)
    assert stats.reroll_pass_rate == n_pass / 4 and stats.surpass_rate == float(n_pass > 0)


def test_several_cliffs_at_once():
    # Groups 0 and 2 are cliffs; re-rolls for group 0 pass at [2], for group 2 at [0, 3].
    base = _base([0, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0])
    cliffs = find_cliffs(base["accuracy"], K)
    out, spliced, stats = splice(base, _rerolls([0, 0, 1, 0], [1, 0, 0, 1]), cliffs, K)
    # Group 0 slot 0 <- re-roll 102; group 2 slots 0, 1 (rows 8, 9) <- re-rolls 104 + 0, 104 + 3.
    np.testing.assert_array_equal(np.flatnonzero(spliced), [0, 8, 9])
    np.testing.assert_array_equal(out["tokens"][[0, 8, 9], 0], [102, 104, 107])
    np.testing.assert_array_equal(out["reward"][[0, 8, 9]], _rerolls([0, 0, 1, 0], [1, 0, 0, 1])["reward"][[2, 4, 7]])
    np.testing.assert_array_equal(out["old_logp"][~spliced], base["old_logp"][~spliced])
    assert (stats.num_cliffs, stats.num_surpassed, stats.num_passing_rerolls, stats.num_spliced) == (2, 2, 3, 3)
    assert stats.reroll_pass_rate == 3 / 8 and stats.surpass_rate == 1.0
    # Inputs are not modified.
    np.testing.assert_array_equal(base["tokens"][:, 0], np.arange(12))


def test_shorter_rerolls_are_right_padded_longer_ones_refused():
    base = _base([0, 0, 0, 0])
    cliffs = find_cliffs(base["accuracy"], K)
    out, _, _ = splice(base, _rows([1, 0, 0, 0], first_id=100, length=3), cliffs, K)
    np.testing.assert_array_equal(out["tokens"][0], [100, 100, 100, 0, 0])
    np.testing.assert_array_equal(out["mask"][0], [True, True, True, False, False])
    assert out["tokens"].shape == base["tokens"].shape and out["mask"].dtype == bool
    with pytest.raises(ValueError, match="truncating"):
        splice(base, _rows([1, 0, 0, 0], first_id=100, length=T + 1), cliffs, K)


def test_splice_checks_reroll_count_and_fields():
    base = _base([0, 0, 0, 0], [0, 0, 0, 0])
    cliffs = find_cliffs(base["accuracy"], K)
    with pytest.raises(ValueError, match="re-rollouts"):
        splice(base, _rerolls([1, 0, 0, 0]), cliffs, K)
    rerolls = _rerolls([1, 0, 0, 0], [0, 0, 0, 0])
    del rerolls["old_logp"]
    with pytest.raises(ValueError, match="old_logp"):
        splice(base, rerolls, cliffs, K)


def test_unequal_groups_count_valid_rows_and_never_fill_padding():
    """K = 3 slots. Group 0: two failed rows and a padding slot (a cliff); group 1: padding only (no cliff);
    group 2: a pass and padding (no cliff). Three passing re-rolls of group 0 fill its two failed rows only."""
    valid = np.array([1, 1, 0, 0, 0, 0, 1, 0, 0], bool)
    accuracy = np.array([0, 0, 0, 0, 0, 0, 1, 0, 0], np.float32)
    cliffs = find_cliffs(accuracy, 3, valid)
    assert cliffs.tolist() == [True, False, False]
    assert find_cliffs(accuracy, 3).tolist() == [True, True, False]  # without valid, padding looks failed
    base = {"accuracy": accuracy, "id": np.arange(9)}
    rerolls = {"accuracy": np.ones(3, np.float32), "id": np.array([100, 101, 102])}
    spliced, rows, stats = splice(base, rerolls, cliffs, 3, valid)
    assert spliced["id"].tolist() == [100, 101, 2, 3, 4, 5, 6, 7, 8] and rows.sum() == 2
    assert stats.num_spliced == 2 and stats.num_surpassed == 1


def test_cliffs_with_at_most_m_successes():
    acc = np.array([0, 0, 0, 0, 0, 1, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1])
    np.testing.assert_array_equal(find_cliffs(acc, K, max_successes=1), [True, True, False, False])
    np.testing.assert_array_equal(find_cliffs(acc, K, max_successes=2), [True, True, True, False])


def test_partial_splice_of_a_group_with_a_success_keeps_it():
    # Group 0 = [0, 1, 0, 0] is a cliff at m = 1: its failed slots 0, 2, 3 take the passing re-rolls 101, 103.
    base = _base([0, 1, 0, 0])
    cliffs = find_cliffs(base["accuracy"], K, max_successes=1)
    out, spliced, _ = splice(base, _rerolls([0, 1, 0, 1]), cliffs, K)
    np.testing.assert_array_equal(out["tokens"][:, 0], [101, 1, 103, 3])
    np.testing.assert_array_equal(np.flatnonzero(spliced), [0, 2])


@pytest.mark.parametrize(
    ("variant", "tokens", "spliced_rows"),
    [
        # group: every slot <- the re-rolls in order, the base success (row 1) and failed re-rolls included.
        ("group", [100, 101, 102, 103], [0, 1, 2, 3]),
        # keep_failed: failed slots 0, 2, 3 <- passing re-rolls 101, 103, then the first failed one, 100.
        ("keep_failed", [101, 1, 103, 100], [0, 2, 3]),
        ("partial", [101, 1, 103, 3], [0, 2]),
    ],
)
def test_splice_variants(variant, tokens, spliced_rows):
    base = _base([0, 1, 0, 0], [1, 1, 0, 0])  # group 0 a cliff at m = 1, group 1 not (2 successes)
    cliffs = find_cliffs(base["accuracy"], K, max_successes=1)
    out, spliced, stats = splice(base, _rerolls([0, 1, 0, 1]), cliffs, K, variant=variant)
    np.testing.assert_array_equal(out["tokens"][:4, 0], tokens)
    np.testing.assert_array_equal(np.flatnonzero(spliced), spliced_rows)
    np.testing.assert_array_equal(out["tokens"][4:], base["tokens"][4:])  # a group that is no cliff is untouched
    assert (stats.num_surpassed, stats.num_passing_rerolls, stats.num_spliced) == (1, 2, len(spliced_rows))


def test_reroll_count_other_than_k():
    # Two cliffs, 2 re-rolls each: group 0's pass at [1] (row 101), group 1's at [0, 1] (rows 102, 103).
    base = _base([0, 0, 0, 0], [0, 0, 0, 0])
    cliffs = find_cliffs(base["accuracy"], K)
    out, spliced, stats = splice(base, _rerolls([0, 1], [1, 1]), cliffs, K, reroll_n=2)
    np.testing.assert_array_equal(np.flatnonzero(spliced), [0, 4, 5])
    np.testing.assert_array_equal(out["tokens"][[0, 4, 5], 0], [101, 102, 103])
    assert (stats.num_rerolls, stats.num_passing_rerolls) == (4, 3)
    with pytest.raises(ValueError, match="unknown splice variant 'swap'"):
        splice(base, _rerolls([0, 1], [1, 1]), cliffs, K, reroll_n=2, variant="swap")


def test_a_carried_field_of_the_rerolls_lands_on_the_spliced_rows_and_zeros_elsewhere():
    # Group 1 (rows 4..7) is the cliff; re-rolls 1 and 3 pass and fill its failed slots 4 and 5 (the partial swap).
    # The re-rolls' adapter-on log-probs are a field only they hold, 2 slots shorter than the base's rows.
    base = _base([1, 0, 1, 0], [0, 0, 0, 0])
    base.pop("old_logp")
    rerolls = _rerolls([0, 1, 0, 1])
    rerolls["adapter_logp"] = np.repeat(-np.arange(1.0, 5.0)[:, None], T - 2, axis=1).astype(np.float32)
    out, spliced, _ = splice(base, rerolls, find_cliffs(base["accuracy"], K), K, carry=("adapter_logp",))
    want = np.zeros((8, T), np.float32)
    want[4, : T - 2], want[5, : T - 2] = -2.0, -4.0  # re-rolls 1 and 3, right-padded with 0 to the base's length
    np.testing.assert_array_equal(out["adapter_logp"], want)
    assert spliced.tolist() == [False] * 4 + [True, True, False, False]
    assert "old_logp" not in out and out["adapter_logp"].dtype == np.float32


def test_a_carried_field_that_base_also_holds_is_refused():
    # Carrying it would put zeros over base's own values on every row the splice leaves alone.
    base = _base([1, 0, 1, 0], [0, 0, 0, 0])
    rerolls = _rerolls([0, 1, 0, 1])
    with pytest.raises(ValueError, match=r"carry field\(s\) \['old_logp'\] are in base too"):
        splice(base, rerolls, find_cliffs(base["accuracy"], K), K, carry=("old_logp",))

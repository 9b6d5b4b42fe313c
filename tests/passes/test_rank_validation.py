"""rank_validation' row in one process: its width is AGREED's whatever the call, its device digests are
made with no host read and change with any one value, the policy column changes with every knob,
and alike optimizers are refused at the second one's first combine. Oracles: the column tables
(AGREED, CHECKED), the knob list (LossScalePolicy's fields), the values themselves."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

import tritonscale
from tritonscale import LossScalePolicy, RankMismatchError
from tritonscale.passes.rank_validation import (
    AGREED,
    CHECKED,
    KINDS,
    REFUSED,
    Agreement,
    CallKind,
    RankChecks,
    policy_digest,
    setting_tensors,
    values_digest,
)
from tritonscale.policy.peer_presets import PRESETS, preset

CPU = torch.device("cpu")


def _sgd(**settings) -> torch.optim.SGD:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], **{"lr": 0.1, **settings})


def _state() -> object:
    scaler = tritonscale.GradScaler("cpu", skip_norm_sigma=2.0, skip_norm_window=4)
    scaler.scale(torch.ones(()))
    return scaler._tensors


def test_the_row_is_as_wide_as_agreed_whatever_the_call_and_reads_nothing(forbid_host_reads):
    agreements = [
        Agreement(RankChecks(), None),
        Agreement(RankChecks(), torch.ones(()), "clip", _sgd(lr=torch.tensor(0.1)), LossScalePolicy(), 1.0, 2.0),
        Agreement(RankChecks(), torch.ones(()), "gradient sum", _sgd(), None, gradients=3, layout=7, state=_state()),
    ]
    for agreement in agreements:
        with forbid_host_reads.armed():
            row = agreement.ranks.stamp("group", torch.ones(()), agreement)
        assert row.shape == (len(AGREED),) and row.dtype == torch.float64
    assert set(AGREED) == set(CHECKED) and set(REFUSED) <= set(AGREED)


def test_a_kind_is_its_word_and_its_column_value_is_fixed():
    """The ``kind`` column's values are part of the row every rank compares: fixed, whether the call
    names the kind by its word (the scaler, ``rank_agreement``) or by its ``CallKind``."""
    assert KINDS == {"flags": 0, "clip": 1, "gradient sum": 2}
    assert [kind.value for kind in CallKind] == ["flags", "clip", "gradient sum"] and str(CallKind.CLIP) == "clip"
    assert Agreement(RankChecks(), None).kind == "flags"
    for kind in CallKind:
        by_word, by_member = (Agreement(RankChecks(), None, k, _sgd(), None, 1.0, 2.0) for k in (kind.value, kind))
        assert by_word.columns() == by_member.columns() and by_member.columns()[0] == KINDS[kind.value]


def test_the_value_digest_changes_with_any_one_value_and_reads_nothing(forbid_host_reads):
    state = _state()
    tensors = [getattr(state, f.name) for f in dataclasses.fields(state) if f.name != "scale"]
    with forbid_host_reads.armed():
        base = values_digest(tensors, CPU)
        again = values_digest([t.clone() for t in tensors], CPU)
    assert torch.equal(base, again) and base.dtype == torch.float64 and base.dim() == 0
    assert float(base) == int(base) < 2**52  # an exact integer in the row's float64 column
    for which, tensor in enumerate(tensors):
        for i in range(tensor.numel()):
            for delta in (1, -1):
                changed = [t.clone() for t in tensors]
                changed[which].view(-1)[i] += delta
                assert not torch.equal(values_digest(changed, CPU), base), (which, i, delta)
    assert float(values_digest([], CPU)) == 0.0


def test_tensor_settings_count_by_value():
    lrs = [setting_tensors(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=torch.tensor(lr)))
           for lr in (0.05, 0.00625, 0.05)]  # fmt: skip
    digests = [values_digest(t, CPU) for t in lrs]
    assert torch.equal(digests[0], digests[2]) and not torch.equal(digests[0], digests[1])
    assert setting_tensors(_sgd()) == []  # a float lr is the optimizer column's, by value


def _changed(value):
    """Another value of a knob's type (validation is not the digest's business)."""
    if isinstance(value, bool):
        return not value
    if value is None:
        return 3.0
    if isinstance(value, str):
        return value + "_other"
    return value * 2 + 1


def test_the_policy_column_changes_with_every_knob_and_tells_the_presets_apart():
    default = LossScalePolicy()
    for name, value in default.knobs().items():
        other = dataclasses.replace(default, **{name: _changed(value)})
        assert policy_digest(other) != policy_digest(default), f"the policy column misses {name}"
    policies = [preset(name).policy for name in PRESETS if name != "tf1"]  # tf1 has required arguments
    policies.append(preset("tf1", init_loss_scale=2.0**15, incr_every_n_steps=1000).policy)
    for p in policies:
        for q in policies:
            assert (policy_digest(p) == policy_digest(q)) == (p.knobs() == q.knobs())


def test_alike_optimizers_are_refused_at_the_second_ones_first_combine():
    ranks, a, b, named = RankChecks(), _sgd(), _sgd(), _sgd()
    named.param_groups[0]["name"] = "decoder"
    row = {name: i for i, name in enumerate(AGREED)}

    def ambiguous(optimizer, group="g") -> float:
        return float(ranks.stamp(group, torch.ones(()), Agreement(ranks, None, optimizer=optimizer))[row["ambiguous"]])

    assert ambiguous(a) == 0 and ambiguous(a) == 0  # the same optimizer again
    assert ambiguous(named) == 0  # a distinguishing key
    assert ambiguous(b) == 1 and ambiguous(b) == 1  # refused, and not remembered: refused again
    assert ambiguous(b, group="another group") == 0  # each group on its own
    del a
    gc.collect()
    assert ambiguous(b) == 0  # the other one is gone: nothing to confuse it with


def _refused() -> torch.Tensor:
    """Two ranks' agreed columns, equal, with ``ambiguous`` set on both."""
    rows = torch.zeros(2, len(AGREED), dtype=torch.float64)
    rows[:, AGREED.index("ambiguous")] = 1
    return rows


def test_a_refused_column_raises_though_every_rank_agrees():
    """Every rank agrees, so the message says what is ambiguous and what works, not that the ranks
    disagree."""
    with pytest.raises(RankMismatchError) as error:
        RankChecks().judge(_refused(), AGREED)
    message = str(error.value)
    assert "refused on all 2 ranks" in message and "do not disagree" in message, message
    assert "disagree, so" not in message and "differs between" not in message, message
    assert "ambiguous: an optimizer this scaler cannot tell apart" in message, message
    assert 'What works instead: give each optimizer\'s param groups a distinguishing key' in message, message
    assert RankChecks().judge(torch.zeros(2, len(AGREED), dtype=torch.float64), AGREED) is None


def test_a_refused_column_beside_a_disagreement_names_both():
    rows = _refused()
    rows[1, AGREED.index("max_norm")] = 2.0
    with pytest.raises(RankMismatchError) as error:
        RankChecks().judge(rows, AGREED)
    message = str(error.value)
    assert "the 2 ranks of the process group disagree" in message, message
    assert "max_norm differs between the ranks (rank 0: 0.0, rank 1: 2.0)" in message, message
    assert "ambiguous: an optimizer this scaler cannot tell apart" in message, message


def test_on_the_gpu_paths_a_refused_column_is_a_device_flag_raised_at_the_next_read(forbid_host_reads):
    ranks = RankChecks()
    with forbid_host_reads.armed():
        flag = ranks.judge(_refused(), AGREED)
    assert float(flag) == 1.0
    with pytest.raises(RankMismatchError, match="cannot tell apart"):
        ranks.raise_if_flagged()

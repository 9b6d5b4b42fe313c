"""The one rule for the scaler a loop helper takes (tritonscale/loop/scaler_arg.py): every helper
refuses torch's GradScaler and None in the same words, naming itself, tritonscale.GradScaler and the
method it reads."""

from __future__ import annotations

import pytest
import torch

import tritonscale


def _skip_aware_lr(scaler):
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=torch.tensor(0.1))
    tritonscale.SkipAwareLR(torch.optim.lr_scheduler.StepLR(optimizer, 2), scaler, total_steps=4)


HELPERS = {
    "StepLog.record": (lambda scaler: tritonscale.StepLog().record(scaler), "stats"),
    "AppliedSteps.record": (lambda scaler: tritonscale.AppliedSteps().record(scaler), "last_skip_flag"),
    "SkipAwareLR": (_skip_aware_lr, "last_skip_flag"),
}


@pytest.mark.parametrize("helper", sorted(HELPERS))
@pytest.mark.parametrize("not_ours", [torch.amp.GradScaler("cpu"), None], ids=["torch-scaler", "none"])
def test_every_loop_helper_refuses_a_scaler_it_cannot_read_in_the_same_words(helper, not_ours):
    call, method = HELPERS[helper]
    expected = f"{helper} takes a tritonscale.GradScaler (it reads its {method}()), got {type(not_ours).__name__}"
    with pytest.raises(TypeError) as caught:
        call(not_ours)
    assert str(caught.value) == expected

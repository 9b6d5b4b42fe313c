"""The backend names (``BackendName``, passes/backends/__init__.py): a ``str`` enum, so every
user-facing string keeps working unchanged. Oracles: the words of the 0.2 API ("auto", "triton",
"torch"), torch's GradScaler for the step the name picks, and the plain ``str`` the scaler kept."""

from __future__ import annotations

import pytest
import torch

import tritonscale
from tritonscale.passes.backends import BACKENDS, BackendName, TorchBackend, check_backend_name, resolve_backend

CPU = torch.device("cpu")


def test_the_names_are_the_words_users_pass():
    assert BACKENDS == ("auto", "triton", "torch")
    assert [name.value for name in BackendName] == list(BACKENDS)
    assert BackendName.TORCH == "torch" and str(BackendName.TORCH) == "torch" and f"{BackendName.AUTO}" == "auto"


@pytest.mark.parametrize("given", ["torch", BackendName.TORCH], ids=["word", "member"])
def test_a_scaler_keeps_the_plain_word_and_steps_as_torchs(given):
    scaler = tritonscale.GradScaler("cpu", init_scale=2.0**4, backend=given)
    assert scaler.backend == "torch" and type(scaler.backend) is str and repr(scaler.backend) == "'torch'"
    assert isinstance(resolve_backend(scaler.backend, CPU), TorchBackend)
    ours, theirs = (torch.nn.Parameter(torch.ones(4)) for _ in range(2))
    for s, p in ((scaler, ours), (torch.amp.GradScaler("cpu", init_scale=2.0**4), theirs)):
        optimizer = torch.optim.SGD([p], lr=0.5)
        s.scale((p * torch.arange(4.0)).sum()).backward()
        s.step(optimizer)
        s.update()
    assert torch.equal(ours, theirs) and scaler.get_scale() == 2.0**4


def test_an_unknown_name_is_refused_with_the_names_that_work():
    with pytest.raises(ValueError, match=r"backend must be one of \('auto', 'triton', 'torch'\), got 'cuda'"):
        check_backend_name("cuda")

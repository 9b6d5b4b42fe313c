"""Under ``torch.compile`` the scaler's calls run eagerly, as torch.amp.GradScaler's do.

A step keeps what it needs on the host (the per-optimizer stages and flags, Python numbers read
from the device where that is free, the Triton launches on raw addresses), and Dynamo would bake
such things into a graph as constants of the first trace or run them on fake tensors. Dynamo skips
torch.amp.GradScaler (it lives in torch); ``runs_eagerly`` does the same for every tritonscale call
that reads or writes scaler state: a compiled function calling one gets a graph break around the
call, the call runs exactly as in eager mode -- everything it calls too, the optimizer's own
``step`` inside ``scaler.step`` included -- and the code around it still compiles. A ``torch.compile``
made inside such a call (the policy rule on CUDA) still compiles. Tracing a scaled step into one
graph is future work.
"""

from __future__ import annotations

import torch

#: Decorator: the function, and all it calls, is never traced by Dynamo (``torch.compiler.disable``).
runs_eagerly = torch.compiler.disable(
    recursive=True, reason="tritonscale runs the scaler's calls eagerly, as torch.amp.GradScaler's"
)

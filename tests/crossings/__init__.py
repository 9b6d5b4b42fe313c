"""The crossing harness: every public entry point under every context, against an oracle.

Each feature of tritonscale is right on the path its own tests take; the defects are where two
features meet (a flat buffer and a tiny scale, a compiled clip and a clip schedule, two ranks and a
logger on one of them). So the tests here are a product, as PyTorch's OpInfo runs every op under
every dtype and mode from one table: one table of rows, tables of columns, and a harness that
runs every cell a row applies to against an independent oracle.

Single process (``test_cells.py``; ids ``test_cell[<row>-<grads>-<scale>-<backend>]``):

* rows, ``entry_points.ENTRY_POINTS``: ``clip_grad_norm_`` (plain SGD: the clip writes the
  gradients; fused AdamW, fused SGD and an optimizer of one's own: it folds), ``unscale_`` + ``step``,
  ``step`` alone (plain and fused), what ``update()`` hands out, ``update(new_scale=...)``,
  ``stats()``, ``found_inf_for``/``overflowed``, a ``state_dict`` round trip mid-run, the API shapes
  (``LossScaleOptimizer`` with an LR scheduler and a deepcopy mid-run, ``Updater``,
  ``DynamicLossScaleManager``), ``optimizer.step()`` called directly after the clip (folded: refused
  at once; plain, with no ``update()``: refused at the next clip, as torch's ``unscale_``), and
  ``nonfinite_grads``; the loop around the scaler, ``loop_rows.LOOP_ROWS``: ``SkipAwareLR`` (a
  tensor and a float lr) against the same torch scheduler stepped on the twin's applied steps;
* columns, ``contexts.py``: where the gradients live and what is done to them (``GRADS``: plain,
  a ``flatten_grads_`` buffer, that buffer written whole, NaN left in its padding, DDP-style bucket
  views, memory moved after recognition, a parameter resized or retyped in place after
  recognition, sparse gradients); the scale (``SCALES``: 2**-126, 2**-80, 2**16, 2**126, numpy
  arguments, ``enabled=False``); the backend (``BACKENDS``: torch, triton, triton timed by
  another stopwatch, ``stopwatch.py``, and the paths a GPU takes, ``gpu_paths.py``: host reads
  not free, the kernels through the interpreter, no host read inside the step but the documented
  ones; its crossing is ``harness.gpu_paths_apply``);
* the oracle, ``twins.py``: the same model with plain gradients under torch.amp.GradScaler +
  torch.nn.utils.clip_grad_norm_ (its documented differences applied: the 2**-126 floor, the
  skip after a disabled scaler's clip). ``harness.run_cell`` runs STEPS iterations with two
  overflows and compares after each: what the row handed out (norms within tests/oracles/tolerances.py),
  scale, growth tracker and state_dict exact, parameters (and gradients where comparable) within
  ``harness.PARAM_TOL``; at the end, every tensor ours handed out must read what it read at its
  step (results kept by a logger, read 10 steps later);
* ``harness.applies`` says which cells exist, each exclusion with its reason (a fused optimizer
  takes no sparse gradient, ...). The Triton backend runs the rows whose passes differ there over
  every gradient context at the ordinary scale and every scale on plain gradients.

More rows (``rows.ROWS`` lists them all): two optimizers on one scaler, every read-out, torch's
setters, an abandoned iteration (``optimizer_rows.py``); checkpoints into a default-built scaler
and through torch's, each importer fed the peer's own state, the other scale managers
(``state_rows.py``); ``StepLog``, ``AppliedSteps``, ``ScaleHistory`` (``loop_rows.py``). More
columns: the policy (``policies.py``: torch's rule, every preset against the peer's transcribed
rule, a static scale, each spike rule, the host checks; the cell id ends with its name when it is
not the default) and gradient accumulation (``contexts.Accumulated``). ``test_coverage.py``
enumerates the public surface and fails on a feature with no row or column.

Compiled (``test_compiled_cells.py``): ``clip_grad_norm_`` or ``update()`` compiled with
``fullgraph=True`` (Dynamo's default and ``dynamic=True``), the scaler a module global, an
``nn.Module`` attribute or a closure, ``max_norm`` changing at every call, no recompilation after
warm-up; oracle: the same steps eager, bit for bit.

Two ranks (``test_rank_cells.py``, ``rank_scenarios.py``, marked slow): controls that must equal
one process holding every gradient, and scenarios where exactly one rank changes one argument,
call or order, which must raise on every rank with nothing changed.

To add a row: write its ``ours(side, step)`` and ``oracle(side, step)`` (one iteration each,
returning what the entry point handed out by name; see ``entry_points.clip_ours``), add an
``EntryPoint`` to ``ENTRY_POINTS``; every column then runs it. To add a column: a ``GradsContext``
subclass (its hooks act on both sides: the twin gets the same values in plain gradients) in
``GRADS``, a ``ScaleContext`` in ``SCALES``, or a name in ``BACKENDS`` with its rule in
``applies``; every row then runs under it. A scenario for two ranks is a function
``(rank, group) -> outcome`` in ``rank_scenarios.SCENARIOS``, and the test of its kind names it.
"""

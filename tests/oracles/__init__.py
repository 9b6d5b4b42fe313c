"""The oracles the tests hold tritonscale to, in one importable package.

Each module restates, independently of tritonscale's code, what tritonscale must equal. Tests
import them by name (``from oracles.peer_rules import RULES``): pytest puts tests/ on sys.path (the
folder of the top-level conftest.py), and ranks spawned by tests/support/multiprocess.py inherit it.

* ``scaler_twins``: torch's ``GradScaler`` and ``clip_grad_norm_`` on twin tiny models (the oracle
  of the misuse matrix, the call sequences, the fold guard and the crossing rows), with bitwise
  snapshots of everything a refused call must leave untouched.
* ``grad_twins``: torch's ``GradScaler`` + ``unscale_`` + ``clip_grad_norm_`` on twin parameters
  holding plain copies of the gradients, for the tests that change how gradients lie in memory.
* ``peer_rules``: each peer's loss-scale update rule (Megatron-LM, DeepSpeed, apex, fairseq, Keras 3,
  tf.keras, TensorFlow 1.x, and torch's own), transcribed from a cited file and commit in the
  peer's arithmetic, built from the presets' arguments; ``follow`` drives our scaler beside one.
* ``scale_rules``: the update rules behind the other API shapes and the checkpoint importers
  (Megatron-LM's, apex's, MindSpore's, TensorFlow's exponential update), the overflow patterns they
  are run on, a one-parameter training ``Loop`` and ``call_outcome`` (what a call raised and warned,
  to compare two runs of a step).
* ``spike_rules``: OLMo-core's z-score skip and ZClip's adaptive clip, transcribed at cited commits.
* ``stats``: each step's ``scaler.stats()`` read at once (a sync per step), the oracle of what the
  loggers read later (``StepLog``, ``AppliedSteps``, ``ScaleHistory``).
* ``training_runs``: one small training run and its one-process oracle (``single_process``: the
  whole batch under torch's scaler), shared by the multi-process tests.
* ``kernel_cases``: the kernel property tests' cases and their checks against the float64
  reference (``tritonscale.kernels.reference``), bitwise where a pass must be exact.
* ``tolerances``: the one tolerance table for norms compared with a float64 oracle, derived.

Kept apart in tests/support/, because they compare nothing: host_reads.py (the guard that makes a
host read raise: a check, not a reference), multiprocess.py (runs a function on gloo ranks),
compiled_placements.py (where a compiled caller finds the scaler: a context; the compiled
tests' oracle is the same steps eager) and launches.py (the launch counter). The crossing harness's twin stays in tests/crossings/.
"""

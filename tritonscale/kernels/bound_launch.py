"""Pre-bound launches: a per-step kernel bound once through Triton's JIT path, proved on every call.

``kernel[grid](*args)`` runs Triton's JIT path on every call: it specializes each argument, builds
the cache key (a string of the specialization and the options), finds the compiled kernel, checks
every module-level global the kernel reads (by value: on 3.9 each ``tl.constexpr`` compared costs
about as much as the rest of the launch), then calls the kernel's launcher. For the one-program
kernels of a step most of the host time is there, not in the launch. A :class:`BoundLaunch` does
the JIT path's work once per specialization and keeps its result:

* **bind** (the first call, and any call the guard does not accept): the call goes through
  ``kernel[grid](...)``, Triton's JIT path, which compiles if it must and launches. The compiled
  kernel it ran is then looked up again in Triton's own cache under Triton's own key
  (``compute_cache_key`` over the binder's specialization of the same arguments), and bound only if
  that finds the very kernel that ran, Triton's bound arguments are this call's in order, and
  :func:`specialization` agrees with Triton's for every runtime argument.
* **guard** (every later call): what the JIT path reads to choose the compiled kernel, and nothing
  else -- each runtime argument's specialization (:func:`specialization`), each constexpr's value
  (compared with ``==``, as Triton's key cache compares it), the options of the call site, the
  knobs the key reads (:func:`key_knobs`), the current device (Triton keeps one cache per device),
  for an autotuned kernel the config the autotuner holds for the call's tuning key, and, checked
  apart from the key, the kernel's globals (by identity; an equal object passes, as Triton's
  ``!=`` lets it) and that no pre-run hook was added.
* **hit**: the launch the JIT path makes, made directly: ``CompiledKernel.run(gx, gy, gz, stream,
  function, packed_metadata, launch_metadata, enter_hook, exit_hook, *every argument, constexprs
  included, in declaration order)``, with the current stream and the launch hooks read at the call.
  While Triton's hook chains call nothing (``knobs.runtime.launch_enter_hook`` and
  ``launch_exit_hook`` empty), the hooks and the launch metadata go as None (the JIT path's
  launcher then calls an empty chain: nothing runs either way) and each plain tensor as its
  address, the ``data_ptr()`` the guard read (the int Triton's launcher reads from it). The
  launcher's check that an address is device memory (``cuPointerGetAttribute``) then ran at the
  bind only: every caller in this package passes tensors on the launch's device (its wrapper
  checks them or moves them there). With a hook added, a hit passes what the JIT path passes: the chains, the metadata and
  the tensors. An autotuned kernel's hits pass the tensors (its tuning key reads their dtypes).
* **miss**: the call goes through ``kernel[grid]`` (so Triton decides, compiles and raises exactly
  as it would), and its specialization is bound beside the others: one small dict per launcher,
  keyed by the guard.
* **prepared** (:class:`PreparedLaunch`; ``BoundLaunch.prepare`` and ``BoundLaunch.at``): a call
  site whose calls differ only in a few tensors skips the guard's generic split of every parameter;
  one generated function proves the varying arguments' specializations, the fixed tensors'
  addresses and dtypes and what a hit's guard reads besides the arguments, then launches as a hit.
  Anything else goes through the launcher's own call.

Off (every call is ``kernel[grid]``): under the interpreter (``TRITON_INTERPRET=1``), on a Triton
whose launch path this was not tested on (``TESTED_TRITON``: the rules below are those of 3.6 and
3.9, checked there by the launch-path tests), and with ``TRITONSCALE_BOUND_LAUNCH=0`` in the
environment when tritonscale is imported; and after its first launch, on a backend whose tensor
specialization is not Triton's native one (ROCm's adds a buffer-range attribute). A kernel whose
signature Triton would specialize by rules not restated here (annotated runtime parameters, ``do_not_specialize``) is never bound; defaulted
parameters (the kernels' ``K: tl.constexpr = KERNEL_CONSTANTS``) bind with their defaults, as
Triton's binder binds them.

Where the rules live in Triton (3.6.0 / 3.9.0, ``triton/`` in the wheel):

* the launch: ``runtime/jit.py`` ``JITFunction.run`` (3.6 L695-746, 3.9 L733-788);
* the binder: ``runtime/jit.py`` ``create_function_from_signature`` (3.6 L391-448, 3.9 L397-465),
  which calls ``native_specialize_impl`` (C++, ``python/src/specialize.cc``: ``specialize_arg``
  dispatches on the argument's type to ``handle_long_type``, ``handle_tensor``, ...);
* the key: ``runtime/jit.py`` ``compute_cache_key`` (3.6 L563, 3.9 L611);
* the autotuner: ``runtime/autotuner.py`` ``Autotuner.run`` (3.6 L212-258, 3.9 L232-297).
"""

from __future__ import annotations

import operator
import os
from typing import Any

import torch
import triton
from triton import knobs
from triton.knobs import HookChain
from triton._utils import canonicalize_ptr_dtype
from triton.compiler import CompiledKernel
from triton.runtime.autotuner import Autotuner
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction, compute_cache_key

from .jit_helpers import INTERPRETING

#: Triton versions whose launch path the rules here restate (major, minor).
TESTED_TRITON = ((3, 6), (3, 9))
TRITON_VERSION = tuple(int(part) for part in triton.__version__.split(".")[:2])

#: Call sites ``BoundLaunch.at`` keeps prepared per launcher (a few per step in practice).
MAX_SITES = 64
#: Whether launches are bound at all (see the module docstring for when they are not).
ENABLED = (
    not INTERPRETING
    and TRITON_VERSION in TESTED_TRITON
    and os.environ.get("TRITONSCALE_BOUND_LAUNCH", "1") != "0"
)


class Unbindable(Exception):
    """An argument of a kind :func:`specialization` does not restate: the call takes the JIT path."""


# ------------------------------------------------------------------------------ specialization
# specialize.cc, handle_long_type: an int equal to 1 becomes a constexpr; otherwise i32 or i64 by
# range (u64 for the unsigned 64-bit values above), "D" when it is a multiple of 16.
ONE = ("constexpr", 1)
I32, I32_D = ("i32", ""), ("i32", "D")
I64, I64_D = ("i64", ""), ("i64", "D")
U64, U64_D = ("u64", ""), ("u64", "D")
# handle_bool_type, handle_float_type: no value specialization; None: a constexpr.
U1, FP32, NONE = ("u1", None), ("fp32", None), ("constexpr", None)


class _PointerSpecs(dict):
    """torch dtype -> (unaligned, aligned) specializations of a tensor argument: specialize.cc's
    handle_tensor, "*<dtype>" by ``triton._utils.canonicalize_ptr_dtype`` and "D" when
    ``data_ptr() % 16 == 0``. Filled at a dtype's first use; one tuple object per pair, so a guard
    compares by identity."""

    def __missing__(self, dtype: torch.dtype) -> tuple[tuple[str, str], tuple[str, str]]:
        pointer = canonicalize_ptr_dtype(dtype, False)
        self[dtype] = specs = ((pointer, ""), (pointer, "D"))
        return specs


_POINTERS = _PointerSpecs()
_Tensor = torch.Tensor


def specialization(value: Any) -> tuple:
    """What Triton's binder makes of a runtime argument: ``(type, attribute)``, equal to
    ``native_specialize_impl(backend, value, is_const=False, specialize=True, align=True)`` for
    tensors, ints, bools, floats and None (the kinds this package passes). Other kinds raise
    :class:`Unbindable`: the call takes the JIT path, which specializes them itself.

    Example: ``specialization(16) == ("i32", "D")``; ``specialization(1) == ("constexpr", 1)``.
    """
    kind = type(value)
    if kind is _Tensor:
        return _POINTERS[value.dtype][value.data_ptr() & 15 == 0]
    if value is None:
        return NONE
    if kind is int:
        if value == 1:
            return ONE
        aligned = value & 15 == 0
        if -(2**31) <= value < 2**31:
            return I32_D if aligned else I32
        if -(2**63) <= value < 2**63:
            return I64_D if aligned else I64
        if 0 <= value < 2**64:
            return U64_D if aligned else U64
        raise Unbindable("an int outside 64 bits (Triton raises OverflowError)")
    if kind is bool:
        return U1
    if kind is float:
        return FP32
    if isinstance(value, _Tensor):  # a subclass (a Parameter): torch's metaclass check, last
        return _POINTERS[value.dtype][value.data_ptr() & 15 == 0]
    raise Unbindable(f"an argument of type {kind.__name__}")


# ------------------------------------------------------------------------------ knobs in the key
if TRITON_VERSION >= (3, 9):

    def key_knobs(jit: JITFunction) -> tuple:
        """The knobs ``JITFunction.run`` adds to the options of the key (3.9 L734-736), read now;
        a stages-inspection hook adds a pipeline hash to the specialization (L753-755): not bound."""
        if knobs.runtime.add_stages_inspection_hook is not None:
            raise Unbindable("a stages-inspection hook is set")
        return (
            jit.debug or knobs.runtime.debug,
            knobs.compilation.instrumentation_mode,
            knobs.compilation.fpsan_homomorphic_casts,
        )

else:

    def key_knobs(jit: JITFunction) -> tuple:
        """The knobs ``JITFunction.run`` adds to the options of the key (3.6 L696-697), read now."""
        return (jit.debug or knobs.runtime.debug, knobs.compilation.instrumentation_mode)


def _jit_knob_kwargs(jit: JITFunction, kwargs: dict) -> dict:
    """``kwargs`` with the knobs ``JITFunction.run`` adds before it calls the binder."""
    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", jit.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    if TRITON_VERSION >= (3, 9):
        kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    return kwargs


# ------------------------------------------------------------------------------ the launcher
# The guard's key: (specializations, options, key_knobs, device, the autotuner's config or None).
_SPECS, _OPTIONS, _KNOBS, _DEVICE, _CONFIG = range(5)


def _splitter(names: list[str], runtime: set[str], defaults: dict[str, Any], addresses: bool = False):
    """A function with the kernel's parameters and their ``defaults`` (and ``**options``) that
    returns (every argument in declaration order, the guard's specializations: :func:`specialization`
    of each runtime argument, each constexpr's value, the options). Generated, as Triton generates
    its binder, so a call binds its keywords in C. A runtime argument that is the same object as the
    one before it takes that one's specialization: the same object, the same answer.

    ``addresses``: each plain tensor argument comes back as its address (``data_ptr()``, the int
    its specialization was read from), the value Triton's C launcher would read from it; the
    specializations are the same."""
    lines, specs, values, previous = [], [], [], None
    for i, name in enumerate(names):
        if name not in runtime:
            specs.append(name)
            values.append(name)
            previous = None
            continue
        specs.append(f"_s{i}")
        if addresses:
            values.append(f"_v{i}")
            if previous is not None:
                lines.append(f"    if {name} is {names[previous]}:")
                lines.append(f"        _s{i}, _v{i} = _s{previous}, _v{previous}")
                lines.append(f"    elif {name} is None:")
                lines.append(f"        _s{i}, _v{i} = _NONE, None")
                lines.append(f"    elif type({name}) is _T:")
            else:
                lines.append(f"    if {name} is None:")
                lines.append(f"        _s{i}, _v{i} = _NONE, None")
                lines.append(f"    elif type({name}) is _T:")
            lines.append(f"        _v{i} = {name}.data_ptr()")
            lines.append(f"        _s{i} = _P[{name}.dtype][_v{i} & 15 == 0]")
            lines.append("    else:")
            lines.append(f"        _s{i}, _v{i} = spec({name}), {name}")
        else:
            values.append(name)
            same = f"_s{previous} if {name} is {names[previous]} else " if previous is not None else ""
            lines.append(f"    _s{i} = {same}spec({name})")
        previous = i
    params = [f"{name}=_d{i}" if name in defaults else name for i, name in enumerate(names)]
    source = "\n".join(
        [f"def split({', '.join(params)}, **_options):", *lines,
         f"    return ({', '.join(values)},), ({', '.join(specs)},), _options", ""]
    )  # fmt: skip
    namespace = {"spec": specialization, "_T": _Tensor, "_P": _POINTERS, "_NONE": NONE}
    namespace.update({f"_d{i}": defaults[name] for i, name in enumerate(names) if name in defaults})
    exec(source, namespace)
    return namespace["split"]


class _Bound:
    """One bound specialization: the compiled kernel and what its launch needs besides the call."""

    __slots__ = ("run", "kernel", "function", "metadata", "config", "tuned", "order")

    def __init__(self, kernel, config=None, order=None):
        self.run = kernel.run  # the launcher (CompiledKernel.run; its handles are loaded: it ran)
        self.kernel = kernel
        self.function = kernel.function
        self.metadata = kernel.packed_metadata
        # Autotuned: the config (held, so that the id in the key stays its own), its constexprs'
        # values, and the order that places the call's arguments and those as the kernel declares them.
        self.config = config
        self.tuned = tuple(config.kwargs.values()) if config is not None else ()
        self.order = order


class BoundLaunch:
    """``kernel[grid](*args, **kwargs)``, bound once per specialization (module docstring).

    Args:
        kernel: a ``@triton.jit`` function, or a ``triton.autotune`` over one.

    Example::

        _UPDATE = BoundLaunch(policy_update_kernel)
        _UPDATE((1,), scale, tracker, ..., NUM_FOUND=1, ..., num_warps=1)   # as kernel[(1,)](...)
    """

    def __init__(self, kernel):
        self.kernel = kernel
        self.bound: dict[tuple, _Bound] = {}
        self._last: tuple[tuple, _Bound] | None = None  # the last hit's (key, entry): compared before hashing
        self._sites: dict[Any, PreparedLaunch] = {}  # at(): a call site's key -> its prepared launch
        #: Why this launcher never binds (None when it does); why the last bind was refused.
        self.declined: str | None = None if ENABLED else "bound launches are off"
        self.refused: str | None = None
        if self.declined is None:
            self._prepare()

    def _prepare(self) -> None:
        tuner = self.kernel if isinstance(self.kernel, Autotuner) else None
        jit = tuner.fn if tuner is not None else self.kernel
        if not isinstance(jit, JITFunction):
            self.declined = f"{type(jit).__name__} is not a JITFunction"
            return
        unusual = [p.name for p in jit.params if p.do_not_specialize or p.do_not_specialize_on_alignment
                   or (p.annotation and not p.is_constexpr)]  # fmt: skip
        if unusual:
            self.declined = f"parameters specialized by rules not restated here: {unusual}"
            return
        tuned = set().union(*(config.kwargs for config in tuner.configs)) if tuner is not None else set()
        self._jit, self._tuner = jit, tuner
        self._names = [p.name for p in jit.params if p.name not in tuned]
        runtime = {p.name for p in jit.params if not p.is_constexpr}
        defaults = {p.name: p.default for p in jit.params if p.has_default}
        self._split = _splitter(self._names, runtime, defaults)
        self._addressed = _splitter(self._names, runtime, defaults, addresses=True)
        self._globals: list[tuple[dict, Any, tuple]] = []

    def __call__(self, grid: tuple[int, ...], *args, **kwargs):
        """Launch; returns the compiled kernel, as ``kernel[grid](...)`` does."""
        if self.declined is not None or type(grid) is not tuple:  # a callable grid: Triton's to call
            return self.kernel[grid](*args, **kwargs)
        enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        hooked = not (_calls_nothing(enter) and _calls_nothing(exit_))
        try:
            key, values = self.guard(args, kwargs, addresses=not hooked)
        except Unbindable:
            return self.kernel[grid](*args, **kwargs)
        last = self._last
        if last is not None and key == last[0]:  # equal element by element, mostly by identity
            bound = last[1]
        else:
            bound = self.bound.get(key)
            if bound is None:
                return self._bind(grid, args, kwargs)
            self._last = (key, bound)
        if not self._still_valid():
            return self._bind(grid, args, kwargs)
        if bound.order is not None:
            values = bound.order(values + bound.tuned)
        stream = driver.active.get_current_stream(key[_DEVICE])
        kernel = bound.kernel
        if hooked:  # what the JIT path passes: the hooks, and the metadata they are called with
            metadata = kernel.launch_metadata(grid, stream, *values)
        else:  # hooks that call nothing: the launcher calls none (the JIT path's calls an empty chain)
            metadata = enter = exit_ = None
        bound.run(
            grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
            bound.function, bound.metadata, metadata, enter, exit_, *values,
        )  # fmt: skip
        return kernel

    def guard(self, args: tuple, kwargs: dict, addresses: bool = False) -> tuple[tuple, tuple]:
        """(the guard's key for a call with ``args`` and ``kwargs``, its arguments in declaration
        order; with ``addresses``, each plain tensor as its ``data_ptr()``). Reads what the JIT path
        reads to choose a compiled kernel and nothing else; raises :class:`Unbindable` for a call
        the rules here do not cover."""
        # (an autotuner's key reads its arguments' dtypes: its launches pass the tensors)
        addressed = addresses and self._tuner is None
        values, specs, options = (self._addressed if addressed else self._split)(*args, **kwargs)
        device = driver.active.get_current_device()
        config = None
        if self._tuner is not None:
            config = self._tuned_config(values)
            config = id(config) if config is not None else None
        return (specs, tuple(options.items()), key_knobs(self._jit), device, config), values

    def prepare(self, grid: tuple[int, ...], args: tuple, kwargs: dict, varying: tuple[int, ...]) -> PreparedLaunch:
        """``self(grid, *args, **kwargs)`` for calls that differ from this one only in the arguments
        at the positions ``varying`` (tensors or None): see :class:`PreparedLaunch`.

        Args:
            grid: the launch grid, a tuple.
            args: the call's positional arguments (every runtime parameter among them).
            kwargs: its keyword arguments (the constexprs and options), fixed from now on.
            varying: the positions in ``args`` that a call of the prepared launch passes.

        Returns:
            the prepared launch.
        """
        return PreparedLaunch(self, grid, args, kwargs, varying)

    def at(self, site: Any, grid: tuple[int, ...], args: tuple, kwargs: dict, varying: tuple[int, ...]) -> Any:
        """``self(grid, *args, **kwargs)`` at a call site whose calls differ only in the arguments at
        the positions ``varying`` while ``site`` is the same: the first call goes through ``self``,
        later ones through the launch prepared from it (:class:`PreparedLaunch`).

        ``site`` is the caller's promise: a hashable key that is equal only for calls equal in the
        grid, in every argument outside ``varying`` and in ``kwargs`` (the launch-path tier holds
        each caller to it: every launch made here equals the JIT path's for the call's own
        arguments). At most ``MAX_SITES`` sites are kept; more start again from none.

        Args:
            site: the call site's key (a tuple of the values that fix the other arguments).
            grid: the launch grid, a tuple.
            args: the call's positional arguments (every runtime parameter among them).
            kwargs: its keyword arguments (constexprs and options).
            varying: the positions in ``args`` that change between calls at ``site``.

        Returns:
            what ``self(grid, *args, **kwargs)`` returns.
        """
        prepared = self._sites.get(site)
        if prepared is not None:
            return prepared.from_args(args)
        compiled = self(grid, *args, **kwargs)
        if len(self._sites) >= MAX_SITES:
            self._sites.clear()
        self._sites[site] = self.prepare(grid, args, kwargs, varying)
        return compiled

    def lookup(self, *args, **kwargs) -> Any:
        """The compiled kernel a call with these arguments would launch without the JIT path, or
        None where it would take it (a miss, a changed global, a hook, a kind not restated here)."""
        if self.declined is not None:
            return None
        try:
            key, _ = self.guard(args, kwargs)
        except Unbindable:
            return None
        bound = self.bound.get(key)
        return bound.kernel if bound is not None and self._still_valid() else None

    # -------------------------------------------------------------------- what a hit also checks
    def _still_valid(self) -> bool:
        """The checks outside the key: no pre-run hook, and the globals unchanged (JITFunction.run:
        "Check that used global values have not changed", 3.6 L724-729, 3.9 L769-774)."""
        if self._jit.pre_run_hooks:
            return False
        for namespace, read, expected in self._globals:
            try:
                if read(namespace) != expected:  # identical objects compare equal without __eq__
                    return False
            except KeyError:
                return False
        return True

    def _tuned_config(self, values: tuple):
        """The config ``Autotuner.run`` launches these arguments with (3.6 L213-244, 3.9 L233-283),
        or None where it would tune first: its cache's entry for the values of its key arguments
        followed by str(dtype) of every argument that has one; with one config, that config."""
        tuner = self._tuner
        if len(tuner.configs) == 1:
            return tuner.configs[0]
        named = dict(zip(self._names, values))
        key = [named[name] for name in tuner.keys if name in named]
        key += [str(value.dtype) for value in values if hasattr(value, "dtype")]
        return tuner.cache.get(tuple(key))

    # -------------------------------------------------------------------- binding
    def _bind(self, grid, args, kwargs):
        """The JIT path for this call, then its compiled kernel bound under the guard's key when
        Triton's own cache and key agree (``refused`` says why not, when they do not)."""
        compiled = self.kernel[grid](*args, **kwargs)
        self._last = None
        try:
            key, values = self.guard(args, kwargs)  # after the JIT path: an autotuner has its config now
            self.bound[key] = self._checked(compiled, args, kwargs, values, key)
            self.refused = None
        except _Refused as why:
            self.refused = str(why)
        return compiled

    def _checked(self, compiled, args, kwargs, values, key) -> _Bound:
        """The bound entry for a call the JIT path just launched as ``compiled``, once Triton's own
        binder, key and cache confirm that this guard's key and arguments are Triton's."""
        jit, tuner = self._jit, self._tuner
        if not isinstance(compiled, CompiledKernel):
            raise _Refused(f"the JIT path returned {type(compiled).__name__}, not a CompiledKernel")
        config, order, jit_kwargs = None, None, dict(kwargs)
        if tuner is not None:
            config = tuner.best_config
            if config.pre_hook is not None:
                raise _Refused("the autotuner's config has a pre_hook")
            if key[_CONFIG] != id(config):
                raise _Refused("the config found here is not the one the autotuner launched")
            jit_kwargs.update(config.all_kwargs())
            names = self._names + list(config.kwargs)
            order = operator.itemgetter(*[names.index(p.name) for p in jit.params])
            values = order(values + tuple(config.kwargs.values()))
        # Triton's own binder and key for the same call (JITFunction.run's first half).
        kernel_cache, kernel_key_cache, _, backend, binder = jit.device_caches[key[_DEVICE]]
        if not getattr(backend, "supports_native_tensor_specialization", False):
            # ROCm's backend adds its own attributes to a tensor's (the 2 GB buffer range, "S"),
            # which the rule here does not restate: its launches stay on the JIT path.
            self.declined = f"{type(backend).__name__} specializes tensors by rules not restated here"
            raise _Refused(self.declined)
        bound_args, triton_specs, options = binder(*args, **_jit_knob_kwargs(jit, jit_kwargs))
        if kernel_cache.get(compute_cache_key(kernel_key_cache, triton_specs, options)) is not compiled:
            raise _Refused("Triton's cache holds another kernel under Triton's key for this call")
        triton_values = tuple(bound_args.values())
        if len(triton_values) != len(values) or any(a is not b for a, b in zip(triton_values, values)):
            raise _Refused("Triton bound the arguments in another order")
        ours = dict(zip(self._names, key[_SPECS]))  # the tuned constexprs follow from the config
        for param, triton_spec in zip(jit.params, triton_specs):
            if param.name in ours:
                spec = ("constexpr", ours[param.name]) if param.is_constexpr else ours[param.name]
                if spec != triton_spec:
                    raise _Refused(f"{param.name} specializes as {triton_spec} in Triton, as {spec} here")
        self._globals = _global_reads(jit)  # the objects that just passed Triton's own check
        return _Bound(compiled, config, order)


class PreparedLaunch:
    """One call site's launch, prepared: ``prepared(*varying)`` is ``launcher(grid, *args, **kwargs)``
    with the arguments at the positions ``varying`` replaced by the ones given, as fast as a launch
    whose other arguments are already known can be proved.

    Prepared from a call that is bound (:meth:`BoundLaunch.prepare`), it holds that call's compiled
    kernel, its constexprs, options and non-tensor arguments, and its fixed tensors themselves. Each
    call then proves, in one generated function, what the guard of a hit would read for it:

    * each fixed tensor still has the address and the dtype it was prepared with (a tensor whose
      memory moved, ``set_``, ``resize_``, ``.data = ...``, fails here);
    * each varying argument has the prepared one's specialization (a plain tensor of the same dtype
      and 16-byte alignment, on the same device; a float where that was a float; None where that
      was None);
    * the kernel's globals and pre-run hooks, the knobs in Triton's key and the current device are
      as at the bind, and the launch hooks call nothing.

    It then calls the launcher with the addresses, the current stream and no hooks, as a hit does.
    Anything else -- and every call where launches are not bound (the interpreter, an untested
    Triton, ``TRITONSCALE_BOUND_LAUNCH=0``), for an autotuned kernel, or where the call it was
    prepared from was not bound -- goes through ``launcher(grid, *args, **kwargs)``, which decides as
    always. A prepared launch therefore never launches another kernel than the launcher would; it
    only skips the guard's generic work (the split of every parameter, the key's hash).

    Example::

        prepared = _UPDATE.prepare((1,), args, kwargs, varying=(5, 9))
        prepared(found_inf, skip)  # as _UPDATE((1,), *args[:5], found_inf, *args[6:9], skip, ...)
    """

    def __init__(self, launcher: BoundLaunch, grid: tuple[int, ...], args: tuple, kwargs: dict, varying: tuple):
        self.launcher, self.grid, self.kwargs = launcher, grid, dict(kwargs)
        self.varying = tuple(varying)
        if len(set(self.varying)) != len(self.varying) or not all(0 <= i < len(args) for i in self.varying):
            raise ValueError(f"varying positions {varying} are not distinct positions of the {len(args)} arguments")
        #: Whether calls launch directly (True) or always go through the launcher (False), and why not.
        self.direct, self.why_not = False, None
        self._call, self.from_args = self._generate(tuple(args))
        # What is kept of the call: its fixed arguments (a varying one is not kept alive by it).
        self.args = tuple(None if i in self.varying else a for i, a in enumerate(args))

    def __call__(self, *varying: Any) -> Any:
        """Launch with ``varying`` at the prepared positions; returns what the launcher returns.
        (``from_args(args)``: the same with a whole argument tuple, its varying positions read.)"""
        return self._call(*varying)

    def full_call(self, *varying: Any) -> tuple[tuple[int, ...], tuple, dict]:
        """(grid, args, kwargs) of the launcher's call that ``self(*varying)`` stands for."""
        args = list(self.args)
        for position, value in zip(self.varying, varying, strict=True):
            args[position] = value
        return self.grid, tuple(args), self.kwargs

    def _through_launcher(self, *varying: Any) -> Any:
        grid, args, kwargs = self.full_call(*varying)
        return self.launcher(grid, *args, **kwargs)

    def _bound_entry(self) -> tuple[tuple, _Bound] | None:
        launcher = self.launcher
        if launcher.declined is not None or launcher._tuner is not None:
            self.why_not = launcher.declined or "an autotuned kernel (its key reads the tensors)"
            return None
        if not (_calls_nothing(knobs.runtime.launch_enter_hook) and _calls_nothing(knobs.runtime.launch_exit_hook)):
            self.why_not = "a launch hook is set"
            return None
        try:
            key, _ = launcher.guard(self.args, self.kwargs, addresses=True)
        except Unbindable as why:
            self.why_not = str(why)
            return None
        bound = launcher.bound.get(key)
        if bound is None or not launcher._still_valid():
            self.why_not = "the call it was prepared from is not bound"
            return None
        return key, bound

    def _slow_args(self, args: tuple) -> Any:
        return self._through_launcher(*(args[i] for i in self.varying))

    def _generate(self, args: tuple):
        """The prepared call, taking the varying arguments and taking a whole argument tuple: the
        proofs and the launch, or the launcher's call (the class docstring)."""
        self.args = args
        found = self._bound_entry()
        if found is None:
            return self._through_launcher, self._slow_args
        key, bound = found
        launcher, names = self.launcher, self.launcher._names
        runtime = {p.name for p in launcher._jit.params if not p.is_constexpr}
        if any(name in runtime for name in names[len(args) :]):
            self.why_not = "a runtime argument passed by keyword"
            return self._through_launcher, self._slow_args
        params = [f"a{i}" for i in range(len(self.varying))]
        namespace: dict[str, Any] = {
            "_T": _Tensor, "_valid": launcher._still_valid, "_knobs": key_knobs, "_jit": launcher._jit,
            "_K": key[_KNOBS], "_DEV": key[_DEVICE], "_driver": driver, "_rt": knobs.runtime,
            "_HC": HookChain, "_run": bound.run, "_fn": bound.function, "_md": bound.metadata,
            "_slow": self._through_launcher, "_G": self.grid + (1,) * (3 - len(self.grid)),
        }  # fmt: skip
        checks = [
            "_valid()", "_knobs(_jit) == _K", "_active.get_current_device() == _DEV",
            # (_calls_nothing, inline)
            "((h := _rt.launch_enter_hook) is None or (type(h) is _HC and not h.calls))",
            "((h := _rt.launch_exit_hook) is None or (type(h) is _HC and not h.calls))",
        ]  # fmt: skip
        lines, values = [], []
        where = {position: index for index, position in enumerate(self.varying)}
        for i, value in enumerate(args):
            tensor = type(value) is _Tensor
            if i in where:
                name = params[where[i]]
                if value is None:
                    checks.append(f"{name} is None")
                    values.append("None")
                    continue
                if type(value) is float:  # Triton's fp32 whatever the value: only the type is proved
                    checks.append(f"type({name}) is float")
                    values.append(name)
                    continue
                if not tensor:
                    raise ValueError(f"a varying argument must be a tensor, a float or None, not {type(value).__name__}")
                namespace[f"_D{i}"], namespace[f"_G{i}"] = value.dtype, value.get_device()
                aligned = value.data_ptr() & 15 == 0
                lines.append(f"    if type({name}) is not _T or {name}.dtype is not _D{i} or {name}.get_device() != _G{i}:")
                lines.append(f"        return _slow({', '.join(params)})")
                lines.append(f"    p{i} = {name}.data_ptr()")
                checks.append(f"p{i} & 15 {'==' if aligned else '!='} 0")
                values.append(f"p{i}")
            elif tensor:
                namespace[f"_F{i}"], namespace[f"_D{i}"] = value, value.dtype
                namespace[f"_A{i}"] = value.data_ptr()
                checks.append(f"_F{i}.data_ptr() == _A{i}")
                checks.append(f"_F{i}.dtype is _D{i}")
                values.append(f"_A{i}")
            else:
                namespace[f"_C{i}"] = value
                values.append(f"_C{i}")
        _, all_args, _ = _bound_call(launcher, args, self.kwargs)
        values += [f"_X{j}" for j in range(len(args), len(all_args))]
        namespace.update({f"_X{j}": all_args[j] for j in range(len(args), len(all_args))})
        unpack = f"    {', '.join(params)}{',' if len(params) == 1 else ''} = {', '.join(f'_args[{i}]' for i in self.varying)}"
        body = [
            *lines,
            "    _active = _driver.active",
            f"    if not ({' and '.join(checks)}):",
            f"        return _slow({', '.join(params)})",
            f"    _run(_G[0], _G[1], _G[2], _active.get_current_stream(_DEV), _fn, _md, None, None, None, {', '.join(values)})",
            "    return _bound",
        ]  # fmt: skip
        source = "\n".join([
            f"def prepared({', '.join(params)}):", *body, "",
            "def prepared_args(_args):", *([unpack] if params else []), *body, "",
        ])  # fmt: skip
        namespace["_bound"] = bound.kernel
        exec(source, namespace)
        self.direct = True
        return namespace["prepared"], namespace["prepared_args"]


def _bound_call(launcher: BoundLaunch, args: tuple, kwargs: dict) -> tuple[tuple, tuple, dict]:
    """(specializations, every argument in declaration order, options) of a call, as the
    launcher's split makes them (constexprs and defaults included)."""
    values, specs, options = launcher._split(*args, **kwargs)
    return specs, values, options


def _calls_nothing(hook: Any) -> bool:
    """A launch hook that calls nothing: None, or Triton's ``HookChain`` with no hook added."""
    return hook is None or (type(hook) is HookChain and not hook.calls)


class _Refused(Exception):
    """A bind that the cross-check against Triton's own cache and key refused."""


def _global_reads(jit: JITFunction) -> list[tuple[dict, Any, tuple]]:
    """(namespace, reader, the objects there now) for the globals Triton checks on each launch
    (``used_global_vals``: (name, id(namespace)) -> (value, namespace)), grouped by namespace.
    Taken right after a JIT launch passed Triton's own check, so these objects equal its copies."""
    names: dict[int, tuple[dict, list[str]]] = {}
    for (name, _), (_, namespace) in jit.used_global_vals.items():
        names.setdefault(id(namespace), (namespace, []))[1].append(name)
    reads = []
    for namespace, keys in names.values():
        # (one name read twice: the reader returns a tuple for any count)
        read = operator.itemgetter(*keys, *keys[:1]) if len(keys) == 1 else operator.itemgetter(*keys)
        reads.append((namespace, read, read(namespace)))
    return reads

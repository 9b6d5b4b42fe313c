"""Triton's real launch path on a CPU-only machine: the harness of the launch-path test tier.

Two levels, both working unchanged on triton 3.6 and 3.9, both for a process WITHOUT
``TRITON_INTERPRET`` (``tests/conftest.py`` sets it, so the tier's tests run their launches in a
subprocess, as ``tests/test_compile_targets.py`` runs its compiles):

Level 1, ``fake_driver``: a ``CudaDriver`` subclass made Triton's active driver. Triton's JIT path
runs for real (binder, specialization, cache key, globals check, ``triton.compile`` to an sm_90
cubin, ``CompiledKernel``); the launcher records its call instead of launching::

    from launch_path import fake_driver
    driver = fake_driver.activate()          # first thing, before any launch
    ...                                      # launch kernels on CPU tensors
    driver.launches                          # [fake_driver.Launch(name, grid, stream, function,
                                             #   packed_metadata, args, signature, constants, ...)]

``param_block.expected_params(launch.signature, launch.args)`` is the parameter block those
arguments should give, computed without Triton's launcher.

Level 2, ``stub``: Triton's own ``CudaDriver``, ``CudaUtils`` and C launcher (built by Triton with
gcc) over a stub ``libcuda.so.1`` (``stub_libcuda.c``, built with gcc at first use, found through
``TRITON_LIBCUDA_PATH``); only the device, stream and capability queries are fixed. The stub's
``cuLaunchKernelEx`` copies the kernel parameter block, laid out by the cubin's own parameter
table, instead of launching::

    from launch_path import stub
    driver = stub.activate()                 # first thing, before any launch
    ...
    stub.launches()                          # [stub.StubLaunch(name, grid, block, stream, params)]
    driver.python_launches                   # the same launches as Python made them (Launch)
    stub.reset()                             # forget both

Both levels answer device 0, stream ``fake_driver.FAKE_STREAM``, sm_90 with 132 SMs.
"""

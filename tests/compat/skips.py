"""The one reviewed list of torch tests that do not run to their end against rpcdist.

A test is listed only if what it needs is a torch internal that no reimplementation should
copy; each entry is ``"<torch test class>.<test method>": Skip(category, reason)``, and its
category is one of :data:`CATEGORIES`. A public behaviour a torch user can reach is never
listed: if rpcdist gets it wrong, the test fails.

How each category is applied (``launcher.generate_tests``):

* ``TORCHSCRIPT``: the test *runs*. It counts as skipped only if it stops at rpcdist's
  refusal of a TorchScript RemoteModule (``_module_interface_cls``), raised by
  ``rpcdist.nn.api.remote_module._refuse_torchscript``; whatever it asserted before that point
  must hold (e.g. ``test_forward_async`` checks the Python RemoteModule first), and any other
  error fails it.
* every other category: the test is not started.

``test_substitution.py`` checks that every entry names an existing test of a suite in
``suites.SUITES`` and has one of these categories.
"""

from __future__ import annotations

from typing import NamedTuple

TORCHSCRIPT = "TorchScript"  # scripted RemoteModules, torch.jit functions over RPC
CUDA = "CUDA"  # CUDA tensors, device maps
TENSORPIPE = "TensorPipe"  # TensorPipe-only options (transports, channels)
TORCH_PRIVATE = "torch-private"  # torch's `_`-prefixed agent hooks and internal counters

CATEGORIES = frozenset({TORCHSCRIPT, CUDA, TENSORPIPE, TORCH_PRIVATE})


class Skip(NamedTuple):
    """Why a test does not run to its end: its category and what exactly it needs."""

    category: str
    reason: str


_SCRIPTED_REMOTE_MODULE = (
    "a TorchScript RemoteModule (_RemoteModule(..., _module_interface_cls=...) and torch.jit.script "
    "of it) needs torch's C++ RRef and TorchScript RPC"
)

SKIPS: dict[str, Skip] = {
    # --- torch/testing/_internal/distributed/nn/api/remote_module_test.py
    "RemoteModuleTest.test_forward_async": Skip(
        TORCHSCRIPT, f"the Python RemoteModule passed; then {_SCRIPTED_REMOTE_MODULE}"
    ),
    "RemoteModuleTest.test_forward_sync": Skip(
        TORCHSCRIPT, f"the Python RemoteModule passed; then {_SCRIPTED_REMOTE_MODULE}"
    ),
    "RemoteModuleTest.test_forward_async_script": Skip(TORCHSCRIPT, _SCRIPTED_REMOTE_MODULE),
    "RemoteModuleTest.test_forward_sync_script": Skip(TORCHSCRIPT, _SCRIPTED_REMOTE_MODULE),
    "RemoteModuleTest.test_remote_module_py_pickle_not_supported_script": Skip(
        TORCHSCRIPT, _SCRIPTED_REMOTE_MODULE
    ),
    "ThreeWorkersRemoteModuleTest.test_send_remote_module_over_the_wire_script_not_supported": Skip(
        TORCHSCRIPT, _SCRIPTED_REMOTE_MODULE
    ),
}

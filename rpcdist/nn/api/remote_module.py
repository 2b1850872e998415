"""``RemoteModule``: an ``nn.Module`` that lives on another worker, as
``torch.distributed.nn.api.remote_module.RemoteModule``.

    rm = RemoteModule("worker1/cpu", nn.Linear, args=(20, 30))   # built on worker1
    out = rm(x)                                 # forward runs there (rpc_sync through its RRef)
    fut = rm.forward_async(x)                   # a Future (awaitable, a torch future too)
    opt = DistributedOptimizer(torch.optim.SGD, rm.remote_parameters(), lr=0.05)

The local object holds only an RRef to the module (``module_rref``) and where it lives; calls
made inside a distributed autograd context are recorded like any other RPC, so a model mixing
local layers and RemoteModules trains with ``rpcdist.autograd`` and ``DistributedOptimizer``.

What differs from torch's (all CPU-only or TorchScript matters, or torch's own oddities):

- ``remote_device`` must name a worker and a CPU device; a CUDA (or any non-CPU) device is
  refused at construction. TorchScript RemoteModules (``_module_interface_cls``) are refused.
- Calls go to the owner of ``module_rref``; ``remote_device`` only has to name a worker.
- ``train(mode)``/``eval()`` honour ``mode``, keep ``training`` of the local object in step and
  return the RemoteModule itself (torch's return a copy of the remote module and ignore ``mode``).
- A RemoteModule received over RPC or made by ``init_from_module_rref`` is a complete
  ``nn.Module`` (``rm(x)`` works, not only ``rm.forward(x)``); ``repr()`` describes it.
  As with torch, a received one's ``__dict__`` holds just the pickled attributes plus its
  ``forward_async`` and ``forward`` methods (``nn.Module``'s empty internals are read-only
  class defaults; its methods hold it weakly, so dropping it frees its RRef at once).
- A ``module_cls`` that is a class but not an ``nn.Module`` subclass is refused at
  construction; other failures of building the module (a callable returning something else,
  a constructor raising) are raised, with the remote traceback, by the first call that needs
  the module (``forward``, ``remote_parameters``, ``train``), as torch does.
"""

from __future__ import annotations

import logging
import types
import weakref
from collections.abc import Callable, Mapping
from typing import Any, NoReturn, TypeVar

import torch
from torch import nn

from rpcdist.agent import current_agent
from rpcdist.agent.extensions import pickling_message
from rpcdist.errors import RpcError
from rpcdist.futures import Future
from rpcdist.rpc import RRef, remote, rpc_sync
from rpcdist.serialization import trust

log = logging.getLogger(__name__)

__all__ = ["RemoteModule"]

_M = TypeVar("_M", bound="_RemoteModule")

# What a RemoteModule carries when it is sent over RPC (anything else set on it stays behind).
_REMOTE_MODULE_PICKLED_ATTRIBUTES = (
    "on",
    "device",
    "is_device_map_set",
    "is_scriptable",
    "module_rref",
    "training",
)

_PICKLE_ERROR = (
    "Cannot pickle RemoteModule in python pickler. RemoteModule can only be pickled when using RPC"
)
_UNPICKLE_ERROR = (
    "Cannot unpickle RemoteModule in python pickler. RemoteModule can only be unpickled when using RPC"
)
_NOT_A_MODULE = "Expect `module_cls(*args, **kwargs)` returns an instance of <class nn.Module>, "
_PARSE_ERROR = (
    "Could not parse remote_device: {}. The valid format is '<workername>/<device>' or "
    "'rank:<rank>/<device>' (without '/<device>' the device is cpu)"
)


# ============================================================================ remote_device
def _parse_remote_device(remote_device: str) -> tuple[str | int, torch.device]:
    """``"<workername>/<device>"``, ``"rank:<rank>/<device>"``, ``"<workername>"`` or
    ``"rank:<rank>"`` -> (worker name or rank, device), with torch's errors for malformed
    strings; a device that is not the CPU is refused (rpcdist is CPU-only)."""
    if isinstance(remote_device, torch.device):
        raise ValueError(
            f"remote_device {str(remote_device)!r} names a device but no worker: RemoteModule needs "
            "'<workername>/<device>' or 'rank:<rank>/<device>'"
        )
    if not isinstance(remote_device, str):
        raise TypeError(f"Invalid type for remote_device: {type(remote_device)}")
    fields = remote_device.split("/")
    if len(fields) == 2:
        worker, device_text = fields
    elif len(fields) == 1:
        if _is_device_string(fields[0]):
            raise ValueError(
                f"remote_device {remote_device!r} names a device but no worker: RemoteModule needs "
                "'<workername>/cpu' or 'rank:<rank>/cpu'"
            )
        worker, device_text = fields[0], "cpu"
    else:
        raise ValueError(_PARSE_ERROR.format(remote_device))
    if not worker:
        raise ValueError(_PARSE_ERROR.format(remote_device))
    device = torch.device(device_text)  # torch's own errors for a malformed device
    on: str | int = worker
    if ":" in worker:
        kind, _, rank = worker.partition(":")
        if kind != "rank" or not rank.isdigit():
            raise ValueError(_PARSE_ERROR.format(remote_device))
        on = int(rank)
    if device.type != "cpu":
        hint = "CUDA devices are not supported" if device.type == "cuda" else f"not {device.type}"
        raise ValueError(
            f"remote_device {remote_device!r}: cannot place a RemoteModule on {str(device)!r}; rpcdist "
            f"is CPU-only ({hint}): use '<workername>/cpu' or 'rank:<rank>/cpu'"
        )
    return on, device


def _is_device_string(text: str) -> bool:
    try:
        torch.device(text)
    except (RuntimeError, ValueError):
        return False
    return True


# ============================================================================ run on the owner
@trust
def _create_module(
    module_cls: Callable[..., nn.Module], args: tuple[Any, ...], kwargs: dict[str, Any], device: str
) -> nn.Module:
    """On the owner (``rpc.remote``): build the module and place it on ``device``."""
    try:
        module = module_cls(*args, **kwargs)
    except Exception as exc:
        if hasattr(exc, "add_note"):  # Python >= 3.11
            exc.add_note(f"(while building the module of a RemoteModule: {_describe(module_cls)}(...))")
        raise
    if not isinstance(module, nn.Module):
        raise ValueError(f"{_NOT_A_MODULE}but it returns an instance of {type(module)}.")
    return module.to(device)


@trust
async def _parameter_rrefs(module_rref: RRef[nn.Module], recurse: bool) -> list[RRef[nn.Parameter]]:
    """On the owner: an RRef to every parameter of the module (once it exists)."""
    module = await module_rref.to_here_async()  # on the owner: the module itself
    return [RRef(param) for param in module.parameters(recurse)]


@trust
async def _set_training(module_rref: RRef[nn.Module], mode: bool) -> None:
    """On the owner: ``module.train(mode)`` (once the module exists)."""
    module = await module_rref.to_here_async()
    module.train(mode)


def _describe(obj: Any) -> str:
    module = getattr(obj, "__module__", None)
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    if name is None:
        return repr(obj)
    return f"{module}.{name}" if module else name


def _raise_not_supported(name: str) -> NoReturn:
    raise ValueError(f"Method ``{name}`` not supported for RemoteModule")


# ============================================================================ the module
class _RemoteModule(nn.Module):
    """The implementation of :class:`RemoteModule` (with torch's extra, private
    ``_module_interface_cls`` argument, which rpcdist does not support)."""

    on: str | int
    device: str
    is_device_map_set: bool
    is_scriptable: bool
    module_rref: RRef[nn.Module]

    def __init__(
        self,
        remote_device: str,
        module_cls: Callable[..., nn.Module],
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
        _module_interface_cls: Any = None,
    ) -> None:
        super().__init__()
        _refuse_torchscript(_module_interface_cls)
        self._prepare_init(remote_device)
        if not callable(module_cls):
            raise TypeError(f"module_cls must be an nn.Module subclass or a callable, got {module_cls!r}")
        if isinstance(module_cls, type) and not issubclass(module_cls, nn.Module):
            raise ValueError(f"{_NOT_A_MODULE}but {module_cls} is not an nn.Module subclass.")
        args = tuple(args) if args is not None else ()
        kwargs = dict(kwargs) if kwargs is not None else {}
        # Asynchronous, as torch's: a failure shows at the first call that needs the module.
        self.module_rref = remote(self.on, _create_module, (module_cls, args, kwargs, self.device))
        log.debug("RemoteModule %s on %s: %r", _describe(module_cls), self.on, self.module_rref)

    def _prepare_init(self, remote_device: str) -> None:
        """Check RPC is up and ``remote_device`` names a worker and a CPU device; set the
        placement attributes (``on``, ``device``) and torch's flags."""
        try:
            agent = current_agent()
        except RpcError as exc:
            raise RpcError("RemoteModule only works in RPC: call rpcdist.rpc.init_rpc(...) first") from exc
        on, device = _parse_remote_device(remote_device)
        agent.worker(on)  # UnknownWorkerError (a ValueError) if no such worker
        self.on = on
        self.device = str(device)
        self.is_device_map_set = False  # rpcdist sends CPU tensors only: never a device map
        self.is_scriptable = False

    @classmethod
    def init_from_module_rref(
        cls: type[_M],
        remote_device: str,
        module_rref: RRef[nn.Module],
        _module_interface_cls: Any = None,
    ) -> _M:
        """A RemoteModule over an existing module: ``module_rref`` (an RRef to an ``nn.Module``,
        e.g. another RemoteModule's ``get_module_rref()``). Both then share that module.

        Calls go to the owner of ``module_rref``; ``remote_device`` is parsed and checked as
        for the constructor (it should name that owner).
        """
        _refuse_torchscript(_module_interface_cls)
        if not isinstance(module_rref, RRef):
            raise TypeError(f"module_rref must be an RRef to an nn.Module, got {type(module_rref).__name__}")
        remote_module = cls.__new__(cls)
        nn.Module.__init__(remote_module)
        remote_module._prepare_init(remote_device)
        remote_module.module_rref = module_rref
        return remote_module

    # -- calls -------------------------------------------------------------------------------
    def forward_async(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """Run the remote module's ``forward(*args, **kwargs)`` on its owner; returns a Future
        of the result (``wait()`` it, ``await`` it, or pass it to ``torch.futures.wait_all``)."""
        return self.module_rref.rpc_async().forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the remote module's ``forward(*args, **kwargs)`` on its owner and wait for the
        result (``rm(x)`` calls this)."""
        return self.forward_async(*args, **kwargs).wait()

    def remote_parameters(self, recurse: bool = True) -> list[RRef[nn.Parameter]]:
        """RRefs to the remote module's parameters (with ``recurse``, its submodules' too), as
        :class:`~rpcdist.optim.DistributedOptimizer` takes them."""
        return rpc_sync(self.module_rref.owner(), _parameter_rrefs, args=(self.module_rref, recurse))

    def get_module_rref(self) -> RRef[nn.Module]:
        """The RRef to the remote module."""
        return self.module_rref

    def train(self: _M, mode: bool = True) -> _M:
        """Set the remote module's training mode (and this object's ``training``); returns self."""
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        rpc_sync(self.module_rref.owner(), _set_training, args=(self.module_rref, mode))
        self.training = mode
        return self

    def eval(self: _M) -> _M:
        """``train(False)``."""
        return self.train(False)

    # -- pickling: over RPC only ----------------------------------------------------------------
    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        if not pickling_message():
            raise RuntimeError(_PICKLE_ERROR)
        state = {name: getattr(self, name) for name in _REMOTE_MODULE_PICKLED_ATTRIBUTES}
        return (_remote_module_receiver, (type(self), state))

    def __getstate__(self) -> NoReturn:
        raise RuntimeError(_PICKLE_ERROR)

    def __setstate__(self, state: Any) -> NoReturn:
        raise RuntimeError(_UNPICKLE_ERROR)

    def __repr__(self) -> str:
        state = self.__dict__
        return (
            f"{type(self).__name__}(on={state.get('on')!r}, device={state.get('device')!r}, "
            f"module_rref={state.get('module_rref')!r})"
        )

    # -- nn.Module methods a RemoteModule does not support (torch's list and messages) --------
    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> NoReturn:
        _raise_not_supported("register_buffer")

    def register_parameter(self, name: str, param: nn.Parameter | None) -> NoReturn:
        _raise_not_supported("register_parameter")

    def add_module(self, name: str, module: nn.Module | None) -> NoReturn:
        _raise_not_supported("add_module")

    def apply(self, fn: Callable[[nn.Module], None]) -> NoReturn:
        _raise_not_supported("apply")

    def cuda(self, device: Any = None) -> NoReturn:
        _raise_not_supported("cuda")

    def ipu(self, device: Any = None) -> NoReturn:
        _raise_not_supported("ipu")

    def xpu(self, device: Any = None) -> NoReturn:
        _raise_not_supported("xpu")

    def cpu(self) -> NoReturn:
        _raise_not_supported("cpu")

    def type(self, dst_type: Any) -> NoReturn:
        _raise_not_supported("type")

    def float(self) -> NoReturn:
        _raise_not_supported("float")

    def double(self) -> NoReturn:
        _raise_not_supported("double")

    def half(self) -> NoReturn:
        _raise_not_supported("half")

    def bfloat16(self) -> NoReturn:
        _raise_not_supported("bfloat16")

    def to(self, *args: Any, **kwargs: Any) -> NoReturn:
        _raise_not_supported("to")

    def register_backward_hook(self, hook: Callable[..., Any]) -> NoReturn:
        _raise_not_supported("register_backward_hook")

    def register_forward_pre_hook(
        self, hook: Callable[..., Any], *, prepend: bool = False, with_kwargs: bool = False
    ) -> NoReturn:
        _raise_not_supported("register_forward_pre_hook")

    def register_forward_hook(
        self,
        hook: Callable[..., Any],
        *,
        prepend: bool = False,
        with_kwargs: bool = False,
        always_call: bool = False,
    ) -> NoReturn:
        _raise_not_supported("register_forward_hook")

    def state_dict(self, *args: Any, **kwargs: Any) -> NoReturn:
        _raise_not_supported("state_dict")

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> NoReturn:
        _raise_not_supported("load_state_dict")

    def parameters(self, recurse: bool = True) -> NoReturn:
        raise ValueError(
            "Method ``parameters`` not supported for RemoteModule. Please use ``remote_parameters`` instead."
        )

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> NoReturn:
        _raise_not_supported("named_parameters")

    def buffers(self, recurse: bool = True) -> NoReturn:
        _raise_not_supported("buffers")

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> NoReturn:
        _raise_not_supported("named_buffers")

    def children(self) -> NoReturn:
        _raise_not_supported("children")

    def named_children(self) -> NoReturn:
        _raise_not_supported("named_children")

    def modules(self) -> NoReturn:
        _raise_not_supported("modules")

    def named_modules(
        self, memo: set[nn.Module] | None = None, prefix: str = "", remove_duplicate: bool = True
    ) -> NoReturn:
        _raise_not_supported("named_modules")

    def requires_grad_(self, requires_grad: bool = True) -> NoReturn:
        _raise_not_supported("requires_grad_")

    def zero_grad(self, set_to_none: bool = True) -> NoReturn:
        _raise_not_supported("zero_grad")

    def share_memory(self) -> NoReturn:
        _raise_not_supported("share_memory")

    def extra_repr(self) -> NoReturn:
        _raise_not_supported("extra_repr")


def _refuse_torchscript(module_interface_cls: Any) -> None:
    if module_interface_cls is not None:
        raise ValueError(
            "TorchScript RemoteModules (_module_interface_cls) are not supported by rpcdist: "
            "leave _module_interface_cls out (forward/forward_async work on any nn.Module)"
        )


@trust
class RemoteModule(_RemoteModule):
    """An ``nn.Module`` created and run on another worker, as
    ``torch.distributed.nn.RemoteModule`` (create it after ``rpcdist.rpc.init_rpc``).

    Args:
        remote_device: where the module lives: ``"<workername>/cpu"``, ``"rank:<rank>/cpu"``,
            or ``"<workername>"`` / ``"rank:<rank>"`` (the device defaults to cpu; rpcdist is
            CPU-only, so any other device is refused).
        module_cls: the ``nn.Module`` subclass to instantiate there, or any callable
            importable by name on that worker that returns an ``nn.Module``.
        args, kwargs: arguments for ``module_cls``.

    ``forward(*args, **kwargs)`` (also ``rm(...)``) runs the module's ``forward`` on its owner
    and waits; ``forward_async`` returns a Future instead. ``remote_parameters()`` gives RRefs
    to its parameters for ``DistributedOptimizer``; ``get_module_rref()`` the RRef to the
    module itself. A RemoteModule can be sent to other workers in RPC arguments and results
    (never with plain ``pickle``); it arrives working and calls the same remote module.
    Methods of ``nn.Module`` that would act on local parameters (``parameters()``, ``to()``,
    ``state_dict()``, hooks, ...) raise ``ValueError``.

    Example::

        rpc.init_rpc("worker0", rank=0, world_size=2)
        rm = RemoteModule("worker1/cpu", nn.Linear, args=(20, 30))
        out = rm.forward_async(torch.randn(128, 20)).wait()
        rpc.shutdown()
    """

    def __init__(
        self,
        remote_device: str,
        module_cls: Callable[..., nn.Module],
        args: tuple[Any, ...] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(remote_device, module_cls, args, kwargs)


# ============================================================================ received over RPC
def _empty_like(value: Any) -> Any:
    """A read-only empty stand-in for one of ``nn.Module``'s internal containers."""
    if isinstance(value, Mapping):
        return types.MappingProxyType({})
    if isinstance(value, (set, frozenset)):
        return frozenset()
    return value


# ``nn.Module.__init__``'s instance state (hooks, parameters, submodules: all empty), as class
# defaults: a received RemoteModule, whose ``__dict__`` holds only what was sent (as torch's),
# still runs ``nn.Module.__call__``. Read-only, so nothing can add to the shared empties.
_MODULE_INTERNALS = {
    name: _empty_like(value) for name, value in vars(nn.Module()).items() if name != "training"
}
for _name, _value in _MODULE_INTERNALS.items():
    setattr(_RemoteModule, _name, _value)
del _name, _value

# Methods a received RemoteModule carries in its ``__dict__``, as torch's installs its generated ones.
_RECEIVED_METHODS = ("forward_async", "forward")


class _ReceivedMethod:
    """``forward_async``/``forward`` of a RemoteModule received over RPC, kept in its
    ``__dict__``. It refers to the module weakly: no reference cycle, so the module (and its
    RRef) is freed as soon as it is dropped."""

    def __init__(self, module: _RemoteModule, name: str) -> None:
        self._module = weakref.ref(module)
        self._function: Callable[..., Any] = getattr(type(module), name)
        self.__name__ = name
        self.__doc__ = self._function.__doc__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module()
        if module is None:
            raise RuntimeError(f"the RemoteModule of this {self.__name__} method was freed")
        return self._function(module, *args, **kwargs)

    def __reduce__(self) -> tuple[Any, ...]:
        """Sent over RPC as the same method of the (sent) module, as a bound method is."""
        module = self._module()
        if module is None:
            raise RuntimeError(f"the RemoteModule of this {self.__name__} method was freed")
        return (getattr, (module, self.__name__))

    def __repr__(self) -> str:
        return f"<method {self.__name__} of {self._module()!r}>"


@trust
def _remote_module_receiver(cls: type[_RemoteModule], state: dict[str, Any]) -> _RemoteModule:
    """Rebuild a RemoteModule received over RPC (its ``module_rref`` is already rebuilt): the
    sent attributes, in their order, then its methods, as torch's receiver."""
    remote_module = cls.__new__(cls)
    remote_module.__dict__.update(state)
    for name in _RECEIVED_METHODS:
        remote_module.__dict__[name] = _ReceivedMethod(remote_module, name)
    return remote_module

"""The reviewed list of torch.distributed public names rpcdist does not mirror, each with why.

Used by ``test_torch_surface``. Keys are torch's full names (``torch.distributed.X``,
``torch.distributed.rpc.X``, ``torch.distributed.nn.RemoteModule.method``...). Every reason
starts with one of :data:`CATEGORIES` and a colon. A name belongs here only if a torch user
cannot reasonably call it in a CPU program (it needs NCCL/MPI/UCC/XCCL or a GPU, it is the
DeviceMesh/DTensor world, TorchScript, or it is torch's own plumbing): anything else is
implemented, or listed in :data:`PENDING` while another piece of work brings it.

The test fails when an entry names something torch no longer has, or something rpcdist now
mirrors, so the list stays honest.
"""

from __future__ import annotations

CATEGORIES = (
    "NCCL/MPI/UCC/XCCL-only",
    "DeviceMesh/DTensor/tensor-parallel",
    "TorchScript",
    "CUDA/device-only",
    "torch-internal implementation detail",
)

_OPTIONS = (
    "torch-internal implementation detail: an options struct of the C++ ProcessGroup/Backend "
    "method API (pg.allreduce(tensors, opts)), written by backend authors; programs call the c10d "
    "functions, and rpcdist's ProcessGroup has no such methods"
)

EXCLUDED: dict[str, str] = {
    # -- torch.distributed ------------------------------------------------------------------
    "torch.distributed.AllToAllOptions": _OPTIONS,
    "torch.distributed.AllreduceCoalescedOptions": _OPTIONS,
    "torch.distributed.AllreduceOptions": _OPTIONS,
    "torch.distributed.BarrierOptions": _OPTIONS,
    "torch.distributed.BroadcastOptions": _OPTIONS,
    "torch.distributed.GatherOptions": _OPTIONS,
    "torch.distributed.ReduceOptions": _OPTIONS,
    "torch.distributed.ReduceScatterOptions": _OPTIONS,
    "torch.distributed.ScatterOptions": _OPTIONS,
    "torch.distributed.BuiltinCommHookType": (
        "torch-internal implementation detail: the enum of DDP's C++ built-in comm hooks, only taken "
        "by DistributedDataParallel._register_builtin_comm_hook (private)"
    ),
    "torch.distributed.Reducer": (
        "torch-internal implementation detail: DistributedDataParallel's C++ gradient reducer, "
        "constructed by DDP itself"
    ),
    "torch.distributed.Logger": (
        "torch-internal implementation detail: DistributedDataParallel's C++ usage logger, "
        "constructed by DDP itself"
    ),
    "torch.distributed.log": (
        "torch-internal implementation detail: torch.distributed's module logger (rpcdist logs "
        "under the 'rpcdist' logger)"
    ),
    "torch.distributed.timedelta": (
        "torch-internal implementation detail: datetime.timedelta, leaked into the namespace by "
        "an import in torch/distributed/__init__.py"
    ),
    "torch.distributed.DeviceMesh": "DeviceMesh/DTensor/tensor-parallel: the device mesh of DTensor/FSDP2/TP",
    "torch.distributed.init_device_mesh": "DeviceMesh/DTensor/tensor-parallel: builds a DeviceMesh",
    "torch.distributed.split_group": (
        "CUDA/device-only: needs a device bound to the default group (init_process_group(device_id=...)) "
        "and a backend that splits communicators (NCCL, XCCL); torch raises for gloo on CPU"
    ),
    "torch.distributed.shrink_group": (
        "NCCL/MPI/UCC/XCCL-only: only backends with supports_shrinking (NCCL) can shrink; torch's "
        "gloo raises TypeError"
    ),
    # -- torch.distributed.rpc ------------------------------------------------------------------
    "torch.distributed.rpc.register_backend": (
        "torch-internal implementation detail: registers a C++ RpcAgent implementation for "
        "init_rpc; rpcdist has exactly one agent, its own (backend_registered and "
        "construct_rpc_backend_options are mirrored)"
    ),
    "torch.distributed.rpc.init_backend": (
        "torch-internal implementation detail: starts a registered C++ RpcAgent (called by init_rpc)"
    ),
    "torch.distributed.rpc.AllGatherStates": (
        "torch-internal implementation detail: bookkeeping class of torch's _all_gather helper"
    ),
    "torch.distributed.rpc.BackendValue": (
        "torch-internal implementation detail: the namedtuple behind BackendType's values "
        "(handlers of a registered C++ RpcAgent)"
    ),
    "torch.distributed.rpc.method_factory": (
        "torch-internal implementation detail: helper that builds BackendType's enum methods"
    ),
    "torch.distributed.rpc.new_method": (
        "torch-internal implementation detail: helper that builds BackendType's enum methods"
    ),
}

# Names a torch user can call on CPU that rpcdist does not have yet, with the work that is to
# bring them. They are reported (xfail, strict: once one is there, its test fails until it is
# taken off this list), not excluded.
PENDING: dict[str, str] = {
    "torch.distributed.ProcessGroupGloo": (
        "torch's gloo backend class, constructed directly over a torch Store; rpcdist's 'gloo' is "
        "its own transport. For the torch-backend work to decide: re-export torch's class (it "
        "takes rpcdist.TCPStore(...).torch_store) or give rpcdist's ProcessGroup that constructor"
    ),
}

"""tine: fork running computers from Python.

    import tine
    t = tine.Tine()                       # $TINE_HOME/tined.sock; Tine(url=..., token=...) for TCP
    with t.run(image="minimal", mem="256M") as vm:
        kids = vm.fork(3)                 # one Child per child: .vm or .error
        print([k.vm.exec("hostname").stdout for k in kids])

`tine.aio` has the same API for asyncio (`AsyncTine`, awaited)."""

from . import errors, models
from ._core import Child, ExecEvent
from .aio import AsyncBranch, AsyncCheckpoint, AsyncChildren, AsyncFiles, AsyncProcess, AsyncTine, AsyncVm
from .client import Branch, Checkpoint, Children, Files, Process, Tine, Vm
from .errors import Busy, Conflict, Failed, Forbidden, InvalidInput, NotFound, TineError, Unauthorized, Unavailable

__all__ = [
    "Tine", "Vm", "Files", "Process", "Checkpoint", "Branch", "Children", "Child", "ExecEvent",
    "AsyncTine", "AsyncVm", "AsyncFiles", "AsyncProcess", "AsyncCheckpoint", "AsyncBranch", "AsyncChildren",
    "TineError", "InvalidInput", "NotFound", "Conflict", "Busy", "Failed",
    "Unauthorized", "Forbidden", "Unavailable", "errors", "models",
]
__version__ = "0.1.0"

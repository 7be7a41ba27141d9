"""The API's answers as dataclasses, field for field as in tined's OpenAPI
document (`docs/api/openapi.json`, served at `/v1/openapi.json`);
tests/test_models.py checks that each class has exactly its schema's
properties. Unknown fields a newer tined adds are ignored."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Type, TypeVar

T = TypeVar("T")


def parse(cls: Type[T], data: Any) -> T:
    """`cls` from a JSON object: known fields only, nested models parsed."""
    if not isinstance(data, dict):
        raise TypeError(f"{cls.__name__}: expected a JSON object, got {type(data).__name__}")
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
    kw = {k: data[k] for k in names if k in data}
    for k, inner in _NESTED.get(cls.__name__, ()):
        if kw.get(k) is not None:
            v = kw[k]
            kw[k] = [parse(inner, x) for x in v] if isinstance(v, list) else parse(inner, v)
    return cls(**kw)


_FIELDS: Dict[type, tuple] = {}


@dataclass
class ChildResult:
    """One child of a fork: its name and vm, or why it failed."""

    name: str
    ok: bool
    pid: Optional[int] = None
    error: Optional[str] = None


@dataclass
class RunReport:
    name: str
    pid: int
    ready_ms: float
    problems: List[str]
    wake: Optional[Dict[str, Any]] = None


@dataclass
class VmInfo:
    name: str
    state: str
    image: str
    mem_mib: int
    vcpus: int
    agent: bool = False
    checkpoints: List[str] = field(default_factory=list)
    exit: Optional[str] = None
    parent: Optional[str] = None
    pid: Optional[int] = None
    rss_mib: Optional[int] = None
    uptime_s: Optional[int] = None
    address: Optional[str] = None


@dataclass
class ForkReport:
    name: str
    names: List[str]
    children: List[int]
    results: List[ChildResult]
    child_running_ms: List[float]
    quiesce_ms: float
    forked_ms: float
    wake_ms: float
    total_ms: float
    wake: List[Any]
    problems: List[str]
    all_children_ms: Optional[float] = None
    continuation_pid: Optional[int] = None
    pause_ms: Optional[float] = None
    quiesce: Optional[Dict[str, Any]] = None
    # The host each child runs on, when a fleet spread them.
    hosts: List[str] = field(default_factory=list)


@dataclass
class ExecResult:
    exit_code: int
    timed_out: bool
    stdout: str
    stderr: str
    stdout_b64: str
    stderr_b64: str
    signal: Optional[int] = None

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@dataclass
class MomentReport:
    name: str
    pid: int
    total_ms: float
    problems: List[str]
    continuation_pid: Optional[int] = None
    dir: Optional[str] = None
    memory_bytes: Optional[int] = None
    pause_ms: Optional[float] = None
    snapshot_ms: Optional[float] = None
    tag: Optional[str] = None
    template_pid: Optional[int] = None


@dataclass
class CheckpointRecord:
    tag: str
    pid: int
    pid_start: int
    created_ms: int
    branch: str = ""
    layers: List[Any] = field(default_factory=list)
    lineage: List[Any] = field(default_factory=list)
    moment: str = ""


@dataclass
class Removed:
    name: str
    what: str
    processes: int
    layers_freed: int
    problems: List[str]


@dataclass
class StopReport:
    name: str
    stopped: Any


@dataclass
class Node:
    """One node of the tree: a vm, a sleeping branch, a snapshot or a checkpoint."""

    id: str
    kind: str
    name: str
    state: str
    created_ms: int
    mem_mib: Optional[int] = None
    own_bytes: Optional[int] = None
    parent: Optional[str] = None
    pid: Optional[int] = None


@dataclass
class Lineage:
    nodes: List[Node]
    store: Optional[Dict[str, Any]] = None


@dataclass
class LineageEffects:
    vm: str
    branch: str
    tree: str
    lineage: List[Any]
    effects: List[Dict[str, Any]]


@dataclass
class Entry:
    """A path in the guest."""

    name: str
    path: str
    kind: str
    size: int
    mode: int
    mtime_ms: int
    owner: str
    group: str
    target: Optional[str] = None

    @property
    def is_dir(self) -> bool:
        return self.kind == "dir"


@dataclass
class ProcessInfo:
    """A command the guest's agent runs (`vm.processes()`)."""

    pid: int
    argv: List[str]
    keep: bool
    stdin: bool
    tag: Optional[str] = None
    env: List[Any] = field(default_factory=list)
    cwd: Optional[str] = None
    user: Optional[str] = None


@dataclass
class Signalled:
    delivered: bool


@dataclass
class KeyInfo:
    """An API key as tined lists it (never the key itself)."""

    id: str
    name: str
    created_ms: int
    prefix: str


@dataclass
class NewKey(KeyInfo):
    """A key just made: `key` is shown this once."""

    key: str


@dataclass
class Operation:
    id: str
    kind: str
    target: str
    state: str
    created_ms: int
    progress: Dict[str, Any]
    error: Optional[Dict[str, Any]] = None
    finished_ms: Optional[int] = None
    result: Optional[Dict[str, Any]] = None
    status: Optional[int] = None


@dataclass
class Health:
    ok: bool
    version: str
    build: str
    config: str
    pid: int
    home: str
    uptime_s: int
    operations_running: int
    engine_calls_running: Optional[int] = None


# Model name → its fields that hold models.
_NESTED: Dict[str, tuple] = {
    "ForkReport": (("results", ChildResult),),
    "Lineage": (("nodes", Node),),
}

# Model → its schema in the OpenAPI document (tests/test_models.py).
SCHEMAS: Dict[type, str] = {
    c: c.__name__
    for c in (
        ChildResult,
        RunReport,
        VmInfo,
        ForkReport,
        ExecResult,
        MomentReport,
        CheckpointRecord,
        Removed,
        StopReport,
        Node,
        Lineage,
        LineageEffects,
        Entry,
        ProcessInfo,
        Signalled,
        KeyInfo,
        NewKey,
        Operation,
        Health,
    )
}

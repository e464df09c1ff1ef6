"""A compiled program's HLO text read per device: its collectives (kind, calls, bytes, the traffic over the links),
the trip counts of its loops, and the work the iterations of a loop after its first add to XLA's cost analysis
(which takes a loop's body once), for `--compile-for`'s reports (`jaxport.runtime.compile_for`)."""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter, defaultdict

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}
DTYPE_BYTES.update({"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16})
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_OP = re.compile(r"\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+(?:fn)?)?)\[([\d,]*)\]")
_CALLED = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation|branch_computations|"
    r"called_computations|async_execution_thread)=\{?([^}]*?)\}?(?:,\s|$)"
)
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


def _arrays_bytes(text: str) -> list[int]:
    return [
        DTYPE_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
        for dtype, dims in _ARRAY.findall(text)
        if dtype in DTYPE_BYTES
    ]


def _group_size(line: str, devices: int) -> int:
    """Devices in each of a collective's groups, from any of the forms XLA prints them in."""
    found = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if found:
        return len(found.group(1).split(","))
    found = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", line)  # iota: [groups, size]<=[devices]
    if found:
        return int(found.group(2))
    found = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)  # mesh['a'=4,'b'=2] {'a'}
    if found:
        sizes = {axis: int(n) for axis, n in re.findall(r"'([^']+)'=(\d+)", found.group(1))}
        return math.prod(sizes.get(axis, 1) for axis in re.findall(r"'([^']+)'", found.group(2)))
    return devices


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$")
# instructions that move no data of their own (views, bookkeeping, the control flow whose bodies are counted apart)
NO_TRAFFIC = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call"}
NO_TRAFFIC |= {"after-all", "partition-id", "replica-id", "opt-barrier", "copy-done", "all-reduce-done"}
NO_TRAFFIC |= {"all-gather-done", "collective-permute-done", "async-done", "async-update"}


@dataclasses.dataclass
class Collective:
    kind: str
    count: int
    bytes: int  # per device, summed over the calls
    traffic: float  # bytes each device sends over its links (ring algorithms), summed


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str  # the result's shape text, e.g. "bf16[8,128]{1,0}" or a tuple
    opcode: str
    operands: list[str]
    line: str


@dataclasses.dataclass
class HloSummary:
    """What a compiled module does per device, loops counted: its collectives, the trip counts of its loops, the
    matrix-product FLOPs of every loop iteration after the first (XLA's cost analysis takes a loop's body once), and
    how much more HBM traffic those iterations add, as a share of the traffic of the program taken once (each
    top-level instruction reading its operands and writing its result: a rough model, used for the share only)."""

    collectives: list[Collective]
    loops: list[int | None]
    extra_flops: float
    extra_traffic_share: float


def parse_module(text: str) -> tuple[dict[str, list[Instruction]], list[str], str | None]:
    """(computation name -> its instructions, the names in text order, the entry's name) of HLO text."""
    computations, order, entry, current = {}, [], None, None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            head = line.split("(")[0].split()
            current = head[-1].lstrip("%") if head else None
            computations[current] = []
            order.append(current)
            if line.startswith("ENTRY"):
                entry = current
            continue
        found = _INSTRUCTION.match(line) if current is not None else None
        if found:
            name, shape, opcode, rest = found.groups()
            operands = re.findall(r"%([\w.\-]+)", rest.split(")", 1)[0])
            computations[current].append(Instruction(name, shape, opcode, operands, line))
    return computations, order, entry


def _trip_count(line: str, computations: dict[str, list[Instruction]]) -> int | None:
    """A while loop's trip count: XLA's own where it states one, else read from a condition that compares a
    counter (from 0, as jax's loops count) with a constant."""
    trip = _TRIP.search(line)
    if trip:
        return int(trip.group(1))
    condition = re.search(r"condition=%?([\w.\-]+)", line)
    body = computations.get(condition.group(1), []) if condition else []
    constants = [
        int(found.group(1))
        for i in body
        if i.opcode == "constant" and i.shape.startswith("s32[]") and (found := re.search(r"constant\((\d+)\)", i.line))
    ]
    compares = [i for i in body if i.opcode == "compare" and "direction=LT" in i.line]
    return constants[0] if len(constants) == 1 and len(compares) == 1 else None


def _dims(shape: str) -> list[int]:
    found = _ARRAY.search(shape)
    return [int(d) for d in found.group(2).split(",") if d] if found else []


def _product_flops(instruction: Instruction, shapes: dict[str, str]) -> float:
    """2 x output elements x contracted size of a dot, or of a convolution (XLA:TPU writes products as 1x1 ones)."""
    out = math.prod(_dims(instruction.shape))
    if instruction.opcode == "dot":
        lhs = _dims(shapes.get(instruction.operands[0], ""))
        found = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instruction.line)
        contracted = [int(d) for d in found.group(1).split(",") if d] if found else []
        return 2.0 * out * math.prod(lhs[d] for d in contracted if d < len(lhs))
    labels = re.search(r"dim_labels=([^_]+)_([^-]+)->", instruction.line)
    if not labels or len(instruction.operands) < 2:
        return 0.0
    lhs, rhs = (_dims(shapes.get(o, "")) for o in instruction.operands[:2])
    lhs_labels, rhs_labels = labels.groups()
    if len(lhs_labels) != len(lhs) or len(rhs_labels) != len(rhs):
        return 0.0
    window = [rhs[i] for i, label in enumerate(rhs_labels) if label.isdigit()]
    dilated = re.search(r"lhs_dilate=([\dx]+)", instruction.line)  # batch dims written as dilated windows
    if dilated:
        window = [-(-w // int(d)) for w, d in zip(window, dilated.group(1).split("x"))]
    groups = re.search(r"feature_group_count=(\d+)", instruction.line)
    taps = math.prod(window) / (int(groups.group(1)) if groups else 1)
    return 2.0 * out * lhs[lhs_labels.index("f")] * taps


def read_hlo(text: str, devices: int) -> HloSummary:
    """Read a compiled (partitioned, per-device) HLO module: each computation's calls weighted by the trip counts of
    the loops around it (`weight`) and by one per loop (`once`, as XLA's cost analysis counts)."""
    computations, order, entry = parse_module(text)
    weight, once, control = defaultdict(int), defaultdict(int), {entry}
    weight[entry] = once[entry] = 1
    loops = []
    for name in reversed(order):  # callers follow their callees in HLO text: walk from the entry down
        for instruction in computations[name]:
            trip = _trip_count(instruction.line, computations) if instruction.opcode == "while" else None
            if instruction.opcode == "while":
                loops.append(trip)
            for key, called in _CALLED.findall(instruction.line):
                times = trip if (key == "body" and trip) else 1
                for callee in re.findall(r"%?([\w.\-]+)", called):
                    weight[callee] += weight[name] * times
                    once[callee] += once[name]
                    if instruction.opcode in ("while", "conditional", "call"):
                        control.add(callee)
    calls, sizes, traffic = Counter(), Counter(), Counter()
    extra_flops = extra_traffic = traffic_once = 0.0
    for name, instructions in computations.items():
        if weight[name] == 0:
            continue
        shapes = {i.name: i.shape for i in instructions}
        repeats = weight[name] - once[name]
        for instruction in instructions:
            if repeats and instruction.opcode in ("dot", "convolution"):
                extra_flops += repeats * _product_flops(instruction, shapes)
            if name in control and instruction.opcode not in NO_TRAFFIC:
                moved = sum(_arrays_bytes(instruction.shape)) + sum(
                    sum(_arrays_bytes(shapes.get(o, ""))) for o in instruction.operands
                )
                traffic_once += once[name] * moved
                extra_traffic += repeats * moved
            found = _OP.search(" " + instruction.opcode + "(")
            if not found:
                continue
            kind, start = found.group(1), found.group(2)
            arrays = _arrays_bytes(instruction.shape)
            if not arrays:
                continue
            # an async start returns (operands, results, ...): count the results' half
            size = sum(arrays[len(arrays) // 2 :]) if start and kind != "all-reduce" else sum(arrays)
            n = _group_size(instruction.line, devices)
            moved = {
                "all-reduce": 2 * (n - 1) / n * size,
                "all-gather": (n - 1) / n * size,
                "reduce-scatter": (n - 1) * size,
                "all-to-all": (n - 1) / n * size,
                "collective-permute": size,
            }[kind]
            calls[kind] += weight[name]
            sizes[kind] += weight[name] * size
            traffic[kind] += weight[name] * moved
    collectives = [Collective(kind, calls[kind], sizes[kind], traffic[kind]) for kind in COLLECTIVES if calls[kind]]
    return HloSummary(collectives, loops, extra_flops, extra_traffic / traffic_once if traffic_once else 0.0)

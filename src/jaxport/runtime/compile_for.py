"""`--compile-for SLICE`: a command's own programs compiled on this machine for a Cloud TPU slice it does not have,
and what they need there.

libtpu compiles for any TPU topology without a TPU (`jax.experimental.topologies`): the command builds its
step as it would run it (the same functions, mesh and shardings) over the slice's compile-only devices, with
abstract arrays in place of weights and data, and XLA's TPU compiler returns the real program. The report gives
per device: the memory XLA plans (arguments, outputs, temporaries, generated code) against the chip's HBM, the
FLOPs and HBM bytes of XLA's cost analysis, the collectives of the partitioned program (kind, count, bytes), and a
roofline estimate of the step time from the chip's datasheet figures (`jaxport.runtime.topologies`). Where the
program does not fit, one line names a mesh (or batch) that does, compiled to check. A command that keeps several
programs (a server's start-up set) ends with what they need held at once (`held_together`).

The programs are jitted under the runtime of the slice's devices (`jaxport.runtime.for_devices`), so the models
choose their layouts and attention for the target, not for this CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import math
import os
import re
import sys
import tempfile
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable

import jax
import numpy as np
from jax.sharding import Mesh

from jaxport.errors import JaxportError
from jaxport.runtime import policy
from jaxport.runtime.compile_seconds import with_compile_seconds
from jaxport.runtime.topologies import GiB, Slice, parse_slice

INSTALL = "pip install 'jaxport[tpu]'"
MAX_REFITS = 4  # other meshes compiled to find one that fits


@dataclasses.dataclass
class Program:
    """One program a command compiles: the jitted function, abstract arguments (`jax.ShapeDtypeStruct` with
    shardings; static arguments as they are), the mesh, and the flag that sets that mesh for the user."""

    title: str
    jitted: Callable
    args: tuple
    mesh: Mesh
    mesh_flag: str
    notes: list[str] = dataclasses.field(default_factory=list)  # what differs from the command's own program


@dataclasses.dataclass
class Collective:
    kind: str
    count: int
    bytes: int  # per device, summed over the calls
    traffic: float  # bytes each device sends over its links (ring algorithms), summed


@dataclasses.dataclass
class Report:
    slice: Slice
    program: Program
    libtpu: str
    memory: dict[str, int] | None = None  # arguments, outputs, aliased, temporaries, code (bytes per device)
    needed: int = 0  # bytes per device
    flops: float | None = None  # per device, XLA's count (each loop body once)
    hbm_bytes: float | None = None  # bytes accessed per device, XLA's count (each loop body once)
    hlo: HloSummary | None = None
    refit: str | None = None  # what fits instead, when this does not
    refused: str | None = None  # XLA:TPU's words, when it refused to compile the program for want of HBM
    tried: list[str] = dataclasses.field(default_factory=list)  # the alternatives compiled, none fitting
    attention: str = ""  # the runtime's attention choice for the program's devices
    compile_seconds: float = 0.0  # JAX's tracing, lowering and compiling of the program (`compile_seconds`)

    @property
    def hbm(self) -> float:
        return self.slice.chip.per_device(self.slice.chip.hbm_bytes)

    @property
    def fits(self) -> bool:
        return self.refused is None and self.needed <= self.hbm

    @property
    def collectives(self) -> list[Collective]:
        return self.hlo.collectives if self.hlo else []

    @property
    def total_flops(self) -> float:
        """XLA's count with the matrix products of every loop iteration after the first added."""
        return (self.flops or 0.0) + (self.hlo.extra_flops if self.hlo else 0.0)

    @property
    def total_hbm_bytes(self) -> float:
        """XLA's count scaled up by the traffic the further loop iterations add (`HloSummary`)."""
        return (self.hbm_bytes or 0.0) * (1.0 + (self.hlo.extra_traffic_share if self.hlo else 0.0))

    def roofline(self) -> dict[str, float]:
        """Seconds per call for compute, HBM traffic and inter-chip traffic at the datasheet rates (each a lower
        bound; the step takes at least the largest)."""
        chip = self.slice.chip
        times = {}
        if self.flops:
            times["compute"] = self.total_flops / chip.per_device(chip.peak_flops)
        if self.hbm_bytes:
            times["HBM"] = self.total_hbm_bytes / chip.per_device(chip.hbm_bandwidth)
        traffic = sum(c.traffic for c in self.collectives)
        if traffic:
            times["ICI"] = traffic / chip.per_device(chip.ici_bandwidth)
        return times


def take_flag(argv: list[str]) -> tuple[str | None, list[str]]:
    """`(SLICE, the other arguments)` of a command line that may hold `--compile-for SLICE` (or `--compile-for=`,
    nanoGPT's `--compile_for=`)."""
    rest, value = [], None
    arguments = iter(argv)
    for arg in arguments:
        flag, sep, text = arg.partition("=")
        if flag in ("--compile-for", "--compile_for"):
            value = text if sep else next(arguments, None)
            if not value:
                raise JaxportError("--compile-for needs a Cloud TPU slice name, e.g. --compile-for v4-8")
        else:
            rest.append(arg)
    return value, rest


def libtpu_version() -> str | None:
    if importlib.util.find_spec("libtpu") is None:
        return None
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


@contextlib.contextmanager
def quiet_stderr():
    """libtpu writes its start-up complaints on a machine without a TPU (no worker hostnames, no accelerator
    type) straight to file descriptor 2: kept out of the report."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def topology_devices(tpu: Slice) -> list:
    """The slice's compile-only devices, from libtpu; one error saying what to install or what libtpu refused."""
    version = libtpu_version()
    if version is None:
        raise JaxportError(
            f"--compile-for {tpu.name} compiles with Google's TPU compiler, libtpu, which is not installed: {INSTALL}"
        )
    from jax.experimental import topologies

    # compiling uses no TPU: any number of processes (other commands, test workers) may load libtpu at once
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        with quiet_stderr():
            topology = topologies.get_topology_desc(
                platform="tpu",
                topology_name=tpu.topology,
                chip_config_name=tpu.chip.chip_config,
                chips_per_host_bounds=tpu.chips_per_host,
                num_slices=1,
                wrap=tpu.wrap,
            )
    except Exception as err:  # libtpu's own errors (JaxRuntimeError, RuntimeError) name what it refused
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise JaxportError(
            f"--compile-for {tpu.name}: libtpu {version} (jax {jax.__version__}) refuses the {tpu.chip.name} "
            f"topology {tpu.topology}: {reason}"
        ) from None
    devices = list(topology.devices)
    if len(devices) != tpu.devices:
        raise JaxportError(
            f"--compile-for {tpu.name}: libtpu {version} gives {len(devices)} devices for {tpu.topology}, where "
            f"a {tpu.name} has {tpu.devices}"
        )
    return devices


def abstract(tree, shardings):
    """`tree`'s arrays as `jax.ShapeDtypeStruct`s placed by `shardings` (a tree of the same structure, or one
    sharding for every array): a step's arguments without their values."""
    if isinstance(shardings, jax.sharding.Sharding):
        shardings = jax.tree.map(lambda _: shardings, tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s), tree, shardings)


# -- reading the compiled program


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


_OOM = (  # XLA:TPU's two ways of saying a program needs more than the HBM: (needed, size, unit) groups
    re.compile(r"Used ([\d.]+)([KMGT]?) of ([\d.]+)([KMGT]?) hbm", re.IGNORECASE),
    re.compile(r"required for [^(]*\(([\d.]+)([KMGT]?)\) exceeds available HBM \(([\d.]+)([KMGT]?)\)"),
)
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def analyse(tpu: Slice, program: Program) -> Report:
    """Compile `program` for the slice and read what it needs. A program past the HBM is reported, not raised:
    XLA's TPU compiler refuses it, saying how much it needed."""
    report = Report(tpu, program, libtpu_version() or "?", attention=policy.for_devices(program.mesh).attention)
    lowered, report.compile_seconds = with_compile_seconds(lambda: program.jitted.lower(*program.args))
    try:
        compiled, seconds = with_compile_seconds(lowered.compile)
        report.compile_seconds += seconds
    except Exception as err:
        found = next((m for pattern in _OOM if (m := pattern.search(str(err)))), None)
        if found is None:
            raise
        report.needed = int(float(found.group(1)) * _UNITS[found.group(2).upper()])
        report.refused = str(err).strip().splitlines()[0]
        return report
    stats = compiled.memory_analysis()
    report.memory = {
        "arguments": stats.argument_size_in_bytes,
        "outputs": stats.output_size_in_bytes,
        "aliased": stats.alias_size_in_bytes,
        "temporaries": stats.temp_size_in_bytes,
        "code": stats.generated_code_size_in_bytes,
    }
    m = report.memory
    report.needed = m["arguments"] + m["outputs"] - m["aliased"] + m["temporaries"] + m["code"]
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}
    report.flops = cost.get("flops") or None
    report.hbm_bytes = cost.get("bytes accessed") or None
    report.hlo = read_hlo(compiled.as_text(), tpu.devices)
    return report


# -- the report


def size(n: float) -> str:
    for unit, scale in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def count(n: float, unit: str) -> str:
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {prefix}{unit}"
    return f"{n:.3g} {unit}"


def seconds(t: float) -> str:
    return f"{t * 1e3:.3g} ms" if t < 1 else f"{t:.3g} s"


def attention_line(attention: str, chip: str) -> str:
    """What the report says of the program's attention (`Runtime.attention`) on `chip`."""
    if attention == "splash":
        return (
            "splash: Pallas's splash-attention kernel on each device's rows (a Mosaic kernel, whose work XLA's "
            "FLOPs and bytes leave out); XLA's ops where it does not apply (dropout, masks other than key padding)"
        )
    if chip not in policy.MOSAIC_CHIPS:
        return f"{attention}: XLA's ops (a {chip} runs no Pallas Mosaic kernels)"
    return f"{attention} (--runtime attention={attention})"


def format_report(report: Report) -> str:
    tpu, chip, program = report.slice, report.slice.chip, report.program
    mesh = " ".join(f"{axis}={n}" for axis, n in program.mesh.shape.items())
    lines = [
        f"{program.title}, compiled for a TPU {tpu.name} on this CPU (libtpu {report.libtpu}, jax {jax.__version__})",
        f"  slice        {tpu.chips} {chip.name} chips ({tpu.topology}), {tpu.devices} devices; mesh {mesh} "
        f"({program.mesh_flag})",
    ]
    lines += [f"  note         {note}" for note in program.notes]
    if report.attention:
        lines.append(f"  attention    {attention_line(report.attention, chip.name)}")
    if report.fits:
        verdict = f"fits ({report.needed / report.hbm:.0%})"
    else:
        verdict = f"DOES NOT FIT with {program.mesh_flag}; " + (
            f"use {report.refit}"
            if report.refit
            else f"nor with {', '.join(report.tried)}"
            if report.tried
            else "no alternative to try: a larger slice"
        )
    if report.memory:
        m = report.memory
        lines.append(
            f"  memory       per device: arguments {size(m['arguments'])}, outputs {size(m['outputs'])} "
            f"({size(m['aliased'])} of them in the arguments' place), temporaries {size(m['temporaries'])}, "
            f"code {size(m['code'])}"
        )
    if report.refused:
        lines.append(f"  memory       XLA's TPU compiler refuses it: {report.refused}")
    lines.append(
        f"               needs {'at least ' if report.refused else ''}{size(report.needed)} per device of a "
        f"{chip.name} device's {size(report.hbm)} HBM: {verdict}"
    )
    if report.memory:
        lines.append(f"  compiling    {report.compile_seconds:.1f} s on this CPU (tracing, lowering, XLA:TPU)")
    if report.flops:
        known = [n for n in report.hlo.loops if n is not None and n != 1]
        unknown = sum(n is None for n in report.hlo.loops)
        text = f"{count(report.total_flops, 'FLOP')} per device per call"
        if known or unknown:
            text += f" (XLA's count, {count(report.flops, 'FLOP')}, takes each loop's body once"
            if known:
                lengths = ", ".join(map(str, known))
                text += f"; the matrix products of the other iterations of its loop(s) of {lengths} iterations added"
            text += f"; {unknown} loop(s) of unknown length counted once: a bound from below)" if unknown else ")"
        else:
            text += " (XLA's count)"
        devices = program.mesh.devices.size
        lines.append(
            f"  FLOPs        {text}; {count(report.total_flops * devices, 'FLOP')} over the mesh's {devices} devices"
        )
    if report.memory is not None:
        lines.append(
            "  collectives  "
            + (
                "; ".join(
                    f"{c.kind} x{c.count}: {size(c.bytes)} ({size(c.traffic)} over the links)"
                    for c in report.collectives
                )
                or "none"
            )
            + " per device per call"
        )
    times = report.roofline()
    if times:
        rates = {
            "compute": f"{count(chip.per_device(chip.peak_flops), 'FLOP/s')} bf16 peak",
            "HBM": f"{size(report.total_hbm_bytes)} at {count(chip.per_device(chip.hbm_bandwidth), 'B/s')}",
            "ICI": f"{size(sum(c.traffic for c in report.collectives))} at "
            f"{count(chip.per_device(chip.ici_bandwidth), 'B/s')}",
        }
        bound = max(times, key=times.get)
        lines.append(
            "  roofline     "
            + ", ".join(f"{name} {seconds(t)} ({rates[name]})" for name, t in times.items())
            + f" per device: at least {seconds(times[bound])} per call, {bound}-bound "
            f"({seconds(sum(times.values()))} if nothing overlaps)"
        )
    return "\n".join(lines)


def held_together(holder: str, reports: list[Report]) -> str:
    """What `holder`, a process that keeps every program of `reports` compiled and runs one at a time over the same
    weights (a server's start-up set), needs per device: the largest call's arguments, outputs and temporaries,
    and the code of them all. A program XLA refused counts with what it needed at least."""
    if not reports:
        return f"{holder}: no programs"
    code = sum(report.memory["code"] for report in reports if report.memory)
    call = max(report.needed - (report.memory["code"] if report.memory else 0) for report in reports)
    needed, first = call + code, reports[0]
    refused = any(report.refused for report in reports)
    verdict = f"fits ({needed / first.hbm:.0%})" if not refused and needed <= first.hbm else "DOES NOT FIT"
    return "\n".join(
        [
            f"{holder}: its {len(reports)} programs held at once, one running at a time over the same weights",
            f"  memory       per device: the largest call's arguments, outputs and temporaries {size(call)}, the code "
            f"of all {len(reports)} programs {size(code)}",
            f"               needs {'at least ' if refused else ''}{size(needed)} per device of a "
            f"{first.slice.chip.name} device's {size(first.hbm)} HBM: {verdict}",
        ]
    )


def compile_for(
    slice_name: str,
    build: Callable[[list], list[Program]],
    refits: Callable[[list], Iterable[tuple[str, Callable[[], list[Program]]]]] | None = None,
    out=None,
) -> list[Report]:
    """Compile the programs `build(devices)` returns for the slice `slice_name` and print a report for each.

    `refits(devices)` yields `(flag, build)` alternatives in the order a user should prefer them (another mesh, a
    smaller batch); for a program that does not fit, up to `MAX_REFITS` of them are compiled and the first whose
    program of the same place fits is named in its report."""
    out = out or sys.stdout
    tpu = parse_slice(slice_name)
    # compile-only programs are no use in the on-disk cache of compiled programs
    jax.config.update("jax_enable_compilation_cache", False)
    if "JAX_PLATFORMS" not in os.environ:  # this machine's own devices: the CPU (no probing for a TPU client)
        jax.config.update("jax_platforms", "cpu")
    devices = topology_devices(tpu)
    reports = []
    programs = build(devices)
    for index, program in enumerate(programs):
        report = analyse(tpu, program)
        if not report.fits and refits is not None:
            for flag, alternative in list(refits(devices))[:MAX_REFITS]:
                other = alternative()[index]
                other = analyse(tpu, other)
                if other.fits:
                    report.refit = f"{flag} ({size(other.needed)} per device)"
                    break
                report.tried.append(flag)
        print(format_report(report), file=out, flush=True)
        reports.append(report)
    return reports

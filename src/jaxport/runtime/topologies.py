"""What the project assumes about accelerators it may not be running on: one table of datasheet figures per chip
(dense bf16 peak, HBM capacity and bandwidth, inter-chip bandwidth) and Cloud TPU's slice names.

Cloud TPU names a slice `vX-N`: N counts TensorCores on v2, v3, v4 and v5p (two per chip) and chips on v5e and
v6e (one TensorCore each). JAX sees one device per TensorCore on v2 and v3 and one per chip elsewhere (v4's and
v5p's two TensorCores act as one "megacore" device), so a v2-8 has 8 devices with 8 GiB of HBM each, a v4-8 has 4
with 32 GiB and a v5e-8 has 8 with 16 GiB. The figures are Google's published ones (Cloud TPU's system
architecture pages; v2's and v3's inter-chip links from Jouppi et al., "A Domain-Specific Supercomputer for
Training Deep Neural Networks", CACM 2020), per chip as published; `Chip` divides them among the chip's devices.
"""

import dataclasses
import math
import re

from jaxport.errors import JaxportError

GiB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator kind, its figures per chip as published."""

    name: str  # Cloud TPU's generation name (v5e) or the GPU's
    device_kinds: tuple[str, ...]  # substrings of `jax.Device.device_kind` that name it (matched in table order)
    peak_flops: float  # dense bf16 FLOP/s
    hbm_bytes: int | None = None
    hbm_bandwidth: float | None = None  # bytes/s
    ici_bandwidth: float | None = None  # bytes/s leaving the chip over all its inter-chip links, one direction
    devices_per_chip: int = 1  # JAX devices: 2 where each TensorCore is one (v2, v3)
    # Cloud TPU's slice names and libtpu's topologies (TPUs only)
    name_counts_cores: bool = False  # the N of vX-N counts TensorCores (2 per chip), else chips
    topology_name: str | None = None  # libtpu's generation name, e.g. "v5" in "v5:2x2x1"
    torus_dims: int = 2
    chip_config: str = "default"  # libtpu's chip configuration: "megacore" joins a chip's TensorCores

    def per_device(self, value):
        """A per-chip figure divided among the chip's devices (None stays None)."""
        return None if value is None else value / self.devices_per_chip


CHIPS = (
    Chip("H200", ("H200",), 989e12),
    Chip("H100 PCIe", ("H100 PCIe",), 756e12),
    Chip("H100", ("H100",), 989e12),
    Chip("A100", ("A100",), 312e12),
    Chip(
        "v6e",
        ("TPU v6 lite", "TPU v6e"),
        918e12,
        32 * GiB,
        1638e9,
        400e9,
        topology_name="v6e",
    ),
    Chip("v5e", ("TPU v5 lite", "TPU v5e"), 197e12, 16 * GiB, 819e9, 200e9, topology_name="v5e"),
    Chip(
        "v5p",
        ("TPU v5p", "TPU v5"),
        459e12,
        95 * GiB,
        2765e9,
        600e9,
        name_counts_cores=True,
        topology_name="v5",
        torus_dims=3,
        chip_config="megacore",
    ),
    Chip(
        "v4",
        ("TPU v4",),
        275e12,
        32 * GiB,
        1200e9,
        300e9,
        name_counts_cores=True,
        topology_name="v4",
        torus_dims=3,
        chip_config="megacore",
    ),
    Chip(
        "v3",
        ("TPU v3",),
        123e12,
        32 * GiB,
        900e9,
        4 * 656e9 / 8,
        devices_per_chip=2,
        name_counts_cores=True,
        topology_name="v3",
    ),
    Chip(
        "v2",
        ("TPU v2",),
        45e12,
        16 * GiB,
        700e9,
        4 * 496e9 / 8,
        devices_per_chip=2,
        name_counts_cores=True,
        topology_name="v2",
    ),
)
TPUS = {chip.name: chip for chip in CHIPS if chip.topology_name}


def chip_of(device_kind: str) -> Chip | None:
    """The chip a `jax.Device.device_kind` names (first match in table order), or None."""
    kind = device_kind.lower()
    return next((c for c in CHIPS if any(k.lower() in kind for k in c.device_kinds)), None)


def device_peak_flops(device=None) -> tuple[float | None, str]:
    """(dense bf16 peak FLOP/s of one device, or None where unknown; the device's kind) of `device` (default: the
    first device)."""
    if device is None:
        import jax

        device = jax.devices()[0]
    chip = chip_of(device.device_kind)
    return (chip.per_device(chip.peak_flops) if chip else None), device.device_kind


@dataclasses.dataclass(frozen=True)
class Slice:
    """A Cloud TPU slice: its chip and the chips along each dimension of its torus."""

    name: str
    chip: Chip
    shape: tuple[int, ...]

    @property
    def chips(self) -> int:
        return math.prod(self.shape)

    @property
    def devices(self) -> int:
        return self.chips * self.chip.devices_per_chip

    @property
    def topology(self) -> str:
        """libtpu's name for it, e.g. "v4:2x4x4"."""
        return f"{self.chip.topology_name}:{'x'.join(map(str, self.shape))}"

    @property
    def wrap(self) -> tuple[bool, bool, bool]:
        """Which dimensions close into a ring: whole 4x4x4 cubes (v4, v5p) and 16-chip rows (2-D slices)."""
        full = 4 if self.chip.torus_dims == 3 else 16
        if self.chip.torus_dims == 3 and self.chips < 64:
            return (False, False, False)
        return tuple(i < len(self.shape) and self.shape[i] >= full for i in range(3))

    @property
    def chips_per_host(self) -> tuple[int, int, int]:
        return (1, 1, 1) if self.chips == 1 else (2, 2, 1)


def slice_shape(chip: Chip, chips: int) -> tuple[int, ...]:
    """Cloud TPU's shape for a slice of `chips` (a power of two): 2-D as even as it goes (2x4, 4x4, 4x8, ...); 3-D
    from a 2x2x1 host, doubling the shortest dimension, the last first (2x2x2, 2x2x4, 2x4x4, 4x4x4, 4x4x8, ...)."""
    exponent = chips.bit_length() - 1
    if chip.torus_dims == 2:
        return (1 << (exponent // 2), 1 << (exponent - exponent // 2))
    if chips < 8:
        return {1: (1, 1, 1), 2: (1, 2, 1), 4: (2, 2, 1)}[chips]
    return tuple(1 << (exponent // 3 + (i >= 3 - exponent % 3)) for i in range(3))


def parse_slice(name: str) -> Slice:
    """A Cloud TPU slice from its name: `v2-8`, `v3-32`, `v4-8` .. `v4-4096`, `v5e-8`, `v5p-64`, `v6e-256`
    (`v5litepod-8` is accepted for `v5e-8`)."""
    examples = "v2-8, v3-8, v4-8, v4-64, v5e-8, v5p-64, v6e-8"
    found = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", name.strip().lower().replace("v5litepod", "v5e"))
    chip = TPUS.get(found.group(1)) if found else None
    if chip is None:
        raise JaxportError(
            f"--compile-for {name!r}: not a Cloud TPU slice name; use a generation ({', '.join(TPUS)}) and its "
            f"size as Cloud TPU names them, e.g. {examples}"
        )
    count = int(found.group(2))
    per_name = 2 if chip.name_counts_cores else 1
    chips = count // per_name
    if count % per_name or chips < 1 or chips & (chips - 1):
        unit = "TensorCores, two per chip" if chip.name_counts_cores else "chips"
        raise JaxportError(
            f"--compile-for {name}: {chip.name}'s size counts {unit}, a power of two "
            f"(e.g. {chip.name}-{per_name * 4}, {chip.name}-{per_name * 32})"
        )
    return Slice(f"{chip.name}-{count}", chip, slice_shape(chip, chips))


def slice_table(names=("v2-8", "v3-8", "v4-8", "v4-64", "v5e-8", "v5p-8", "v5p-64", "v6e-8")) -> str:
    """Markdown: each slice's chips, devices, HBM per device and libtpu topology (the docs' table)."""
    rows = [
        "| slice | chips | JAX devices | HBM per device | peak bf16 per device | libtpu topology |",
        "|---|---|---|---|---|---|",
    ]
    for name in names:
        s = parse_slice(name)
        rows.append(
            f"| {s.name} | {s.chips} | {s.devices} | {s.chip.per_device(s.chip.hbm_bytes) / GiB:g} GiB | "
            f"{s.chip.per_device(s.chip.peak_flops) / 1e12:g} TFLOP/s | {s.topology} |"
        )
    return "\n".join(rows)


def chip_table() -> str:
    """Markdown: the figures assumed per TPU chip (the roofline's and the MFU's)."""
    rows = [
        "| chip | peak bf16 | HBM | HBM bandwidth | inter-chip links (one direction) | JAX devices per chip |",
        "|---|---|---|---|---|---|",
    ]
    for chip in CHIPS:
        if chip.topology_name:
            rows.append(
                f"| {chip.name} | {chip.peak_flops / 1e12:g} TFLOP/s | {chip.hbm_bytes / GiB:g} GiB | "
                f"{chip.hbm_bandwidth / 1e9:g} GB/s | {chip.ici_bandwidth / 1e9:g} GB/s | {chip.devices_per_chip} |"
            )
    return "\n".join(rows)

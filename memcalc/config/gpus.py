"""GPU presets: the one table of what a card has, for `estimate`/`fit` (memory) and `comm` (speed).

Memory is the usable bytes the driver reports, not the marketing capacity:
CUDA's total global memory (`torch.cuda.get_device_properties().total_memory`,
deviceQuery, or `nvidia-smi --query-gpu=memory.total` in MiB, which agree on
H100) on NVIDIA cards, `rocm-smi --showmeminfo vram` (bytes) on AMD, as
published in users' logs of those tools on each card; each row says which. An
"80GB" H100 reports 81559 MiB = 79.65 GiB, so 80 GiB would promise 0.35 GiB
that is not there. Not measured here: a card whose driver reports otherwise
(another driver, ECC off, MIG) wants --device-memory. The driver's total still includes
what PyTorch's allocator never sees (the CUDA context, NCCL's buffers, the
fragmentation between cached blocks); `DEFAULT_RESERVE` stands for that and
the verdict subtracts it.

Speed is the vendors' peak dense 16-bit TFLOPS and one direction of the
tensor-parallel link (`memcalc.model.overlap`).
"""

from __future__ import annotations

from memcalc.errors import ConfigError
from memcalc.records import record

MIB = 2**20


@record
class Gpu:
    """One card: usable memory (bytes, as its driver reports it), peak dense 16-bit throughput, TP link."""

    name: str
    memory_bytes: int
    memory_source: str  # where the memory number comes from
    tflops: float
    link_gb_s: float


GPUS: dict[str, Gpu] = {g.name: g for g in (
    Gpu("a100-40gb", 42505273344, "CUDA's total global memory of an A100 40GB (deviceQuery; nvidia-smi 40537 MiB)",
        312.0, 300.0),  # NVLink 3: 600 GB/s both ways
    Gpu("a100-80gb", 85056798720, "torch.cuda total_memory of an A100-SXM4-80GB (CUDA 12.8)", 312.0, 300.0),
    Gpu("h100-80gb", 81559 * MIB, "nvidia-smi memory.total, and torch total_memory, of an H100 80GB HBM3", 989.0, 450.0),  # NVLink 4
    Gpu("h200", 143771 * MIB, "nvidia-smi memory.total of an H200 (141 GB HBM3e)", 989.0, 450.0),
    Gpu("b200", 183359 * MIB, "nvidia-smi memory.total of a B200 (180 GB HBM3e)", 2250.0, 900.0),  # NVLink 5
    Gpu("mi300x", 205822885888, "rocm-smi VRAM Total Memory of an MI300X (192 GB HBM3)", 1307.0, 448.0),  # 7 IF links
)}

# What the allocator does not see, taken off the driver's total before the verdict. An estimate, not a
# measurement: about 0.5 GiB of CUDA context and loaded kernels (cuBLAS, cuDNN, attention), about 1 GiB of
# NCCL buffers for the tp, dp and pp communicators (NCCL_BUFFSIZE 4 MiB per channel and peer, up to 32
# channels), and about 1.5 GiB (2% of an 80 GiB card) of fragmentation between the caching allocator's
# blocks. Runs that set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True fragment less; --reserve overrides.
DEFAULT_RESERVE = 3 * 2**30
DEFAULT_GPU = "h100-80gb"


@record
class Budget:
    """What a verdict compares against: the card's usable bytes less the reserve."""

    device_bytes: int
    reserve_bytes: int
    source: str  # the preset's name, or "--device-memory"

    @property
    def bytes(self) -> int:
        return self.device_bytes - self.reserve_bytes


def budget_for(name: str | None, device_memory: int | None, reserve: int | None) -> Budget:
    """The budget from a preset (default h100-80gb; --gpu's choices are GPUS' names) or an explicit --device-memory,
    less --reserve."""
    device = GPUS[name or DEFAULT_GPU]
    size, source = (device_memory, "--device-memory") if device_memory is not None else (device.memory_bytes, device.name)
    held = DEFAULT_RESERVE if reserve is None else reserve
    if held >= size:
        raise ConfigError(f"reserve={held} must be less than the device memory {size} ({source}): nothing would be left")
    return Budget(size, held, source)

"""Known sources of nondeterminism in PyTorch and torchvision, as data.

Each entry names the ops it covers (as the op-level recorder names them: ``namespace.op``,
without overload), the device and phase where they are nondeterministic, and what to do.
``deterministic_mode`` says what ``torch.use_deterministic_algorithms(True)`` does to them:
``"raises"`` (no deterministic implementation: an error, or a warning with warn_only),
``"switches"`` (a deterministic implementation is used instead) or ``"no effect"``.
Sources: the ``torch.use_deterministic_algorithms`` documentation and PyTorch's
reproducibility notes, torchvision's ``ops/`` sources.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Known:
    """One known-nondeterministic op (or op family) and its remedy."""

    ops: tuple[str, ...]
    device: str  # "cuda", "cpu" or "any"
    phase: str  # "forward", "backward" or "any" (the phase in which the op runs)
    what: str
    why: str
    remedy: str
    deterministic_mode: str
    torch: str = "all versions"
    accumulate: bool | None = None  # only when the op's `accumulate` argument is this
    when: str = "always"  # the settings under which runs differ: a key of CONDITIONS

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


KNOWN: tuple[Known, ...] = (
    Known(
        ops=("torchvision._roi_align_backward",), device="cuda", phase="backward",
        what="roi_align backward (RoIAlign in box_roi_pool / mask_roi_pool)",
        why="the CUDA kernel scatters each RoI bin's gradient into the feature map with "
        "atomicAdd; overlapping RoIs add in a different order every run",
        remedy="torch.use_deterministic_algorithms(True): torchvision then runs a pure-PyTorch "
        "roi_align whose backward is deterministic, at a memory cost: it materialises the "
        "sampling grid of every RoI, and with adaptive sampling (sampling_ratio=-1) that grid "
        "spans the whole input. Mask R-CNN's mask targets take that path on full-size masks "
        "(roi_heads.project_masks_on_boxes): K x 28 x 28 x H x W floats, 37.4 GiB for 20 "
        "positive RoIs at 800 px, which ran out of memory on a 141 GB GPU. Run that function "
        "with deterministic algorithms off (its CUDA forward is deterministic and the targets "
        "need no gradient), e.g. by wrapping "
        "torchvision.models.detection.roi_heads.project_masks_on_boxes",
        deterministic_mode="switches",
        torch="torchvision >= 0.16 (deterministic fallback); older versions: always atomic",
    ),
    Known(
        ops=("torchvision._roi_pool_backward", "torchvision._ps_roi_align_backward",
             "torchvision._ps_roi_pool_backward", "torchvision._deform_conv2d_backward"),
        device="cuda", phase="backward",
        what="roi_pool / ps_roi_align / ps_roi_pool / deform_conv2d backward",
        why="CUDA kernels accumulate gradients with atomicAdd; the order of the adds varies",
        remedy="no deterministic implementation: audit with them, or run the backward on CPU "
        "for the steps you need bit-exact",
        deterministic_mode="raises",
    ),
    Known(
        ops=("torchvision.nms",), device="any", phase="forward",
        what="nms with tied or nearly tied scores",
        why="torchvision's nms sorts scores with a stable sort, so on one device ties keep "
        "their order run to run; but CPU and CUDA break ties differently, and any earlier "
        "1-ULP difference in two near-equal scores changes which box is kept, reordering "
        "proposals and everything downstream",
        remedy="break ties before NMS (e.g. add a tiny index-dependent offset to the scores); "
        "make what feeds the scores deterministic",
        deterministic_mode="no effect",
    ),
    Known(
        ops=("aten.randperm",), device="any", phase="forward",
        what="randperm in the RPN / RoI fg-bg sampler (BalancedPositiveNegativeSampler)",
        why="it draws from the global torch RNG: any change in how much randomness was drawn "
        "earlier changes which proposals are sampled",
        remedy="seed every RNG identically (detaudit.seed_everything) and make sure nothing "
        "else draws a data-dependent amount of randomness before it",
        deterministic_mode="no effect",
    ),
    Known(
        ops=("aten.index_put", "aten.index_put_", "aten._index_put_impl_"), device="any",
        phase="any",
        what="index_put_ with accumulate=True over duplicate indices (also the backward of "
        "advanced indexing x[idx], which is an index_put with accumulate)",
        why="duplicate indices are summed in parallel: on CUDA with atomics, on CPU across "
        "threads, so the order of the additions varies run to run",
        remedy="torch.use_deterministic_algorithms(True) (sort-based / serial accumulation), "
        "or run on 1 CPU thread",
        deterministic_mode="switches", accumulate=True,
    ),
    Known(
        ops=("aten.index_add", "aten.index_add_", "aten.scatter_add", "aten.scatter_add_",
             "aten.scatter_reduce", "aten.scatter_reduce_", "aten.index_reduce",
             "aten.embedding_dense_backward", "aten._embedding_bag_dense_backward",
             "aten.put_"),
        device="cuda", phase="any",
        what="scatter/index accumulation (index_add_, scatter_add_, scatter_reduce_, "
        "embedding backward, put_ with accumulate)",
        why="CUDA kernels accumulate with atomicAdd",
        remedy="torch.use_deterministic_algorithms(True) (deterministic kernels for most; "
        "scatter_reduce with 'prod' and index_reduce still raise)",
        deterministic_mode="switches",
    ),
    Known(
        ops=("aten.upsample_bilinear2d_backward", "aten.upsample_nearest2d_backward",
             "aten.upsample_bicubic2d_backward", "aten._adaptive_avg_pool2d_backward",
             "aten.adaptive_max_pool2d_backward", "aten.max_pool3d_with_indices_backward",
             "aten.grid_sampler_2d_backward", "aten.avg_pool3d_backward",
             "aten.reflection_pad2d_backward", "aten.replication_pad2d_backward",
             "aten.nll_loss2d_forward", "aten.histc", "aten.bincount", "aten.kthvalue",
             "aten.median", "aten.cumsum"),
        device="cuda", phase="any",
        what="CUDA ops documented as nondeterministic (interpolate / pooling / padding "
        "backward, grid_sample backward, histc, bincount with weights, kthvalue, median, ...)",
        why="their CUDA kernels use atomics or unordered reductions",
        remedy="torch.use_deterministic_algorithms(True): these raise (or warn with "
        "warn_only=True); replace the op or accept the variation",
        deterministic_mode="raises",
    ),
    Known(
        ops=("aten.convolution", "aten.convolution_backward", "aten.cudnn_convolution"),
        device="cuda", phase="any",
        what="cuDNN convolution with benchmark mode or nondeterministic algorithms",
        why="cudnn.benchmark picks the fastest algorithm per run, and some algorithms "
        "(e.g. backward-filter with atomics) are nondeterministic",
        remedy="torch.backends.cudnn.benchmark = False; torch.backends.cudnn.deterministic = "
        "True (or use_deterministic_algorithms(True))",
        deterministic_mode="switches", when="cudnn may choose",
    ),
    Known(
        ops=("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.matmul"),
        device="cuda", phase="any",
        what="cuBLAS matmul with CUDA >= 10.2 workspaces",
        why="cuBLAS may split reductions differently across streams unless its workspace is "
        "fixed",
        remedy="export CUBLAS_WORKSPACE_CONFIG=:4096:8 (or :16:8) before the process starts, "
        "with use_deterministic_algorithms(True)",
        deterministic_mode="raises",
        torch="CUDA >= 10.2", when="cublas workspace unset",
    ),
    Known(
        ops=("aten.put_",), device="cpu", phase="any",
        what="put_ with accumulate=False and duplicate indices",
        why="which duplicate write wins is unspecified",
        remedy="deduplicate the indices, or use accumulate=True",
        deterministic_mode="raises", accumulate=False,
    ),
    Known(
        ops=("aten.convolution", "aten.convolution_backward", "aten.sum", "aten.mean",
             "aten.mm", "aten.addmm", "aten.native_batch_norm",
             "aten.native_batch_norm_backward"),
        device="cpu", phase="any",
        what="thread-count-dependent CPU reductions and convolutions",
        why="oneDNN/OpenMP split reductions by thread count: results are reproducible at a "
        "fixed thread count but differ between, e.g., 1 and 2 threads or machines; Intel "
        "MKL (matmuls, convolutions oneDNN does not take) may also pick code paths that "
        "differ from run to run at one thread count on some CPUs (seen: the backward of a "
        "3x3 convolution over a 1x1 map, 2 threads, a Xeon with AVX-512) unless MKL_CBWR "
        "is set",
        remedy="pin torch.set_num_threads(N) (and OMP_NUM_THREADS) to the same value "
        "everywhere you compare runs; where runs at one thread count differ, export "
        "MKL_CBWR=AUTO before the process starts (COMPATIBLE to agree across machines)",
        deterministic_mode="no effect", when="thread count changes",
    ),
)

# When an entry makes two runs with the same settings differ, from the environment a run
# recorded (detaudit.record.environment); without an environment every entry applies.
CONDITIONS: dict[str, Callable[[dict[str, Any]], bool]] = {
    "always": lambda env: True,
    "cudnn may choose": lambda env: bool(env.get("cudnn_benchmark"))
    or not (env.get("cudnn_deterministic") or env.get("deterministic_algorithms")),
    "cublas workspace unset": lambda env: env.get("CUBLAS_WORKSPACE_CONFIG")
    not in (":4096:8", ":16:8"),
    # runs at one thread count agree: only comparisons across thread counts differ
    "thread count changes": lambda env: False,
}


def lookup(
    op: str, phase: str = "any", device: str = "any", accumulate: bool | None = None
) -> list[Known]:
    """Entries that cover `op` in `phase` on `device` (device "cuda:1" matches "cuda");
    `accumulate`, when known, is the op's own `accumulate` argument."""
    kind = device.split(":")[0]
    return [
        k for k in KNOWN
        if op in k.ops
        and (k.phase == "any" or phase == "any" or k.phase == phase)
        and (k.device == "any" or kind == "any" or k.device == kind)
        and (k.accumulate is None or accumulate is None or k.accumulate == accumulate)
    ]


def applicable(
    op: str, phase: str, device: str, env: dict[str, Any] | None = None,
    accumulate: bool | None = None,
) -> list[Known]:
    """The entries under which `op` makes two runs differ there, with the settings `env`
    records (cuDNN and cuBLAS ops only when those settings leave them free to vary)."""
    return [k for k in lookup(op, phase, device, accumulate)
            if env is None and k.when != "thread count changes"
            or env is not None and CONDITIONS[k.when](env)]
